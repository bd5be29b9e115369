"""Peak bytes of tensor storage alive while some torch code runs, on any device (CPU included).

Knows: a ``TorchDispatchMode`` that sees every tensor an aten op returns, counts each new storage
once (by its data pointer) and un-counts it when the last tracked tensor viewing it is freed.
Tensors that existed before the mode (weights, KV caches, inputs) are not counted, so ``peak``
is the transient memory of the code inside the ``with`` block: what a caching allocator would
have to find on top of what was already allocated. Must not know: qserve.

CPU tensors and CUDA tensors come from the same ops, so on CPU this measures what the CUDA
allocator would be asked for by the same code (minus kernels' own workspaces, e.g. CUB sort).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tracked tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [nbytes, 0]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.current -= entry[0]
