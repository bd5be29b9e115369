"""Piecewise CUDA graphs for steps that carry prefill (on CUDA by default; ``QSERVE_PIECEWISE_GRAPHS=0`` opts out).

Knows: how to cut the decoder's forward at its paged attentions (``DecoderLayer.pre_attention`` /
``post_attention``: the same methods the plain forward runs), how to capture the pieces between
two attentions once per token-count bucket, and how to feed a step into their static buffers. Must
not know: scheduling, sampling, or the kernels' internals — it relies on the pieces being
capture-safe (no host sync, grids fixed by the row count) like the decode graphs do.

A mixed step (running decodes plus prompt chunks) has a token count and attention metadata that
change every step; the prefill attention's grid depends on the sequence count, so it cannot be
captured for a bucket. Everything else in a layer is row-wise and depends on the row count only.
Per bucket of ``N`` rows (the step's ``T`` tokens padded up to ``N``):

- piece 0: embedding, then layer 0 up to its q/k/v (input norm, qkv projection, q/k norms, rotary);
- for each layer i: the paged attention EAGERLY over the first ``T`` rows with the step's own
  metadata (the KV store included), its output copied into a static buffer, then piece i + 1:
  o_proj, the post-attention norm, the MLP, then layer i + 1's norm, qkv and rotary — or, after the
  last layer, the final norm into the static hidden output.

Logits of the sampling rows are computed eagerly from the first ``T`` rows of that output. Pad rows
``[T, N)`` carry input id 0 at position 0 and a zero attention output (zeroed once per step: no
attention ever writes them); they are never passed to the attention, so they store no K/V (as a
slot of -1 would) and read nothing, and every other op is row-wise, so they never touch a real row.

Buffers: the static inputs and the carried tensors (query, key, value, residual, attention output,
hidden output) are sized for the largest bucket and shared by every bucket; every piece of every
bucket captures into one memory pool (``share``: the decode graphs' pool), which is safe because
the pieces replay in one stream, one at a time, and each piece's outputs are copied into the static
buffers before it ends, so nothing in the pool outlives its piece. Memory: the static buffers
(``static_bytes``) plus the pool, which holds about one piece's activations at the largest bucket
(measured at capture as ``capture_bytes`` on CUDA; ``qserve.memory.planner.piecewise_graph_bytes_estimate``
is the planner's estimate).

Off CUDA, ``capture`` records nothing: each piece is a ``StaticReplay`` that reruns the same
static-buffer code eagerly, so CPU tests run everything but the capture itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from qserve.runner.attn_metadata import AttentionMetadata
from qserve.runner.cuda_graphs import StaticReplay, garbage_collected_first, smallest_bucket

logger = logging.getLogger(__name__)

PIECEWISE_GRAPHS_ENV = "QSERVE_PIECEWISE_GRAPHS"
# Comma-separated token-count buckets overriding DEFAULT_TOKEN_BUCKETS (fewer buckets: quicker capture).
PIECEWISE_BUCKETS_ENV = "QSERVE_PIECEWISE_BUCKETS"
DEFAULT_TOKEN_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_buckets(max_num_tokens: int, buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS) -> tuple[int, ...]:
    """The buckets below ``max_num_tokens`` (the step budget, ``max_num_batched_tokens``) and the
    budget itself, ascending: no step is larger, so the largest bucket holds every step."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    if any(b < 1 for b in buckets):
        raise ValueError(f"token buckets must be >= 1, got {buckets}")
    return tuple(sorted({b for b in buckets if b < max_num_tokens} | {max_num_tokens}))


def buckets_from_env(value: str | None) -> tuple[int, ...]:
    """``PIECEWISE_BUCKETS_ENV``'s value parsed ("256,512,1024"), or the defaults when unset or empty."""
    if not value:
        return DEFAULT_TOKEN_BUCKETS
    try:
        buckets = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"{PIECEWISE_BUCKETS_ENV}={value!r}: expected comma-separated token counts such as 256,512,1024"
        ) from None
    if any(b < 1 for b in buckets):
        raise ValueError(f"{PIECEWISE_BUCKETS_ENV}={value!r}: every token count must be >= 1")
    return buckets


def piecewise_enabled(device: torch.device) -> bool:
    """On CUDA unless ``QSERVE_PIECEWISE_GRAPHS=0``; elsewhere only with ``=1`` (off CUDA the pieces
    replay nothing and rerun eagerly: a test's choice, never a gain). Any other value is refused: a
    "true" would otherwise mean on for one device and off for the other."""
    value = os.environ.get(PIECEWISE_GRAPHS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{PIECEWISE_GRAPHS_ENV}={value!r}: expected 0 (off), 1 (on, also off CUDA) or unset")
    return value == "1" or (value != "0" and device.type == "cuda")


class PiecewiseGraphs:
    """Captured pieces (``num_layers + 1`` per bucket) of the forward for steps of up to
    ``max_num_tokens`` tokens, padded up to the next of ``buckets``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_tokens: int,
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS,
        share: object | None = None,  # graphs (DecodeGraphs) whose memory pool the pieces use
    ) -> None:
        if getattr(model, "tp", None) is not None:
            raise ValueError("piecewise CUDA graphs do not support tensor parallelism yet")
        self.model = model
        self.kv_caches = kv_caches
        self.layers = list(model.model.layers)
        self.buckets = token_buckets(max_num_tokens, buckets)
        rows = self.buckets[-1]
        config = model.config
        dtype = model.dtype
        if self.layers:
            attention = self.layers[0].self_attn
            num_heads, num_kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        else:
            num_heads, num_kv_heads, head_dim = 1, 1, 1
        hidden = config.hidden_size
        int64 = {"dtype": torch.int64, "device": device}
        act = {"dtype": dtype, "device": device}
        # Static inputs (a bucket of N rows reads the first N).
        self.input_ids = torch.zeros(rows, **int64)  # [rows]
        self.positions = torch.zeros(rows, **int64)  # [rows]
        has_ntk = getattr(getattr(model, "rotary", None), "num_ntk_tables", 1) > 1
        self.ntk_tables = torch.zeros(rows, **int64) if has_ntk else None  # [rows] Qwen v1 dynamic NTK
        # Carried across each eager attention.
        self.query = torch.zeros(rows, num_heads, head_dim, **act)  # [rows, H, D]
        self.key = torch.zeros(rows, num_kv_heads, head_dim, **act)  # [rows, Hkv, D]
        self.value = torch.zeros(rows, num_kv_heads, head_dim, **act)  # [rows, Hkv, D]
        self.residual = torch.zeros(rows, hidden, **act)  # [rows, hidden]
        self.attn_out = torch.zeros(rows, num_heads, head_dim, **act)  # [rows, H, D]
        self.hidden_out = torch.zeros(rows, hidden, **act)  # [rows, hidden]: the final norm's output
        self.static_bytes = sum(
            t.numel() * t.element_size()
            for t in (self.input_ids, self.positions, self.ntk_tables, self.query, self.key, self.value)
            + (self.residual, self.attn_out, self.hidden_out)
            if t is not None
        )
        self.graphs: dict[int, list[torch.cuda.CUDAGraph | StaticReplay]] = {}
        self.pool = getattr(share, "pool", None)
        self.capture_bytes = 0  # the pool's growth at capture (CUDA), measured

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket holding ``num_tokens``, or None when it exceeds the largest."""
        return None if num_tokens < 1 else smallest_bucket(self.buckets, num_tokens)

    def _piece(self, rows: int, index: int) -> None:
        """Piece ``index`` of a bucket of ``rows`` rows, from static buffers into static buffers."""
        model = self.model
        if index == 0:
            hidden, residual = model.model.embed_tokens(self.input_ids[:rows]), None  # [rows, hidden]
        else:
            hidden, residual = self.layers[index - 1].post_attention(self.attn_out[:rows], self.residual[:rows])
        if index == len(self.layers):  # the final norm
            out = model.model.norm(hidden) if residual is None else model.model.norm.add_and_norm(hidden, residual)[0]
            self.hidden_out[:rows].copy_(out)
            return
        ntk = None if self.ntk_tables is None else self.ntk_tables[:rows]
        (query, key, value), residual = self.layers[index].pre_attention(
            self.positions[:rows], hidden, residual, model.rotary, ntk
        )
        self.query[:rows].copy_(query)
        self.key[:rows].copy_(key)
        self.value[:rows].copy_(value)
        self.residual[:rows].copy_(residual)

    def _piece_fn(self, rows: int, index: int) -> Callable[[], None]:
        return lambda: self._piece(rows, index)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every piece of every bucket, largest bucket first, into one pool (off
        CUDA: ``StaticReplay`` stand-ins, see the module doc)."""
        if self.input_ids.device.type != "cuda":
            for rows in self.buckets:
                self.graphs[rows] = [StaticReplay(self._piece_fn(rows, i)) for i in range(self.num_pieces)]
            logger.info("piecewise graphs replayed eagerly off CUDA (token buckets %s)", list(self.buckets))
            return
        device = self.input_ids.device
        torch.cuda.synchronize(device)
        reserved = torch.cuda.memory_reserved(device)
        with garbage_collected_first():
            for rows in reversed(self.buckets):
                pieces: list[torch.cuda.CUDAGraph | StaticReplay] = []
                for index in range(self.num_pieces):
                    fn = self._piece_fn(rows, index)
                    fn()  # warm-up outside capture (compilation, autotuning)
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        fn()
                    if self.pool is None:
                        self.pool = graph.pool()
                    pieces.append(graph)
                self.graphs[rows] = pieces
        torch.cuda.synchronize(device)
        self.capture_bytes = torch.cuda.memory_reserved(device) - reserved
        logger.info(
            "captured %d piecewise CUDA graphs (%d pieces x token buckets %s); static buffers %.1f MiB, "
            "pool growth %.1f MiB",
            sum(len(p) for p in self.graphs.values()),
            self.num_pieces,
            list(self.buckets),
            self.static_bytes / 2**20,
            self.capture_bytes / 2**20,
        )

    @torch.inference_mode()
    def run(
        self,
        input_ids: list[int],  # [T]
        positions: np.ndarray,  # int64 [T]
        metadata: AttentionMetadata,  # the step's own (unpadded: T tokens, S sequences)
        ntk_tables: np.ndarray | None = None,  # int64 [T] rotary table per token (None: table 0)
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,  # (token indices [P], ids [P]) on the device
    ) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` (a view of the static output: read it before the
        next replay) of a step of ``T <= buckets[-1]`` tokens."""
        num_tokens = len(input_ids)
        rows = self.bucket_for(num_tokens)
        if rows is None:
            raise ValueError(f"a step of {num_tokens} tokens exceeds the largest piecewise bucket {self.buckets[-1]}")
        host = np.zeros((3, rows), dtype=np.int64)  # ids, positions, ntk tables; pad rows: 0
        host[0, :num_tokens] = input_ids
        host[1, :num_tokens] = positions
        if ntk_tables is not None:
            host[2, :num_tokens] = ntk_tables
        staged = torch.from_numpy(host)
        if self.input_ids.is_cuda:  # asynchronous: the previous step may still be running
            staged = staged.pin_memory()
        self.input_ids[:rows].copy_(staged[0], non_blocking=True)
        self.positions[:rows].copy_(staged[1], non_blocking=True)
        if self.ntk_tables is not None:
            self.ntk_tables[:rows].copy_(staged[2], non_blocking=True)
        if pending is not None:  # tokens sampled by the step in flight, straight from the device
            self.input_ids.index_copy_(0, *pending)
        self.attn_out[num_tokens:rows].zero_()  # pad rows: no attention writes them (module doc)
        pieces = self.graphs[rows]
        pieces[0].replay()
        for index, (layer, kv_cache) in enumerate(zip(self.layers, self.kv_caches)):
            out = layer.self_attn.attn(
                self.query[:num_tokens], self.key[:num_tokens], self.value[:num_tokens], kv_cache, metadata
            )  # [T, H, D]
            self.attn_out[:num_tokens].copy_(out)
            pieces[index + 1].replay()
        return self.hidden_out[:num_tokens]
