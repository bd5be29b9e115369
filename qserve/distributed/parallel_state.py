"""The tensor-parallel group: which rank this process is, how many there are, and the few
collectives the model and the engine need (all-reduce, all-gather, object broadcast and
gather, min).

Knows: ``torch.distributed`` (gloo on CPU, NCCL on CUDA) and how to start / tear down a process
group from an ``init_method`` URL. Must not know: models, weights, engines. A ``TPGroup`` is an
explicit object passed down to every module that communicates; there is no module-level
"current group" here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Set in every tensor-parallel process (rank 0 included) before NCCL starts: NVLink SHARP /
# multicast paths are not available on the machines qserve is lent (see the device notes).
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
DEFAULT_TIMEOUT_S = 600


@dataclass(eq=False)
class TPGroup:
    """One process's view of its tensor-parallel group (ranks ``0 .. size-1``; rank 0 drives)."""

    rank: int
    size: int
    backend: str  # "gloo" | "nccl"
    device: torch.device  # this rank's device (collective tensors live here)
    group: Any = None  # torch.distributed ProcessGroup spanning the ranks

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks, in place; returns ``x``."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on each) along ``dim``, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src`` sends a picklable object; every rank returns it."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group, device=self._object_device())
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank (a reply to rank 0)."""
        if self.size == 1:
            return [obj]
        box: list[Any] = [None] * self.size
        dist.all_gather_object(box, obj, group=self.group)
        return box

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over ranks (e.g. KV blocks every rank can hold)."""
        if self.size == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    def _object_device(self) -> torch.device | None:
        return self.device if self.backend == "nccl" else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on ``host`` (the rendezvous of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One device per rank: ``cuda:rank`` on CUDA; every rank shares the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def init_tp_group(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> TPGroup:
    """Join the group (blocks until all ``size`` ranks arrived) and return this rank's view.

    torch.distributed keeps one default group per process, so one process can be in one
    tensor-parallel group at a time; ``destroy_tp_group`` releases it.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "this process is already in a torch.distributed group (another tensor-parallel engine is running "
            "here?); shut it down first (LLM.shutdown())"
        )
    backend = backend_for(device)
    if backend == "nccl":
        os.environ.update(NCCL_SAFE_ENV)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )
    return TPGroup(rank=rank, size=size, backend=backend, device=device, group=dist.group.WORLD)


def destroy_tp_group(tp: TPGroup) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
