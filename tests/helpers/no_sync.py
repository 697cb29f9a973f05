"""A dispatch mode that fails on host-device synchronisation (illegal in graph capture)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default,
                 aten.is_nonzero.default, aten.item.default}


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads device data on the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNC_OPS:
            raise AssertionError(f"host-device synchronisation in a captured region: {func}")
        return func(*args, **(kwargs or {}))
