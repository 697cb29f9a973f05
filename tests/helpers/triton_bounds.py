"""Triton's interpreter for the CPU test suite: memory-safety checks, and a numpy fix.

On a GPU a kernel that loads or stores outside its tensors reads garbage, silently corrupts a
neighbouring allocation, or faults with "an illegal memory access" (often much later, in an
unrelated call). In the interpreter the same access reads or writes host memory unchecked.
``install()`` makes every interpreted launch record the storages of the tensors passed to it and
every load and store check, for the lanes its mask enables, that the bytes it touches lie
inside one of them; an access outside raises ``OutOfBoundsAccess`` naming the kernel.
"""

from __future__ import annotations

import numpy as np

_RANGES: list[tuple[int, int]] = []  # [start, end) byte ranges of the running launch's tensors
_KERNEL: list[str] = [""]


class OutOfBoundsAccess(AssertionError):
    """A Triton kernel touched memory outside every tensor it was given."""


def _collect(arg: object, out: list[tuple[int, int]]) -> None:
    if isinstance(arg, (tuple, list)):
        for a in arg:
            _collect(a, out)
    elif hasattr(arg, "untyped_storage"):
        storage = arg.untyped_storage()
        out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    elif hasattr(arg, "base"):  # a tensor descriptor
        _collect(arg.base, out)


def check_addresses(addresses: np.ndarray, itemsize: int, ranges: list[tuple[int, int]],
                    what: str, kernel: str) -> None:
    """Every address (with ``itemsize`` bytes from it) inside one of ``ranges``."""
    if addresses.size == 0:
        return
    addr = addresses.astype(np.uint64).ravel()
    lo, hi = int(addr.min()), int(addr.max()) + itemsize
    if any(start <= lo and hi <= end for start, end in ranges):
        return  # the common case: one tensor holds them all
    inside = np.zeros(addr.shape, dtype=bool)
    for start, end in ranges:
        inside |= (addr >= start) & (addr + itemsize <= end)
    if not inside.all():
        bad = int(addr[~inside][0])
        near = min(ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])), default=None)
        raise OutOfBoundsAccess(
            f"{kernel}: {what} of {int((~inside).sum())} element(s) outside every argument "
            f"tensor (first at {bad:#x}; nearest tensor spans {near[0]:#x}..{near[1]:#x})"
            if near else f"{kernel}: {what} with no tensor arguments")


def install() -> None:
    """Patches Triton's interpreter (idempotent); a no-op where Triton is missing."""
    try:
        from triton.runtime import interpreter as it
    except ImportError:
        return
    if getattr(it, "_bounds_checked", False):
        return
    init_args = it.GridExecutor._init_args_hst

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges: list[tuple[int, int]] = []
        _collect(list(args_hst) + list(kwargs_hst.values()), ranges)
        _RANGES[:] = ranges
        _KERNEL[0] = getattr(self.fn, "__name__", "kernel")
        return args_hst, kwargs_hst

    builder = it.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def _itemsize(ptrs) -> int:
        return np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize

    def _enabled(ptrs, mask) -> np.ndarray:
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), ptrs.data.shape)
        return ptrs.data[m]

    def masked_load(self, ptrs, mask, other, *args):
        check_addresses(_enabled(ptrs, mask), _itemsize(ptrs), _RANGES, "load", _KERNEL[0])
        return load(self, ptrs, mask, other, *args)

    def masked_store(self, ptrs, value, mask, *args):
        check_addresses(_enabled(ptrs, mask), _itemsize(ptrs), _RANGES, "store", _KERNEL[0])
        return store(self, ptrs, value, mask, *args)

    it.GridExecutor._init_args_hst = init_args_checked
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    it._bounds_checked = True


def patch_scalar_index() -> None:
    """Triton 3.6's interpreter turns scalars (1-element arrays) into loop bounds with ``int()``,
    which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed after 3.6). Run-time loop bounds
    need it, so the one conversion is patched (idempotent; a no-op without Triton)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_index_patched_for_numpy", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._index_patched_for_numpy = True
