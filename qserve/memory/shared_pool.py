"""One KV page pool for several models: one ``BlockPool`` and one byte buffer of pages.

Knows: how big a page must be so it can hold one KV block (all layers, K and V) of ANY of the
hosted models, how many pages a byte budget buys, and how to carve each model's per-layer
``[num_pages, block_size, num_kv_heads, head_dim]`` key / value caches out of the buffer as
strided views (page ``p`` of model ``m``, layer ``l``, K is bytes ``[offset, offset + n)`` of
row ``p``). Block id ``b`` in the shared ``BlockPool`` is page ``b`` of the buffer, whichever
model owns it; owners are model names and their min / max shares are set here.

Must not know: the scheduler's policy, requests, engines, HTTP. Pure tensor plumbing plus a
little arithmetic.

Buffer layout (uint8)::

    buffer[num_pages, page_bytes]
    row p = [ model's layer 0 K | layer 0 V | layer 1 K | ... | padding up to page_bytes ]

A page holds one block of one model at a time; a model with smaller blocks leaves the tail of
the page unused (the price of letting pages move freely between models).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from qserve.config import ModelConfig
from qserve.scheduler.block_pool import BlockPool
from quant_kernels.reference_kv_int4 import cache_head_size

PAGE_ALIGN_BYTES = 256  # rows start on this boundary so every dtype view stays aligned


@dataclass(frozen=True, slots=True)
class ModelKVSpec:
    """What the pool needs to know about one hosted model's KV cache."""

    name: str
    config: ModelConfig
    dtype: torch.dtype  # KV element dtype
    block_size: int
    max_model_len: int
    max_num_seqs: int

    @property
    def block_layer_elems(self) -> int:
        """Elements of one layer's K (or V) for one block (int4: packed bytes, scales included)."""
        return self.block_size * self.config.num_kv_heads * cache_head_size(self.config.head_dim, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this model: K and V of every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.config.num_layers * self.block_layer_elems * elem

    @property
    def useful_pages(self) -> int:
        """Pages beyond which this model alone could never use more (max_num_seqs full sequences)."""
        return math.ceil(self.max_model_len / self.block_size) * self.max_num_seqs


def page_bytes_for(specs: Sequence[ModelKVSpec]) -> int:
    """Bytes of one page: the largest block of any model, rounded up to the alignment."""
    if not specs:
        raise ValueError("a shared KV pool needs at least one model")
    largest = max(spec.block_bytes for spec in specs)
    return -(-largest // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES


def num_pages_for(specs: Sequence[ModelKVSpec], kv_bytes: int) -> int:
    """Pages that ``kv_bytes`` buys, never more than all models together could use, and
    refusing a budget in which some model could not hold one sequence of its max_model_len."""
    page_bytes = page_bytes_for(specs)
    num_pages = min(kv_bytes // page_bytes, sum(spec.useful_pages for spec in specs))
    for spec in specs:
        needed = math.ceil(spec.max_model_len / spec.block_size)
        if num_pages < needed:
            raise ValueError(
                f"the KV budget of {kv_bytes} bytes buys {num_pages} pages of {page_bytes} bytes; model "
                f"{spec.name!r} needs {needed} pages for one sequence of max_model_len={spec.max_model_len}. "
                "Raise --gpu-memory-budget / --num-kv-blocks or lower --max-model-len"
            )
    return int(num_pages)


def share_blocks(num_pages: int, name: str, min_share: float | None, max_share: float | None) -> tuple[int, int | None]:
    """Fractions of the pool -> (min_blocks, max_blocks) for ``BlockPool.set_share``."""
    for label, value in (("min", min_share), ("max", max_share)):
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"--{label}-share {name}={value}: a share is a fraction of the pool in [0, 1]")
    min_blocks = int(math.floor((min_share or 0.0) * num_pages))
    max_blocks = None if max_share is None else int(math.floor(max_share * num_pages))
    if max_blocks is not None and max_blocks < min_blocks:
        raise ValueError(f"model {name!r}: --max-share ({max_share}) is below --min-share ({min_share})")
    return min_blocks, max_blocks


class SharedKVPool:
    """The pages (one buffer) and their bookkeeping (one ``BlockPool``) all models share."""

    def __init__(
        self,
        specs: Sequence[ModelKVSpec],
        num_pages: int,
        device: torch.device | str,
        min_shares: Mapping[str, float] | None = None,
        max_shares: Mapping[str, float] | None = None,
    ) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        for label, shares in (("min", min_shares or {}), ("max", max_shares or {})):
            unknown = set(shares) - set(names)
            if unknown:
                raise ValueError(f"--{label}-share names unknown model(s) {sorted(unknown)}; models: {names}")
        self.specs = {spec.name: spec for spec in specs}
        self.num_pages = num_pages
        self.page_bytes = page_bytes_for(specs)
        self.block_pool = BlockPool(num_pages)
        for name in names:
            min_share = (min_shares or {}).get(name)
            max_share = (max_shares or {}).get(name)
            if min_share is not None or max_share is not None:
                min_blocks, max_blocks = share_blocks(num_pages, name, min_share, max_share)
                self.block_pool.set_share(name, min_blocks=min_blocks, max_blocks=max_blocks)
        self.buffer = torch.zeros(num_pages, self.page_bytes, dtype=torch.uint8, device=device)  # [pages, page_bytes]

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def kv_caches(self, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Model ``name``'s per-layer (key, value) caches: strided views into the shared buffer."""
        spec = self.specs[name]
        elem = torch.empty((), dtype=spec.dtype).element_size()
        layer_bytes = spec.block_layer_elems * elem
        head_size = cache_head_size(spec.config.head_dim, spec.dtype)
        shape = (self.num_pages, spec.block_size, spec.config.num_kv_heads, head_size)
        caches = []
        for layer in range(spec.config.num_layers):
            key_offset = 2 * layer * layer_bytes
            value_offset = key_offset + layer_bytes
            key = self.buffer[:, key_offset : key_offset + layer_bytes].view(spec.dtype).view(shape)
            value = self.buffer[:, value_offset : value_offset + layer_bytes].view(spec.dtype).view(shape)
            caches.append((key, value))
        return caches
