"""Measuring what the trainer's model allocates on CPU: live tensor storages, their peak, per-layer saved bytes.

`LiveBytes` is a TorchDispatchMode that sees every tensor an op returns, keys it by its storage (so views and
in-place results count once) and drops it when the storage is freed (a weakref finalizer), the CPU analogue of
`torch.cuda.memory_allocated` / `max_memory_allocated` for what is created inside it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside this mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.external: set[int] = set()
        # A storage can be freed on another thread (gloo's, which drops a collective's buffers): `current -= n` there
        # and `current += n` here would lose one of the two updates without it.
        self._lock = threading.Lock()

    def ignore(self, tensors: Any) -> None:
        """Storages created before this mode (parameters): views of them are not new memory."""
        for tensor in tensors:
            self.external.add(tensor.untyped_storage().data_ptr())

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self.live.pop(key, 0)

    def _track(self, tensor: torch.Tensor) -> None:
        # A wrapper subclass holds no storage of its own: a DTensor's local shard (its op ran unseen, inside this
        # mode), a functional collective's result (AsyncCollectiveTensor) its `elem`, is the memory.
        for attribute in ("_local_tensor", "elem"):
            inner = getattr(tensor, attribute, None)
            if isinstance(inner, torch.Tensor):
                return self._track(inner)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            if storage.nbytes() == 0 or key in self.live or key in self.external:
                return
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and not item.is_meta:
                self._track(item)
        return out

    def reset_peak(self) -> None:
        self.peak = self.current
