"""Count the bytes of live tensor storage while a block runs, and its peak: torch's own accounting of what
its operators allocate, independent of RSS, page cache and allocator caching.

Why: the streamed quantizer promises memory that does not grow with the number of layers; a test can
only hold it to that with a measure of tensors alone. Every tensor an ATen operator returns (on any
device but meta) is counted once per storage until that storage is freed.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class LiveTensorBytes(TorchDispatchMode):
    """`with LiveTensorBytes() as m: ...`, then `m.peak` (bytes) and `m.live` (still allocated)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out
