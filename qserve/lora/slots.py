"""The adapters of one model: registered names, host copies (LRU, ``max_cpu_loras``), device slots
(LRU, ``max_loras``) and each step's row-to-slot indices.

Knows: which layers of the decoder take LoRA (q/k/v, o, gate/up, down: ``lora_targets``), the stacked
slot tensors each of them holds (``LoRALayerWeights``, attached as ``layer.lora``), how a registered
adapter gets into a slot (its host copy, read again from its directory when the host cache dropped
it), and which adapters are pinned by unfinished requests. Under tensor parallelism an adapter is
checked against the whole layers' sizes, then each layer keeps its rank's part
(``Linear.shard_lora``): the slots, and ``nbytes``, are this rank's; rank 0's registry changes are
replayed on the other ranks (``journal`` / ``replay``, sent by ``qserve.distributed.worker``). An
adapter is added on every rank or on none: rank 0's ``add`` waits for the other ranks' reads
(``publish``) and undoes its own if one of them failed. Must not know: scheduling policy, HTTP,
kernels (``quant_kernels.lora_ops`` computes).

Slots change only in ``prepare``, at the start of a step, for the adapters of that step; the copies are
enqueued on the current stream, so a step still in flight (async scheduling) finishes with the
slot's old contents before they are overwritten. An adapter removed while requests still use it
stays loaded until the last of them finishes (``release``).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from qserve.layers.linear import Linear
from qserve.lora.peft import LoRAAdapter, TargetLayer, load_peft_adapter
from qserve.lora.request import LoRAConfig, LoRARequest
from qserve.model.llama import FUSED_SLICES, MLP, Attention
from quant_kernels import lora_ops
from quant_kernels.lora_ops import LoRAIndices, build_lora_indices

logger = logging.getLogger(__name__)

_ADAPTED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class LoRALayerWeights:
    """One layer's slots: ``a`` ``[L, S * R, K]``, ``b`` ``[L, N, R]`` (quant_kernels.reference_lora)."""

    a: torch.Tensor
    b: torch.Tensor
    slice_starts: tuple[int, ...]  # S + 1 bounds along N


def lora_targets(model: nn.Module) -> dict[str, tuple[Linear, TargetLayer]]:
    """The decoder's linear layers LoRA may adapt, with their HF slice names: the attention projections
    and a dense MLP's (a mixture-of-experts block's experts take no LoRA)."""
    parents = {  # a decoder layer's own attention and dense MLP (not an MoE block's shared expert)
        name
        for name, module in model.named_modules()
        if (isinstance(module, Attention) and name.endswith(".self_attn"))
        or (isinstance(module, MLP) and name.endswith(".mlp"))
    }
    result = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, Linear) and leaf in _ADAPTED and name.rpartition(".")[0] in parents:
            parent = name.rpartition(".")[0]
            names = tuple(f"{parent}.{hf}" for hf in FUSED_SLICES.get(leaf, (leaf,)))
            in_features, output_sizes = module.lora_full_sizes()  # the whole layer's, under tensor parallelism too
            target = TargetLayer(name, in_features, names, tuple(output_sizes))
            result[name] = (module, target)
    return result


def lora_slot_bytes(model: nn.Module, config: LoRAConfig, dtype: torch.dtype) -> int:
    """Device bytes of every layer's slots on this rank (what the memory plan sets aside): the
    layers' own sizes, so a tensor-parallel shard counts its part only."""
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for layer, target in lora_targets(model).values():
        num_slices = len(target.slice_sizes)
        per_slot = num_slices * config.max_lora_rank * layer.in_features + layer.out_features * config.max_lora_rank
        total += config.max_loras * per_slot * size
    return total


@dataclass(eq=False)
class _Entry:
    lora_id: int  # qserve's own id: unique per load (a re-added name gets a new one)
    request: LoRARequest
    adapter: LoRAAdapter | None  # None: dropped from the host cache, read again when needed
    refs: int = 0  # unfinished requests using it
    removed: bool = False


class LoRAManager:
    """The adapters of one model (see the module doc)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        # QSERVE_LORA_OVERLAP (CUDA): the side stream the step's shrinks run on beside the base GEMMs
        self.overlap = lora_ops.overlap_for(device)
        lora_ops.expand_block_n_setting()  # a bad QSERVE_LORA_EXPAND_BLOCK_N stops the load, not a later step
        rank = config.max_lora_rank
        self.targets: dict[str, TargetLayer] = {}  # the whole layers' sizes: what adapters are checked against
        self.layers: dict[str, LoRALayerWeights] = {}
        self._modules: dict[str, Linear] = {}
        for name, (layer, target) in lora_targets(model).items():
            num_slices = len(target.slice_sizes)
            # The slots hold this rank's part (Linear.shard_lora): a tensor-parallel layer's own sizes.
            local_starts = tuple(itertools.accumulate(layer.output_sizes, initial=0))
            weights = LoRALayerWeights(
                torch.zeros(config.max_loras, num_slices * rank, layer.in_features, dtype=dtype, device=device),
                torch.zeros(config.max_loras, layer.out_features, rank, dtype=dtype, device=device),
                local_starts,
            )
            layer.lora = weights  # Linear.forward adds it when the step passes LoRA indices
            self.targets[name] = target
            self.layers[name] = weights
            self._modules[name] = layer
        if not self.layers:
            raise ValueError("enable_lora: this model has no layer LoRA can adapt")
        self._b_row_order = _b_row_order(model)
        self._ids = itertools.count(1)
        self._by_name: dict[str, _Entry] = {}
        self._by_id: dict[int, _Entry] = {}
        self._host_lru: OrderedDict[int, None] = OrderedDict()  # ids with a host copy, oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # resident ids -> slot, oldest use first
        self._free_slots = list(range(config.max_loras - 1, -1, -1))
        # Tensor parallelism: rank 0's manager records every change of its registry here (set to a
        # list by the step broadcaster, qserve.distributed.worker), in order, so that the other
        # ranks' managers replay them (``replay``) before the next step and assign the same slots.
        self.journal: list[tuple] | None = None
        # Set with ``journal``: sends it to the other ranks now and returns their failed adds,
        # ``(rank, lora_id, reason)``; ``add`` calls it so that a load fails on every rank or on none.
        self.publish: Callable[[], list[tuple[int, int, str]]] | None = None

    # ---------------------------------------------------------------- registry
    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.layers.values())

    def add(self, request: LoRARequest) -> int:
        """Register (reading and checking the files now); returns its id. Adding a name again with
        the same path is a no-op; with another path it is refused (unload it first)."""
        entry = self._by_name.get(request.lora_name)
        if entry is not None:
            if entry.request.lora_path != request.lora_path:
                raise ValueError(
                    f"lora_name: adapter {request.lora_name!r} is already loaded from {entry.request.lora_path}; "
                    "unload it before loading another path under that name"
                )
            return entry.lora_id
        adapter = self._read(request)
        entry = self._register(next(self._ids), request, adapter)
        if self.journal is not None:
            self.journal.append(("add", entry.lora_id, request))
            if self.publish is not None:
                self._publish_add(entry)
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d, scale %g, %d layers, %.1f MiB)",
            request.lora_name, request.lora_path, adapter.rank, adapter.scale, len(adapter.layers), adapter.nbytes / 2**20,
        )  # fmt: skip
        return entry.lora_id

    def _register(self, lora_id: int, request: LoRARequest, adapter: LoRAAdapter | None) -> _Entry:
        entry = _Entry(lora_id, request, adapter)
        self._by_name[request.lora_name] = entry
        self._by_id[lora_id] = entry
        if adapter is not None:
            self._touch_host(entry)
        return entry

    def _publish_add(self, entry: _Entry) -> None:
        """Tensor parallelism: have every other rank read ``entry``'s adapter now. If one could not,
        drop it here and on the ranks that did read it, and raise naming the rank and its reason
        (the ranks stay in step: running requests go on)."""
        assert self.publish is not None
        failures = self.publish()
        if not failures:
            return
        self._drop(entry)  # journals the forget, which the next publish sends
        self.publish()
        rank, _, reason = failures[0]
        request = entry.request
        raise ValueError(
            f"lora_path: adapter {request.lora_name!r} ({request.lora_path}) could not be loaded on tensor-parallel "
            f"rank {rank}: {reason}; it is loaded on no rank"
        )

    def replay(self, changes: list[tuple]) -> list[tuple[int, str]]:
        """Apply another rank's ``journal`` (tensor parallelism): ``("add", id, request)`` registers
        the adapter under rank 0's id (reading this rank's shard of it), ``("forget", id)`` drops it
        and frees its slot, as rank 0 did. References and removal are rank 0's business.

        An add whose files this rank cannot read is skipped; returns those, ``(lora_id, reason)``,
        for rank 0 to undo it everywhere (``publish``)."""
        failures = []
        for op, lora_id, *rest in changes:
            if op == "add":
                (request,) = rest
                try:
                    adapter = self._read(request)
                except Exception as err:  # noqa: BLE001 - whatever it is, rank 0 reports it and undoes the add
                    reason = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
                    logger.warning("LoRA adapter %s from %s: %s", request.lora_name, request.lora_path, reason)
                    failures.append((lora_id, reason))
                    continue
                self._register(lora_id, request, adapter)
            elif op == "forget":
                entry = self._by_id.get(lora_id)
                if entry is not None:
                    self._drop(entry)
            else:
                raise ValueError(f"LoRA journal: unknown change {op!r}")
        return failures

    def _drop(self, entry: _Entry) -> None:
        """Unregister an adapter no request holds (its name too, unless loaded again since)."""
        if self._by_name.get(entry.request.lora_name) is entry:
            del self._by_name[entry.request.lora_name]
        self._forget(entry)

    def remove(self, name: str) -> bool:
        """Unregister ``name``; False if unknown. Requests already using it finish with it."""
        entry = self._by_name.pop(name, None)
        if entry is None:
            return False
        entry.removed = True
        if entry.refs == 0:
            self._forget(entry)
        return True

    def lookup(self, name: str) -> int | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry.lora_id

    def names(self) -> list[str]:
        return list(self._by_name)

    def request_of(self, name: str) -> LoRARequest | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry.request

    def name_of(self, lora_id: int) -> str | None:
        entry = self._by_id.get(lora_id)  # None: forgotten meanwhile (metrics read from another thread)
        return None if entry is None else entry.request.lora_name

    def acquire(self, lora_id: int) -> None:
        self._by_id[lora_id].refs += 1

    def release(self, lora_id: int) -> None:
        entry = self._by_id.get(lora_id)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs <= 0 and entry.removed:
            self._forget(entry)

    def resident_names(self) -> list[str]:
        return [self._by_id[i].request.lora_name for i in self._slot_of]

    # ---------------------------------------------------------------- per step
    def prepare(self, seq_lora_ids: list[int | None], counts: np.ndarray) -> LoRAIndices | None:
        """The step's indices (None when no row uses an adapter); puts its adapters in slots first."""
        per_seq = self.assign_slots(seq_lora_ids)
        return None if per_seq is None else build_lora_indices(np.repeat(per_seq, counts), self.device, self.overlap)

    def assign_slots(self, seq_lora_ids: list[int | None]) -> np.ndarray | None:
        """int32 ``[S]``: each sequence's slot (-1: the base model), its adapters put in slots first;
        None when no sequence uses an adapter."""
        wanted = list(dict.fromkeys(i for i in seq_lora_ids if i is not None))
        if not wanted:
            return None
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters; max_loras={self.config.max_loras}")
        slot_of = self._slot_of
        for lora_id in wanted:
            if lora_id not in slot_of:
                slot_of[lora_id] = self._take_slot(set(wanted))
                self._load_slot(self._by_id[lora_id], slot_of[lora_id])
            slot_of.move_to_end(lora_id)
        return np.fromiter((-1 if i is None else slot_of[i] for i in seq_lora_ids), np.int32, len(seq_lora_ids))

    def _take_slot(self, keep: set[int]) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next(i for i in self._slot_of if i not in keep)  # the least recently used
        return self._slot_of.pop(victim)

    def _load_slot(self, entry: _Entry, slot: int) -> None:
        adapter = self._host(entry)
        non_blocking = self.device.type == "cuda"
        for name, weights in self.layers.items():
            pair = adapter.layers.get(name)
            if pair is None:
                weights.a[slot].zero_()
                weights.b[slot].zero_()
            else:
                weights.a[slot].copy_(pair[0], non_blocking=non_blocking)
                weights.b[slot].copy_(pair[1], non_blocking=non_blocking)

    # ---------------------------------------------------------------- host cache
    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = load_peft_adapter(
            request.lora_name,
            request.lora_path,
            self.targets,
            self.config.max_lora_rank,
            self.dtype,
            b_row_order=self._b_row_order,
        )
        # This rank's part of every layer (the whole of it without tensor parallelism).
        adapter.layers = {k: self._modules[k].shard_lora(a, b) for k, (a, b) in adapter.layers.items()}
        if self.device.type == "cuda":  # pinned: slot copies run asynchronously
            adapter.layers = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in adapter.layers.items()}
        return adapter

    def _host(self, entry: _Entry) -> LoRAAdapter:
        if entry.adapter is None:
            entry.adapter = self._read(entry.request)
        self._touch_host(entry)
        return entry.adapter

    def _touch_host(self, entry: _Entry) -> None:
        self._host_lru[entry.lora_id] = None
        self._host_lru.move_to_end(entry.lora_id)
        while len(self._host_lru) > self.config.host_capacity:
            victim = next(iter(self._host_lru))
            if victim == entry.lora_id:
                break
            self._host_lru.pop(victim)
            self._by_id[victim].adapter = None  # read again from its directory when next needed

    def _forget(self, entry: _Entry) -> None:
        if self.journal is not None:
            self.journal.append(("forget", entry.lora_id))
        self._by_id.pop(entry.lora_id, None)
        self._host_lru.pop(entry.lora_id, None)
        slot = self._slot_of.pop(entry.lora_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        entry.adapter = None


def _b_row_order(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The q/k output-row order the base model applied at load (interleaved rotary made NeoX):
    the adapters' B rows of q_proj / k_proj follow it."""
    order = getattr(model, "qk_row_permutation", None)
    if order is None:
        return None
    config = model.config
    head_dim = config.head_dim

    def rows(num_out: int) -> torch.Tensor:
        return (torch.arange(0, num_out, head_dim)[:, None] + order.cpu()[None, :]).flatten()

    return {"q_proj": rows(config.num_heads * head_dim), "k_proj": rows(config.num_kv_heads * head_dim)}
