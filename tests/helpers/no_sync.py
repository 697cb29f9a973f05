"""A dispatch mode that fails on host-device synchronisation (illegal in graph capture)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default,
                 aten.is_nonzero.default, aten.item.default}


# Ops whose output shape depends on tensor data when given a boolean mask: on CUDA they copy
# the mask's count to the host (``x[mask]``, ``x[mask] = v``, ``masked_select``).
MASK_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                  aten._index_put_impl_.default}


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads device data on the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNC_OPS or func is aten.masked_select.default or (
                func in MASK_INDEX_OPS and len(args) > 1
                and any(_is_mask(i) for i in args[1] if i is not None)):
            raise AssertionError(f"host-device synchronisation in a captured region: {func}")
        return func(*args, **(kwargs or {}))
