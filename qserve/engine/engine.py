"""The synchronous engine: requests in, one ``step()`` at a time, ``RequestOutput``s out.

Knows: how the scheduler, model runner, detokenizer and stop checks fit into one step, and how
``n > 1`` requests fan out into sequences and back; for structured outputs, when to fill the
grammar bitmasks of a step's sampling sequences and advance their matchers (the grammar
library itself stays in ``qserve.structured.grammar``). Must not know: HTTP, asyncio, or how
kernels compute. The server drives ``add_request`` / ``abort_request`` / ``step``.

Async scheduling (``EngineConfig.async_scheduling``, vLLM's ``--async-scheduling``; on by
default): ``step()`` schedules step N+1 and launches it while step N still runs on the device
(the scheduler assumes every sampling sequence of step N gets its token; the runner takes those
tokens from the device), then waits for step N's sampled ids and does its host work (scheduler
update, detokenization, stop checks, outputs) while the device runs step N+1. So each
``step()`` returns the outputs of the step launched by the previous call. A sequence that
finished at step N had one more token computed at step N+1: it is dropped (never emitted or
counted; its pages were freed when it finished, and later steps run after N+1 on the stream).
Steps fall back to the synchronous order (step N's outputs processed before step N+1 is
scheduled) while any unfinished request has structured outputs (a grammar's next mask needs the
previous token accepted). Penalties stay asynchronous: the runner counts the in-flight token from
the device (Qwen's ``generation_config.json`` puts ``repetition_penalty`` on every request).
Tensor-parallel engines run synchronously (rank 0's broadcasting runner has no ``launch``).

Embedding requests (``add_request`` with ``PoolingParams``, vLLM's name) go through the same
scheduler and page pool as generation: each runs as a greedy one-token request whose prefill's
last position the runner returns as a final hidden state (after the model's last norm); the
engine pools it (``PoolingParams.pool``: last token, L2-normalized) and the one sampled token
finishes the request, so its pages are freed as any other's.

Speculative decoding (``EngineConfig.speculative_config``, vLLM's; off by default): before each
schedule the proposer (``qserve.spec_decode``) gives running requests in plain decode their draft
tokens; the scheduler and runner verify them in the step; the tokens a step emits for a sequence
go one by one through the stop checks here (those after a stop are dropped). A step with drafts is
processed before the next is scheduled (the next drafts follow its tokens), so speculation runs
in the synchronous order while it proposes; above ``disable_by_batch_size`` enqueued requests
(running and waiting) it proposes nothing and the asynchronous order comes back, as it does for the
steps where the back-off (``qserve.spec_decode.backoff``) holds every running sequence. Grammars get
no drafts (docs/spec_decode.md).
With an EAGLE head the engine asks the runner for the target's hidden states of the steps that carry
them (``SchedulerOutput.spec_hidden_states``: while speculating, unless the back-off holds every
sequence for the next round, and every step that is not a plain decode) and hands each sequence's
kept positions to the proposer after the step. With
``enable_adaptive_verification`` the number of drafts per step comes from
``qserve.spec_decode.adaptive`` (measured acceptance, batch size, a cost model); 0 is a plain step.
Verify steps (and a draft model's steps) run under CUDA graphs unless ``QSERVE_SPEC_GRAPHS=0`` (they
made n-gram speculation 2.1-3.0x at batch 1 on the H200 where eager verify lost, bench/RESULTS.md):
the target captures graphs of k + 1 rows per sequence for its verify steps and a draft model decode
and 2-row catch-up graphs, all in the target's graph pool
(``_capture_spec_graphs``); with an EAGLE head the verify graphs also write the hidden states the head
reads, so its verify steps replay them too. Steps that propose nothing run exactly as without
speculation.

Swap preemption (``EngineConfig.preemption_mode`` "swap" | "auto", ``swap_space`` GiB of host
memory; vLLM V0's names): the engine gives the runner a host KV pool and the scheduler its slots
(and, for auto, a cost estimate whose copy bandwidth is measured at start-up and whose
per-token prefill cost is measured on the synchronous steps). Swapped requests resume without
recomputing, so their prompt logprobs are not sent again. It works in both step orders: the
copies are stream-ordered with the steps (docs/async_scheduling.md). Not with tensor parallelism.

LoRA (``EngineConfig.enable_lora``, vLLM's names; off by default, and then nothing here changes): the
engine holds a ``LoRAManager`` (qserve.lora.slots) whose slots the runner fills per step; a request
names its adapter with a ``LoRARequest`` (read from its directory the first time, or registered
before with ``add_lora``); each of its sequences holds a reference to the adapter until it finishes,
so ``remove_lora`` never pulls an adapter from under a running request. The scheduler keeps the
distinct adapters of the running requests within ``max_loras``. With LoRA on, decode replays CUDA
graphs that take each row's adapter slot as an input (10x eager at batch 32 on the H200;
``QSERVE_LORA_GRAPHS=0``: eagerly), and the adapters' slots are set aside in the memory plan. Under tensor parallelism every rank's manager holds
its shard of each adapter, and rank 0's registry changes reach the others with the next step
(qserve.distributed.worker).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import loaders
from qserve.config import CacheConfig, ModelConfig, SchedulerConfig, parse_dtype
from qserve.distributed.parallel_state import TPGroup
from qserve.distributed.sharding import per_rank_config
from qserve.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly, TokenStrings
from qserve.engine.stop_checker import StopResult, check_stop
from qserve.layers.held_bytes import held_weight_bytes
from qserve.lora.request import LoRAConfig, LoRARequest
from qserve.memory.planner import (
    GPU_DEFAULT_FRACTION,
    MemoryPlan,
    make_plan,
    parse_memory_budget,
    plan_num_kv_blocks,
    weight_bytes,
)
from qserve.memory.profiler import kv_cache_torch_dtype, profile_model, set_kv_scales
from qserve.model.loader import load_model
from qserve.model.registry import read_model_config
from qserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.request import Request, RequestStatus
from qserve.runner.cuda_allocator import allocator_setting, prefer_expandable_segments
from qserve.runner.cuda_graphs import DecodeGraphs
from qserve.runner.kv_swap import kv_block_bytes
from qserve.runner.model_runner import LaunchedStep, ModelRunner, allocate_kv_caches, kv_cache_shape
from qserve.runner.piecewise_graphs import (
    PIECEWISE_BUCKETS_ENV,
    buckets_from_env,
    piecewise_enabled,
)
from qserve.sampling_params import SamplingParams
from qserve.scheduler.block_pool import BlockPool
from qserve.scheduler.kv_cache_manager import KVCacheManager
from qserve.scheduler.output import RunnerOutput, SchedulerOutput, TokenLogprobs
from qserve.scheduler.scheduler import Scheduler
from qserve.scheduler.swap import HostSwapSpace, SwapCost, check_preemption_mode, check_tensor_parallel_preemption
from qserve.spec_decode import ProposalInput, Proposer, SpeculativeConfig, parse_speculative_config
from qserve.spec_decode.adaptive import AdaptiveSpeculation
from qserve.spec_decode.backoff import EAGLE_GROWTH, EAGLE_MAX_WAIT_STEPS, GROWTH, MAX_WAIT_STEPS, parse_backoff
from qserve.spec_decode.config import check_tensor_parallel_speculation
from qserve.spec_decode.metrics import SpecDecodeStats
from qserve.spec_decode.ngram import NgramProposer
from qserve.structured.grammar import GrammarCompiler, GrammarMatchers
from qserve.tokenization import load_tokenizer, num_token_ids, stop_token_ids
from quant_kernels.pdl import prefer_for_moe as prefer_pdl_for_moe
from quant_kernels.switches import env_switch

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]
# Admission keeps 1% of the pages (vLLM's watermark) plus one page per running sequence free, so
# running sequences can grow before one is preempted: bench/serving.py --small --num-kv-blocks 100
# --num-requests 40 on CPU, preemptions (recomputes) 24 -> 2 all at once, 9 -> 1 at 8 req/s.
ADMISSION_WATERMARK = 0.01
ADMISSION_WATERMARK_PAGES_PER_RUNNING = 1
GIB = 2**30
# An embedding (pooling) request runs as a one-token greedy request: its prefill's last position
# gives the hidden state, the one sampled token is discarded and finishes it (pages freed).
POOLING_STEP_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
# auto preemption: steps with at least this many tokens measure the per-token prefill cost
# (smaller ones are dominated by the step's fixed cost); each measurement moves the estimate by
# this share of the difference.
RECOMPUTE_COST_MIN_TOKENS = 64
# LoRA: decode CUDA graphs that take each row's adapter slot (the default; "0": LoRA decodes eagerly).
LORA_GRAPHS_ENV = "QSERVE_LORA_GRAPHS"
# Speculative decoding: CUDA graphs for verify steps and the draft model's steps (opt-in; without it
# they run eagerly).
SPEC_GRAPHS_ENV = "QSERVE_SPEC_GRAPHS"
# EAGLE heads: decode CUDA graphs that also write the head's hidden states, so the plain decode steps
# of a speculating engine (a sequence that got no drafts) replay them instead of running eagerly.
# The default since `pytest -m gpu` passed with it (bench/RESULTS.md, tenth session); "0" opts out.
EAGLE_DECODE_GRAPHS_ENV = "QSERVE_EAGLE_DECODE_GRAPHS"
# Speculative decoding: verify steps that fit no row graph (a verify beside a new prompt's chunk), and
# an EAGLE (not EAGLE-3) head's steps that ask for hidden states and fit no other graph, run through
# the piecewise graphs instead of eagerly. The default since `pytest -m gpu` passed with it; "0" opts out.
PIECEWISE_SPEC_ENV = "QSERVE_PIECEWISE_SPEC"
# EAGLE heads: the k - 1 drafting forwards of a proposal replay CUDA graphs of the head (one per batch
# bucket, qserve.spec_decode.eagle_graphs) instead of launching every kernel from Python. The default
# since `pytest -m gpu` passed with it (bench/RESULTS.md, tenth session); "0" opts out.
EAGLE_HEAD_GRAPHS_ENV = "QSERVE_EAGLE_HEAD_GRAPHS"
# EAGLE heads: the catch-up forward after each target step (1 to k + 1 positions per sequence) replays
# CUDA graphs of k + 1 rows per sequence (qserve.spec_decode.eagle_graphs.HeadCatchUpGraphs). The
# default since `pytest -m gpu` passed with it (bench/RESULTS.md, eleventh session); "0" opts out.
EAGLE_CATCH_UP_GRAPHS_ENV = "QSERVE_EAGLE_CATCH_UP_GRAPHS"
# EAGLE heads: a proposal's drafts stay on the device (no host sync between drafting and the verify
# step, which reads them there: the host schedules and launches the verify step while the head still
# drafts; one sync a cycle instead of two). The default since `pytest -m gpu` passed with it
# (bench/RESULTS.md, twelfth session); "0" keeps them on the host.
EAGLE_DEVICE_DRAFTS_ENV = "QSERVE_EAGLE_DEVICE_DRAFTS"
# The back-off of failing proposals, "GROWTH,MAX_WAIT" for every method (defaults in
# qserve.spec_decode.backoff: 4,64 for EAGLE heads, 2,16 for n-gram and draft models, as measured)
SPEC_BACKOFF_ENV = "QSERVE_SPEC_BACKOFF"
# (The head's graph switches act only where the speculative graphs are captured: CUDA, decode graphs,
# and QSERVE_SPEC_GRAPHS not 0.)
# A draft model's catch-up step after a verify that kept all k drafts feeds 2 tokens per sequence
# (the last draft and the target's token): its graphs take up to this many rows per sequence.
DRAFT_CATCH_UP_ROWS = 2
RECOMPUTE_COST_EMA = 0.2


def spec_graph_sizes(spec: SpeculativeConfig, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int, int]:
    """The most sequences of the graphs of speculative steps: (target verify graphs, a draft model's
    decode graphs, its catch-up graphs). Speculating steps have at most ``disable_by_batch_size``
    (and ``max_num_seqs``) sequences, and a graph's rows (sequences x rows per sequence) stay within
    ``max_num_batched_tokens``, the step size the memory plan's activation peak was measured for
    (a size of 0: no such graphs)."""
    seqs = max_num_seqs if spec.disable_by_batch_size is None else min(max_num_seqs, spec.disable_by_batch_size)
    verify = min(seqs, max_num_batched_tokens // (spec.num_speculative_tokens + 1))
    return verify, min(seqs, max_num_batched_tokens), min(seqs, max_num_batched_tokens // DRAFT_CATCH_UP_ROWS)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    device: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    tokenizer: str | None = None
    gpu_memory_budget: str | None = None  # bytes ("24GiB") or a fraction of the device ("0.9")
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "fp8" | "int8"
    enforce_eager: bool = False  # no CUDA graphs
    skip_tokenizer_init: bool = False  # token-id prompts in, token ids out, no text (vLLM's name)
    # Schedule and launch step N+1 while step N runs; process N's outputs meanwhile (vLLM's name).
    # On by default since its CUDA equivalence test passed on the H200 (docs/async_scheduling.md).
    async_scheduling: bool = True
    # Preemption (vLLM V0's names): "recompute" drops a preempted sequence's KV; "swap" copies it to
    # a host pool of swap_space GiB (pinned on CUDA) and back; "auto" swaps where that is cheaper.
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB of host memory for swapped KV (allocated only when not "recompute")
    # LoRA adapters (vLLM's names): slots on the device, the largest rank, adapters kept in host memory.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (vLLM's speculative_config: a dict, JSON string or SpeculativeConfig;
    # stored parsed). None: off, and every step runs exactly as without it (docs/spec_decode.md).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Mixture-of-experts models under tensor parallelism (vLLM's name): each rank holds whole routed
    # experts (a contiguous block) instead of a slice of every expert. No effect at one rank.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        check_preemption_mode(self.preemption_mode)
        if self.enable_lora:
            self.lora_config  # noqa: B018 - checks the limits now
            if self.speculative_config is not None:  # not combined (or tested together) yet
                raise ValueError("enable_lora: LoRA adapters are not supported with speculative_config yet")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")

    @property
    def lora_config(self) -> LoRAConfig:
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one generated sequence (one scheduler request)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | TokenIdsOnly
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Prompt-logprob entries received since the last (re)start; a preempted sequence recomputes
    # from position 0 and sends them again.
    prompt_logprobs_received: int = 0


@dataclass(eq=False)
class _Group:
    """A user request: its prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Timing for metrics (time.monotonic()): queue time is first_scheduled_time - arrival_time.
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    pooling: PoolingParams | None = None  # an embedding request (params is then POOLING_STEP_PARAMS)
    embedding: list[float] | None = None  # its pooled vector, once its prefill is done
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)


def resolve_device(device: str | None) -> torch.device:
    """The device an engine runs on (CUDA where there is one, unless named). Resolving a CUDA device
    is the last moment before qserve starts CUDA in the process, so this is where it asks for
    expandable allocator segments (``qserve.runner.cuda_allocator``; a user's
    ``PYTORCH_CUDA_ALLOC_CONF`` wins)."""
    resolved = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if resolved.type == "cuda":
        prefer_expandable_segments()
    return resolved


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow; the CPU path is the reference
    return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.float16


def _check_kv_caches(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    """Refuse externally made KV caches that do not match this model and pool."""
    shape = kv_cache_shape(config, num_blocks, block_size, dtype)
    if kv_caches is None or len(kv_caches) != config.num_layers:
        raise ValueError(f"kv_caches must hold one (key, value) pair per layer ({config.num_layers})")
    for layer, pair in enumerate(kv_caches):
        for cache in pair:
            if tuple(cache.shape) != shape or cache.dtype != dtype:
                raise ValueError(
                    f"kv_caches[{layer}] is {tuple(cache.shape)} {cache.dtype}; this model needs {shape} {dtype}"
                )


def _prefix_caching(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> bool:
    """Qwen v1's dynamic NTK rotates a prompt's keys with a base chosen from the WHOLE prompt's
    length, so equal prefixes of prompts longer than seq_length hold different keys: block hashes
    (token ids only) cannot tell them apart. Such models serve without prefix caching."""
    seq_length = model_config.seq_length
    if config.enable_prefix_caching and model_config.dynamic_ntk and seq_length and max_model_len > seq_length:
        logger.warning(
            "%s: prefix caching disabled: dynamic NTK (use_dynamic_ntk) changes cached keys past seq_length=%d "
            "(max_model_len=%d); pass --max-model-len %d to keep it",
            config.model,
            seq_length,
            max_model_len,
            seq_length,
        )
        return False
    return config.enable_prefix_caching


class Engine:
    """One model's engine.

    By default it builds its own block pool and KV caches. A multi-model host passes instead
    a ``block_pool`` shared by several engines, the ``owner`` name this model draws from it
    under, and ``kv_caches`` (per layer (key, value), each ``[pool.num_blocks, block_size,
    num_kv_heads, head_dim]``, possibly strided views into a shared buffer).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        block_pool: BlockPool | None = None,
        owner: str | None = None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        if (block_pool is None) != (kv_caches is None):
            raise ValueError("Engine: block_pool and kv_caches must be given together (a shared pool) or not at all")
        if tp is not None and block_pool is not None:
            raise ValueError("Engine: a tensor-parallel engine cannot draw from a shared block pool")
        check_tensor_parallel_preemption(config.preemption_mode, 1 if tp is None else tp.size)
        check_tensor_parallel_speculation(config.speculative_config, 1 if tp is None else tp.size)
        # sequences whose proposals keep failing skip steps (QSERVE_SPEC_BACKOFF: its growth and cap; read
        # only when speculating, and before the model loads: a bad value fails at once)
        spec = config.speculative_config
        backoff = os.environ.get(SPEC_BACKOFF_ENV) if spec is not None else None
        eagle = spec is not None and spec.is_eagle  # a failed probe costs a head about a step: it backs off harder
        self._draft_backoff = parse_backoff(
            backoff, (EAGLE_GROWTH, EAGLE_MAX_WAIT_STEPS) if eagle else (GROWTH, MAX_WAIT_STEPS)
        )
        # Tensor parallel (qserve.engine.tensor_parallel builds one Engine per rank): the model is
        # this rank's shard, KV caches and the memory plan are per rank.
        self.tp = tp

        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            # read by torch when CUDA started in this process (resolve_device asks first where it can)
            logger.info("%s: CUDA allocator setting: %s", owner or config.model, allocator_setting())
        model_config = read_model_config(config.model)
        if prefer_pdl_for_moe(model_config.num_experts > 0, self.device):  # measured faster there only
            logger.info(
                "%s: a mixture-of-experts model on sm90: QSERVE_ENABLE_PDL=1 (set it to 0 to opt out)",
                owner or config.model,
            )
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        self.model, self.model_config = load_model(
            config.model, self.dtype, self.device, tp=tp, enable_expert_parallel=config.enable_expert_parallel
        )
        spec = config.speculative_config
        # A draft model loads before the memory plan, so the pages it leaves are what is left.
        self._draft = (
            None if spec is None or spec.method != "draft_model" else load_model(spec.model, self.dtype, self.device)
        )
        self._eagle_head = None if spec is None or not spec.is_eagle else self._load_eagle_head(model_config)
        rank_config = per_rank_config(  # this rank's heads (and expert widths)
            self.model_config, 1 if tp is None else tp.size, config.enable_expert_parallel
        )
        self.lora_manager = None
        if config.enable_lora:  # under tensor parallelism each rank's slots hold its shard (Linear.shard_lora)
            from qserve.lora.slots import LoRAManager

            self.lora_manager = LoRAManager(self.model, config.lora_config, self.dtype, self.device)
        # Checked before the weights load: a missing tokenizer is a quick, clear error.
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        # id -> token strings, shared by all sequences
        self._token_strings = None if self.tokenizer is None else TokenStrings(self.tokenizer)

        max_model_len = config.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model_config.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        cache = CacheConfig(
            config.block_size, config.num_kv_blocks, _prefix_caching(config, model_config, max_model_len)
        )
        self.scheduler_config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens or max(2048, config.block_size),
        )
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        if kv_dtype != self.dtype or (block_pool is None and cache.num_kv_blocks is None and self._plans_memory):
            profile = profile_model(
                self.model,
                rank_config,
                num_tokens=self.scheduler_config.max_num_batched_tokens if self._plans_memory else 64,
                max_model_len=max_model_len,
                num_sample_rows=config.max_num_seqs,
                block_size=cache.block_size,
                dtype=self.dtype,
                device=self.device,
            )
            if kv_dtype != self.dtype:
                set_kv_scales(self.model, profile, kv_dtype)
        self.memory_plan = None
        if block_pool is None:
            if cache.num_kv_blocks is not None:
                num_blocks = cache.num_kv_blocks
            elif self._plans_memory:
                self.memory_plan = self._plan_memory(profile.activation_bytes, max_model_len)
                num_blocks = self.memory_plan.num_kv_blocks
                logger.info("memory plan for %s:\n%s", config.model, self.memory_plan.describe())
            else:
                num_blocks = plan_num_kv_blocks(
                    rank_config,
                    kv_dtype,
                    cache.block_size,
                    max_model_len,
                    config.max_num_seqs,
                    self.device,
                    shadow_kv_bytes_per_token=self._shadow_kv_plan()[0],
                )
            if tp is not None:
                num_blocks = tp.min_int(num_blocks)  # every rank must hold the same pages
            block_pool = BlockPool(num_blocks)
        else:
            num_blocks = block_pool.num_blocks
            _check_kv_caches(kv_caches, self.model_config, num_blocks, cache.block_size, kv_dtype)
        self.block_pool = block_pool
        self.owner = owner or str(config.model)
        self.kv_manager = KVCacheManager(
            self.block_pool, cache.block_size, cache.enable_prefix_caching, owner=self.owner
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_num_batched_tokens,
            max_model_len,
            watermark=ADMISSION_WATERMARK,
            watermark_per_running=ADMISSION_WATERMARK_PAGES_PER_RUNNING,
            async_scheduling=config.async_scheduling and tp is None,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        if kv_caches is None:
            kv_caches = allocate_kv_caches(rank_config, num_blocks, cache.block_size, kv_dtype, self.device)
        self.runner = ModelRunner(self.model, self.model_config, kv_caches, cache.block_size, self.device, config.seed)
        self.runner.lora_manager = self.lora_manager
        if self._eagle_head is not None:  # steps that ask return the hidden states the head reads
            self.runner.enable_spec_hidden_states(self._eagle_head.config.taps)
        if self.tokenizer is not None:  # model rows past the tokenizer's ids (Qwen's padding) are never sampled
            self.runner.set_valid_vocab_size(num_token_ids(self.tokenizer))
        self.swap_cost: SwapCost | None = None
        if config.preemption_mode != "recompute":
            self._enable_swap(config.preemption_mode, config.swap_space, kv_caches)
        graphs_ok = getattr(self.model, "supports_cuda_graphs", True)  # False: MoE experts that sync with the host
        if self.device.type == "cuda" and not config.enforce_eager and not graphs_ok:
            logger.info(
                "%s: mixture-of-experts layers run eagerly (the per-expert loop: QSERVE_FUSED_MOE=0 or act-order experts)",
                self.owner,
            )
        if self.device.type == "cuda" and not config.enforce_eager and graphs_ok and config.enable_lora:
            if os.environ.get(LORA_GRAPHS_ENV, "1") != "0":
                self.runner.capture_decode_graphs(config.max_num_seqs, max_model_len, max_loras=config.max_loras)
            else:
                logger.info("enable_lora: decode runs eagerly (%s=0)", LORA_GRAPHS_ENV)
        elif self.device.type == "cuda" and not config.enforce_eager and graphs_ok:
            self.runner.capture_decode_graphs(
                config.max_num_seqs, max_model_len, hidden_taps=self.decode_graph_hidden_taps()
            )
        if self._captures_piecewise_graphs():
            self._capture_piecewise_graphs()
        elif piecewise_enabled(self.device) and not config.enforce_eager:
            why = "tensor parallelism" if tp is not None else "mixture-of-experts layers sync with the host"
            logger.info("%s: no piecewise graphs (%s): steps carrying prefill run eagerly", self.owner, why)
        if self.device.type == "cuda":  # compile / tune what the first requests would otherwise wait for
            from qserve.runner.warmup import warm_up

            warm_up(
                self.runner,
                max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len,
                block_size=cache.block_size,
                num_blocks=num_blocks,
                vocab_size=self.model_config.vocab_size,
            )
        if self.memory_plan is not None and self.device.type == "cuda":
            plan = self.memory_plan
            planned = plan.weights_bytes + plan.kv_cache_bytes + plan.overhead_bytes
            allocated = torch.cuda.memory_allocated(self.device)
            logger.info(
                "allocated after start-up %.2f GiB; planned weights + KV + overheads %.2f GiB (%+.1f%%)",
                allocated / 2**30,
                planned / 2**30,
                100 * (allocated - planned) / planned,
            )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        if self.tokenizer is not None:
            self.eos_token_ids.update(stop_token_ids(self.tokenizer))  # family chat stops (Qwen v1, ChatGLM3)
        # Structured outputs: grammars compiled per constraint (cached; the server warms it from
        # another thread), one matcher per constrained sequence.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._grammar_matchers = GrammarMatchers(self.grammar_compiler)
        if self.tokenizer is not None:  # skip_tokenizer_init: structured outputs are refused
            self.grammar_compiler.prepare()  # here, on the thread that owns the tokenizer
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[str, tuple[_Group, _Sequence]] = {}  # scheduler request id -> owner
        self._pending_outputs: dict[str, _Group] = {}  # finished out-of-step (aborts)
        self._arrival = itertools.count()
        # Tokens per completed step, until take_step_tokens() (bounded: offline use never takes them).
        self._step_tokens: collections.deque[int] = collections.deque(maxlen=64)
        # Async scheduling: the step launched by the previous step() call, not yet processed, and
        # the requests (group ids) whose steps must run in the synchronous order.
        self._in_flight: tuple[SchedulerOutput, LaunchedStep, float] | None = None  # (.., launch time)
        # auto preemption in the async order: when the previous step's sampled ids arrived
        self._last_result_time: float | None = None
        self._sync_only: set[str] = set()
        if config.async_scheduling and tp is not None:
            logger.debug("tensor parallelism: async scheduling is off (steps run in the synchronous order)")
        self.num_preemptions = 0  # sequences preempted since start (vllm:num_preemptions_total)
        # Speculative decoding (None: off): the proposer, its counters (vllm:spec_decode_*).
        self.spec_config: SpeculativeConfig | None = config.speculative_config
        self.proposer = None
        if self.spec_config is not None:
            if self.spec_config.method == "draft_model":
                self.proposer = self._draft_proposer(kv_dtype)
            elif self.spec_config.is_eagle:
                self.proposer = self._eagle_proposer(kv_dtype)
            else:  # n-gram lookup: nothing from the engine
                self.proposer = NgramProposer(self.spec_config.prompt_lookup_min, self.spec_config.prompt_lookup_max)
        self.spec_stats = None if self.spec_config is None else SpecDecodeStats(self.spec_config.num_speculative_tokens)
        if self.spec_config is not None and self.runner.decode_graphs is not None:
            if os.environ.get(SPEC_GRAPHS_ENV, "1") != "0":
                self._capture_spec_graphs()
            else:
                logger.info("speculative decoding: verify steps run eagerly (%s=0)", SPEC_GRAPHS_ENV)
        self._drafts_out = False  # some running request may still carry drafts
        self._speculating = False  # the last proposal call gave drafts a chance (EAGLE: capture the step)
        # EAGLE_DEVICE_DRAFTS_ENV: proposals leave their drafts on the device for the next step to read
        self._drafts_on_device = self._eagle_head is not None and env_switch(EAGLE_DEVICE_DRAFTS_ENV, default=True)
        self._device_drafts = None  # the last proposal's (qserve.spec_decode.proposer.DeviceDrafts)
        # enable_adaptive_verification: k per step from the measured acceptance and the batch size
        self.adaptive_speculation: AdaptiveSpeculation | None = None
        if self.spec_config is not None and self.spec_config.enable_adaptive_verification:
            self.adaptive_speculation = AdaptiveSpeculation(
                self.spec_config.num_speculative_tokens,
                self.spec_config.adaptive_verification_row_cost,
                self._draft_cost(),
            )
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens",
            config.model,
            self.device,
            self.dtype,
            num_blocks,
            cache.block_size,
        )

    def _draft_proposer(self, kv_dtype: torch.dtype) -> Proposer:
        """``speculative_config.model`` (loaded before the memory plan: its weights count there)
        beside the target, its KV in a cache of its own indexed by the target's block ids
        (``qserve.spec_decode.draft_model``, ``qserve.spec_decode.shadow_kv``)."""
        from qserve.spec_decode.draft_model import DraftModelProposer
        from qserve.spec_decode.shadow_kv import ShadowKV, num_scratch_blocks

        assert self.spec_config is not None and self._draft is not None
        if kv_dtype != self.dtype:
            raise ValueError(
                f"speculative_config.method 'draft_model' needs kv_cache_dtype 'auto' for now, got {self.config.kv_cache_dtype!r}"
            )
        model, config = self._draft
        vocab = self.model_config.vocab_size
        if self.tokenizer is not None:
            vocab = min(vocab, num_token_ids(self.tokenizer))
        if config.vocab_size < vocab:
            raise ValueError(
                f"speculative_config.model has a vocabulary of {config.vocab_size} ids, the target's tokenizer {vocab}: "
                "the draft needs the same tokenizer"
            )
        scratch = num_scratch_blocks(
            self.config.max_num_seqs, self.spec_config.num_speculative_tokens, self.kv_manager.block_size, draft=True
        )
        shadow = ShadowKV(config, self.kv_manager, self.block_pool.num_blocks, scratch, kv_dtype, self.device)
        runner = ModelRunner(model, config, shadow.kv_caches, self.kv_manager.block_size, self.device, self.config.seed)
        runner.set_valid_vocab_size(vocab)  # never a draft the target cannot score
        logger.info(
            "speculative decoding: draft model %s (%d layers), KV indexed by the target's blocks (%.1f MiB)",
            self.spec_config.model,
            config.num_layers,
            shadow.nbytes / 2**20,
        )
        return DraftModelProposer(runner, shadow, max_catch_up=self.scheduler_config.max_num_batched_tokens)

    def _load_eagle_head(self, target_config: ModelConfig):  # noqa: ANN202 - qserve.spec_decode.eagle_head.EagleHead
        """``speculative_config.model`` as an EAGLE / EAGLE-3 head of this target (loaded before the
        memory plan: its weights count there)."""
        from qserve.spec_decode.eagle_config import read_eagle_config
        from qserve.spec_decode.eagle_head import load_eagle_head

        spec = self.config.speculative_config
        head_config = read_eagle_config(spec.model, spec.method, target_config)
        head = load_eagle_head(
            spec.model, head_config, self.model, self.dtype, self.device, target_config.max_position_embeddings
        )
        if spec.draft_layers == "int4":
            head.quantize_layers()
            logger.info(
                "speculative decoding: the head drafts through 4-bit copies of its layers (%.1f MiB in all)",
                held_weight_bytes(head) / 2**20,
            )
        if spec.draft_lm_head == "int4":
            head.quantize_draft_lm_head()
            logger.info(
                "speculative decoding: the head drafts through a 4-bit copy of its lm_head (%.1f MiB)",
                head.draft_lm_head_bytes() / 2**20,
            )
        return head

    def _eagle_proposer(self, kv_dtype: torch.dtype) -> Proposer:
        """The EAGLE head's proposer: its KV in a cache of its own indexed by the target's block ids
        (``qserve.spec_decode.shadow_kv``), the runner returning the target's hidden states (final,
        or EAGLE-3's taps) of the steps that ask (``qserve.spec_decode.eagle``)."""
        from qserve.spec_decode.eagle import EagleProposer
        from qserve.spec_decode.shadow_kv import ShadowKV, num_scratch_blocks

        head = self._eagle_head
        assert self.spec_config is not None and head is not None
        if kv_dtype != self.dtype:
            raise ValueError(
                f"speculative_config.method {self.spec_config.method!r} needs kv_cache_dtype 'auto' for now, got "
                f"{self.config.kv_cache_dtype!r}"
            )
        config = head.config.model
        scratch = num_scratch_blocks(
            self.config.max_num_seqs, self.spec_config.num_speculative_tokens, self.kv_manager.block_size
        )
        shadow = ShadowKV(config, self.kv_manager, self.block_pool.num_blocks, scratch, kv_dtype, self.device)
        vocab = self.model_config.vocab_size
        if self.tokenizer is not None:
            vocab = min(vocab, num_token_ids(self.tokenizer))
        head.set_valid_vocab_size(vocab)  # never a draft the target cannot score
        logger.info(
            "speculative decoding: %s head %s (%d layer(s)%s), KV indexed by the target's blocks (%.1f MiB)",
            self.spec_config.method,
            self.spec_config.model,
            config.num_layers,
            "" if head.config.aux_layer_ids is None else f", target layers {list(head.config.aux_layer_ids)}",
            shadow.nbytes / 2**20,
        )
        return EagleProposer(head, shadow, self.device, self.scheduler_config.max_num_batched_tokens)

    def decode_graph_hidden_taps(self) -> tuple[int, ...] | None:
        """The taps the decode graphs capture (``EAGLE_DECODE_GRAPHS_ENV``): an EAGLE head's, so that
        its plain decode steps replay them; None (graphs that return logits only) otherwise."""
        if self._eagle_head is None or not env_switch(EAGLE_DECODE_GRAPHS_ENV, default=True):
            return None
        return self.runner.spec_hidden_layers

    def _draft_cost(self) -> float:
        """The adaptive policy's cost of one draft forward relative to one of the target: the bytes
        each reads (0 for n-gram lookup)."""
        target = held_weight_bytes(self.model)
        if self._draft is not None:
            return held_weight_bytes(self._draft[0]) / target
        if self._eagle_head is not None:
            return self._eagle_head.weight_bytes() / target
        return 0.0

    def _captures_piecewise_graphs(self) -> bool:
        """Whether start-up captures piecewise graphs, and so what the memory plan reserves room for: on
        (CUDA unless ``QSERVE_PIECEWISE_GRAPHS=0``), not ``enforce_eager``, and neither MoE experts that
        sync with the host nor tensor parallelism (their steps stay eager)."""
        return (
            piecewise_enabled(self.device)
            and not self.config.enforce_eager
            and getattr(self.model, "supports_cuda_graphs", True)
            and self.tp is None
        )

    def _capture_piecewise_graphs(self) -> None:
        """Piecewise CUDA graphs for steps that replay no decode graph (qserve.runner.piecewise_graphs),
        token buckets up to ``max_num_batched_tokens``, in the decode graphs' pool. Off CUDA the same
        static-buffer pieces run eagerly (tests)."""
        self.runner.capture_piecewise_graphs(
            self.scheduler_config.max_num_batched_tokens, buckets_from_env(os.environ.get(PIECEWISE_BUCKETS_ENV))
        )
        self.runner.piecewise_takes_spec_steps = env_switch(PIECEWISE_SPEC_ENV, default=True)

    def _capture_spec_graphs(self) -> None:
        """CUDA graphs of speculative steps (``SPEC_GRAPHS_ENV``), after the target's decode graphs,
        sharing their pool and logits buffer (``spec_graph_sizes`` says how large): the target's
        verify steps (k + 1 rows per sequence; with an EAGLE head, whose proposer has already asked
        the runner for hidden states, they return those too), and a draft model's decode steps and
        catch-up steps (``DRAFT_CATCH_UP_ROWS``). Off CUDA the same static-shaped steps run eagerly
        (tests)."""
        from qserve.spec_decode.draft_model import DraftModelProposer

        spec = self.spec_config
        target_graphs = self.runner.decode_graphs
        assert spec is not None and target_graphs is not None
        verify_seqs, draft_seqs, catch_up_seqs = spec_graph_sizes(
            spec, self.config.max_num_seqs, self.scheduler_config.max_num_batched_tokens
        )
        if verify_seqs:
            self.runner.capture_row_graphs(
                spec.num_speculative_tokens + 1, verify_seqs, self.max_model_len, share=target_graphs
            )
        draft = self.proposer.runner if isinstance(self.proposer, DraftModelProposer) else None
        if draft is not None and getattr(draft.model, "supports_cuda_graphs", True):
            draft.capture_decode_graphs(draft_seqs, self.max_model_len, share=target_graphs)
            if catch_up_seqs:
                draft.capture_row_graphs(DRAFT_CATCH_UP_ROWS, catch_up_seqs, self.max_model_len, share=target_graphs)
        if self._eagle_head is not None and env_switch(EAGLE_HEAD_GRAPHS_ENV, default=True):
            self._capture_eagle_head_graphs(draft_seqs, target_graphs)
        if self._eagle_head is not None and env_switch(EAGLE_CATCH_UP_GRAPHS_ENV, default=True) and verify_seqs:
            self._capture_eagle_catch_up_graphs(verify_seqs, target_graphs)

    def _capture_eagle_head_graphs(self, max_seqs: int, share: DecodeGraphs) -> None:
        """The EAGLE head's drafting forwards as CUDA graphs (``EAGLE_HEAD_GRAPHS_ENV``), in the target's
        decode graphs' pool: up to ``max_seqs`` rows, k - 1 forwards a proposal, tables reaching the
        last drafted position (``max_model_len + k``)."""
        from qserve.spec_decode.eagle import EagleProposer
        from qserve.spec_decode.eagle_graphs import HeadDraftGraphs

        spec = self.spec_config
        proposer = self.proposer
        assert spec is not None and isinstance(proposer, EagleProposer)
        if spec.num_speculative_tokens < 2 or max_seqs < 1:
            return  # one draft per proposal: it comes from the catch-up forward, nothing to replay
        longest = self.max_model_len + spec.num_speculative_tokens
        graphs = HeadDraftGraphs(
            proposer.head,
            proposer.shadow.kv_caches,
            max_seqs,
            spec.num_speculative_tokens - 1,
            longest,
            -(-longest // self.kv_manager.block_size),
            self.device,
            share=share,
        )
        graphs.capture()
        proposer.graphs = graphs

    def _capture_eagle_catch_up_graphs(self, max_seqs: int, share: DecodeGraphs) -> None:
        """The EAGLE head's catch-up forwards as CUDA graphs (``EAGLE_CATCH_UP_GRAPHS_ENV``, default on), k + 1 rows
        per sequence, up to ``max_seqs`` sequences (as many as the verify graphs take), in the target's
        decode graphs' pool."""
        from qserve.spec_decode.eagle import EagleProposer
        from qserve.spec_decode.eagle_graphs import HeadCatchUpGraphs

        spec = self.spec_config
        proposer = self.proposer
        assert spec is not None and isinstance(proposer, EagleProposer)
        graphs = HeadCatchUpGraphs(
            proposer.head,
            proposer.shadow.kv_caches,
            max_seqs,
            spec.num_speculative_tokens + 1,
            self.max_model_len,
            -(-self.max_model_len // self.kv_manager.block_size),
            self.device,
            share=share,
        )
        graphs.capture()
        proposer.catch_up_graphs = graphs

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler.async_scheduling

    def _enable_swap(
        self, mode: str, swap_space_gib: float, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """A host pool of ``swap_space_gib`` for the runner, its slots for the scheduler."""
        block_bytes = kv_block_bytes(kv_caches)
        num_host_blocks = int(swap_space_gib * GIB) // block_bytes
        if num_host_blocks < 1:
            raise ValueError(
                f"swap_space={swap_space_gib} GiB holds no KV block of {self.config.model} ({block_bytes} bytes "
                f"each); give more, or preemption_mode='recompute'"
            )
        swapper = self.runner.enable_swap(num_host_blocks)
        self.swap_cost = SwapCost(block_bytes, bandwidth_bytes_per_s=swapper.measure_bandwidth())
        self.scheduler.set_preemption_mode(mode, HostSwapSpace(num_host_blocks), self.swap_cost)
        logger.info(
            "preemption by %s: host pool of %d KV blocks (%.2f GiB%s), copy bandwidth %.1f GB/s",
            mode,
            num_host_blocks,
            num_host_blocks * block_bytes / GIB,
            ", pinned" if swapper.pinned else "",
            self.swap_cost.bandwidth_bytes_per_s / 1e9,
        )

    def take_step_tokens(self) -> list[int]:
        """The tokens (prompt and generated) of each step completed since the last call."""
        taken = list(self._step_tokens)
        self._step_tokens.clear()
        return taken

    def _observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """Records the step's tokens (``take_step_tokens``); auto preemption: the per-token
        prefill cost, from steps of many tokens."""
        self._step_tokens.append(num_tokens)
        cost = self.swap_cost
        if cost is None or num_tokens < RECOMPUTE_COST_MIN_TOKENS:
            return
        per_token = seconds / num_tokens
        cost.recompute_seconds_per_token += RECOMPUTE_COST_EMA * (per_token - cost.recompute_seconds_per_token)

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch async scheduling on or off between requests (e.g. to measure both)."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_async_scheduling: the engine has unfinished requests")
        if enabled and self.tp is not None:
            raise ValueError("async scheduling is not supported with tensor parallelism")
        if self._in_flight is not None:  # a dropped extra step of finished requests
            self._in_flight[1].result()
            self._in_flight = None
        self.scheduler.async_scheduling = bool(enabled)

    @property
    def _tensor_parallel_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def _plans_memory(self) -> bool:
        """A budget was given, or the GPU needs one (its default is a share of the card)."""
        return self.config.gpu_memory_budget is not None or self.device.type == "cuda"

    def _plan_memory(self, activation_bytes: int, max_model_len: int) -> MemoryPlan:
        """KV pages from the budget minus the weights as loaded and the measured activation peak."""
        lora_bytes = 0 if self.lora_manager is None else self.lora_manager.nbytes
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            # the model (and the LoRA slots, counted apart) is all that is allocated yet
            weights = torch.cuda.memory_allocated(self.device) - lora_bytes
        else:
            total = None
            weights = weight_bytes(
                self.model_config,
                loaders.detect(self.config.model),
                self.dtype,
                self._tensor_parallel_size,
                self.config.enable_expert_parallel,
            )
            if self._draft is not None:
                draft_path = self.config.speculative_config.model
                weights += weight_bytes(self._draft[1], loaders.detect(draft_path), self.dtype, 1)
            if self._eagle_head is not None:
                weights += held_weight_bytes(self._eagle_head) + self._eagle_head.draft_lm_head_bytes()
        budget = parse_memory_budget(self.config.gpu_memory_budget or str(GPU_DEFAULT_FRACTION), total)
        shadow_per_token, shadow_scratch = self._shadow_kv_plan()
        return make_plan(
            self.model_config,
            weights_bytes=weights,
            budget_bytes=budget,
            dtype=self.dtype,
            kv_cache_dtype=self.config.kv_cache_dtype,
            block_size=self.config.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            activation_bytes=activation_bytes or None,
            tensor_parallel_size=self._tensor_parallel_size,
            lora_bytes=lora_bytes,
            enable_expert_parallel=self.config.enable_expert_parallel,
            shadow_kv_bytes_per_token=shadow_per_token,
            shadow_scratch_blocks=shadow_scratch,
            piecewise_graph_tokens=(
                self.scheduler_config.max_num_batched_tokens if self._captures_piecewise_graphs() else 0
            ),
        )

    def _shadow_kv_plan(self) -> tuple[int, int]:
        """A draft model's or an EAGLE head's KV indexed by the target's blocks
        (``qserve.spec_decode.shadow_kv``): its bytes per token of every page and its scratch blocks;
        (0, 0) without one."""
        spec = self.config.speculative_config
        if spec is None or (self._eagle_head is None and self._draft is None):
            return 0, 0
        from qserve.spec_decode.shadow_kv import num_scratch_blocks, shadow_kv_bytes_per_token

        config = self._draft[1] if self._draft is not None else self._eagle_head.config.model
        return (
            shadow_kv_bytes_per_token(config, self.dtype),
            num_scratch_blocks(
                self.config.max_num_seqs,
                spec.num_speculative_tokens,
                self.config.block_size,
                draft=self._draft is not None,
            ),
        )

    # ------------------------------------------------------------------------------------------
    # Requests in
    # ------------------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text or None, token ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "the engine was started with skip_tokenizer_init=True: give prompts as token ids "
                    "({'prompt_token_ids': [...]} or a list of ints), not text"
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt_token_ids", "prompt"}
            if unknown:
                raise ValueError(f"unknown prompt field(s) {sorted(unknown)}; supported: prompt, prompt_token_ids")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise ValueError("prompt_token_ids must be a list of integers")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {vocab})")
        return list(token_ids)

    def validate_request(
        self, prompt: PromptInput, params: SamplingParams | PoolingParams, lora_request: LoRARequest | None = None
    ) -> tuple[str | None, list[int]]:
        if lora_request is not None:
            self._check_lora_request(lora_request)
        if isinstance(params, PoolingParams):
            params.verify(self.model_config.hidden_size)
            params = POOLING_STEP_PARAMS
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; with skip_tokenizer_init=True use stop_token_ids")
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        kv = self.kv_manager
        if kv.num_blocks_for(len(token_ids)) > kv.max_num_blocks:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens can never fit in the KV cache, which holds at most "
                f"{kv.max_num_tokens} tokens for this model"
            )
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name}={k} exceeds the vocabulary size {vocab}")
        if params.logit_bias:
            bad = next((t for t in params.logit_bias if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"logit_bias has token id {bad}, outside the vocabulary [0, {vocab})")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the tokenizer; the engine has skip_tokenizer_init=True")
            self.grammar_compiler.compile(params.structured_outputs)  # GrammarError (a ValueError) if bad
        return text, token_ids

    # ------------------------------------------------------------------------------------------
    # LoRA adapters
    # ------------------------------------------------------------------------------------------

    def _check_lora_request(self, lora_request: LoRARequest) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_manager is None:
            raise ValueError(
                f"lora_request: adapter {lora_request.lora_name!r} given, but LoRA is not enabled "
                "(LLM(..., enable_lora=True) / qserve serve --enable-lora)"
            )
        known = self.lora_manager.request_of(lora_request.lora_name)
        if known is not None and known.lora_path != lora_request.lora_path:
            raise ValueError(
                f"lora_request: adapter {lora_request.lora_name!r} is loaded from {known.lora_path}, not "
                f"{lora_request.lora_path}; unload it first to load another path under that name"
            )

    def add_lora(self, lora_request: LoRARequest) -> int:
        """Register an adapter (read and checked now; ValueError naming the field if it cannot be
        served); returns its id. Registering a name again with the same path changes nothing."""
        self._check_lora_request(lora_request)
        assert self.lora_manager is not None
        return self.lora_manager.add(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter (False if unknown); requests already running with it finish with it."""
        return self.lora_manager is not None and self.lora_manager.remove(lora_name)

    def list_loras(self) -> list[str]:
        return [] if self.lora_manager is None else self.lora_manager.names()

    def lora_stats(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting ones), by name (never the base model)."""
        manager = self.lora_manager
        if manager is None:
            return [], []
        scheduler = self.scheduler

        def names(requests: Any) -> list[str]:
            # list() copies in one C call: the metrics thread reads while the step thread changes them
            ids = dict.fromkeys(r.lora_id for r in list(requests) if r.lora_id is not None)
            return [name for name in map(manager.name_of, ids) if name is not None]

        return names(scheduler.running), names(scheduler.waiting)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        *,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (``tenant``: whose it is, for the scheduler's shares; ``lora_request``: the
        adapter it runs with, loaded now if it is new). Raises ValueError for bad input; nothing else
        is disturbed then. With ``PoolingParams`` it is an embedding request: its output carries
        ``embedding`` and no generated tokens."""
        pooling = params if isinstance(params, PoolingParams) else None
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{index}" for index in range(params.n)]
        taken = [i for i in [request_id, *seq_ids] if i in self._groups or i in self._sequences]
        if taken:  # checked up front: a half-added request would run under an id that was refused
            raise ValueError(f"request_id {request_id!r} is already in use (as {taken[0]!r})")
        text, token_ids = self.validate_request(prompt, params, lora_request)
        lora_id = None if lora_request is None else self.add_lora(lora_request)
        if pooling is not None:
            params = POOLING_STEP_PARAMS
        group = _Group(request_id, text, token_ids, params, pooling=pooling, lora_request=lora_request)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = params.clone(n=1, seed=seed)
            request = Request(
                seq_ids[index],
                token_ids,
                child_params,
                arrival_index=next(self._arrival),
                tenant=tenant,
                pooling=pooling is not None,
                lora_id=lora_id,
            )
            sequence = _Sequence(
                request,
                index,
                TokenIdsOnly()
                if self.tokenizer is None
                else IncrementalDetokenizer(
                    self.tokenizer,
                    token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    token_strings=self._token_strings,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            group.sequences.append(sequence)
        if params.structured_outputs is not None:
            for sequence in group.sequences:
                self._grammar_matchers.add(sequence.request.request_id, params.structured_outputs)
        if params.structured_outputs is not None:
            self._sync_only.add(request_id)  # needs its previous token on the host: see the module doc
        for sequence in group.sequences:
            self.scheduler.add_request(sequence.request)
            self._sequences[sequence.request.request_id] = (group, sequence)
            if lora_id is not None:  # released when the group is collected finished (_collect_outputs)
                self.lora_manager.acquire(lora_id)
        self._groups[request_id] = group

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its pages return to the pool immediately."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for sequence in group.sequences:
            if sequence.finish_reason is None:
                self.scheduler.abort_request(sequence.request.request_id)
                sequence.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
        self._pending_outputs[request_id] = group

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return a ``RequestOutput`` for each request it touched.

        By default every request that got a token (or finished) this step gets a cumulative
        output, which is what streaming needs. With ``finished_only=True`` only requests that
        finished this step get one (the offline path, e.g. ``LLM.generate``): nobody reads the
        intermediate outputs, so they are not built. The finished outputs are the same either way.
        With async scheduling the outputs are those of the step launched by the previous call.
        """
        if self.scheduler.async_scheduling:
            return self._step_async(finished_only)
        touched: dict[str, _Group] = dict(self._pending_outputs)
        self._pending_outputs.clear()
        if self.proposer is not None:
            self._propose_drafts()
        scheduler_output = self.scheduler.schedule()
        self._on_scheduled(scheduler_output, touched)
        if not scheduler_output.is_empty:
            if len(self._grammar_matchers):
                scheduler_output = self._with_grammar_bitmask(scheduler_output)
            if self._eagle_head is not None:
                scheduler_output = self._with_spec_hidden_states(scheduler_output)
                scheduler_output = self._with_device_drafts(scheduler_output)
            start = time.perf_counter()
            runner_output = self.runner.execute(scheduler_output)  # a TP runner has no launch()
            self._observe_step_time(scheduler_output.num_batched_tokens, time.perf_counter() - start)
            self._process_step(scheduler_output, runner_output, touched, finished_only, ())
        return self._collect_outputs(touched, finished_only)

    def _collect_outputs(self, touched: dict[str, _Group], finished_only: bool) -> list[RequestOutput]:
        """Outputs of the touched groups; finished groups are forgotten."""
        sequences = self._sequences
        outputs = []
        for request_id, group in touched.items():
            finished = group.finished
            if finished or not finished_only:
                outputs.append(self._make_output(group, finished))
            if finished:
                self._groups.pop(request_id, None)
                self._sync_only.discard(request_id)
                for sequence in group.sequences:
                    sequences.pop(sequence.request.request_id, None)
                    self._grammar_matchers.remove(sequence.request.request_id)
                    if sequence.request.lora_id is not None:
                        self.lora_manager.release(sequence.request.lora_id)
                if self.proposer is not None:
                    self._forget_drafts([sequence.request.request_id for sequence in group.sequences])
        return outputs

    def _step_async(self, finished_only: bool) -> list[RequestOutput]:
        """Schedule and launch the next step, then process the one in flight (see the module doc)."""
        touched: dict[str, _Group] = dict(self._pending_outputs)
        self._pending_outputs.clear()
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and (
            self._sync_only or (self.proposer is not None and self._needs_sync(in_flight[0]))
        ):
            self._process_step(
                in_flight[0], self._result(in_flight), touched, finished_only, ()
            )  # next step needs them
            in_flight = None
        if self.proposer is not None:
            self._propose_drafts()
        scheduler_output = self.scheduler.schedule()
        self._on_scheduled(scheduler_output, touched)
        if not scheduler_output.is_empty:
            if len(self._grammar_matchers):
                scheduler_output = self._with_grammar_bitmask(scheduler_output)
            if self._eagle_head is not None:
                scheduler_output = self._with_spec_hidden_states(scheduler_output)
                scheduler_output = self._with_device_drafts(scheduler_output)
            previous = None if in_flight is None else in_flight[1]
            launched_at = time.perf_counter()
            self._in_flight = (scheduler_output, self.runner.launch(scheduler_output, previous), launched_at)
        if in_flight is not None:  # requests preempted by recompute send their prompt logprobs again
            preempted = set(scheduler_output.preempted_request_ids) - set(scheduler_output.swapped_out_request_ids)
            self._process_step(in_flight[0], self._result(in_flight), touched, finished_only, preempted)
        return self._collect_outputs(touched, finished_only)

    # ------------------------------------------------------------------------------------------
    # Speculative decoding
    # ------------------------------------------------------------------------------------------

    def _needs_sync(self, in_flight: SchedulerOutput) -> bool:
        """Whether the step in flight must be processed before the next is scheduled: it verified
        drafts (its sequences' token counts are unknown until then), or this step may propose: some
        running sequence is one the back-off does not hold, and the batch leaves logit rows for drafts
        (drafts follow the last token, which must be on the host)."""
        assert self.spec_config is not None
        if in_flight.num_spec_tokens:
            return True
        num_running = self.scheduler.num_running
        if num_running >= self.config.max_num_seqs:  # no spare logit rows: _propose_drafts proposes nothing
            return False
        return self._num_spec_tokens(num_running) > 0 and self._may_propose()

    def _may_propose(self) -> bool:
        """Whether the next proposal round may give some running sequence drafts: not while the
        back-off holds every one of them (speculation failing for all, e.g. 0% acceptance), the
        sequences that never get drafts (``_never_proposes``) not counted: one structured-output or
        embedding request beside held ones would otherwise synchronize every step. Such a round needs
        no step processed first and no hidden states captured: the steps keep the asynchronous order
        and plain decode graphs, and cost what steps without speculation cost."""
        ready = self._draft_backoff.ready
        return any(
            ready(request.request_id) and not self._never_proposes(request) for request in self.scheduler.running
        )

    @staticmethod
    def _never_proposes(request: Request) -> bool:
        """A request no proposal round gives drafts, whatever its state: an embedding, or one with
        structured outputs (a draft would have to be checked against the grammar first)."""
        return request.pooling or request.sampling_params.structured_outputs is not None

    def _num_spec_tokens(self, num_running: int) -> int:
        """Drafts per sequence for a step of ``num_running`` sequences: none while the running and
        waiting requests exceed ``disable_by_batch_size`` (vLLM counts the enqueued requests: a
        burst admitted over several steps under the token budget would otherwise speculate, eagerly
        beside its prefills, until the last of it is in); with adaptive verification the policy's
        choice, else k."""
        assert self.spec_config is not None
        if not self.spec_config.proposes_at(num_running + self.scheduler.num_waiting):
            return 0
        if self.adaptive_speculation is not None:
            return self.adaptive_speculation.num_tokens(num_running)
        return self.spec_config.num_speculative_tokens

    def _with_device_drafts(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The proposal's drafts left on the device, for the step that verifies them (taken once)."""
        device, self._device_drafts = self._device_drafts, None
        if device is None or not scheduler_output.num_spec_tokens:
            return scheduler_output
        return dataclasses.replace(scheduler_output, spec_device_drafts=device)

    def _with_spec_hidden_states(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """EAGLE: the step returns the target's hidden states while speculation is on (unless it
        verifies nothing and the back-off holds every sequence for the next round too: no proposal
        reads them), and for any step that is not a plain decode (prompts; those run eagerly anyway).
        A plain decode step of a busy engine does not (it keeps its CUDA graph); the head fills those
        positions later (a back-off's skipped ones at the captured step before its next proposal)."""
        if scheduler_output.num_batched_tokens > len(scheduler_output.sequences) or (
            self._speculating and (self._drafts_out or self._may_propose())
        ):
            return dataclasses.replace(scheduler_output, spec_hidden_states=True)
        return scheduler_output

    def _propose_drafts(self) -> None:
        """Give each running request in plain decode its draft tokens for the next step
        (``Request.spec_token_ids``, verified by the scheduler's next step): at most k, never past
        ``max_tokens`` or ``max_model_len``, and in all no more than ``max_num_seqs`` minus the
        running sequences (a step computes logits for one row per draft plus one per sequence;
        the memory plan reserved ``max_num_seqs`` rows), handed out oldest request first. None
        while more requests than ``disable_by_batch_size`` run or wait, for requests with a
        token in flight, for structured outputs (a draft would have to be checked against the
        grammar first: speculation is off for them) and for embedding requests; a sequence whose
        proposals keep failing skips a growing number of steps (``qserve.spec_decode.backoff``)."""
        assert self.spec_config is not None and self.proposer is not None
        self._device_drafts = None
        running = self.scheduler.running
        spare = self.config.max_num_seqs - len(running)
        k = self._num_spec_tokens(len(running))
        if self.adaptive_speculation is not None:
            self.adaptive_speculation.end_step()
        self._speculating = spare > 0 and k > 0
        if not self._speculating:
            if self._drafts_out:  # the batch just grew past the threshold: drop what is left
                for request in running:
                    request.spec_token_ids = []
                self._drafts_out = False
            return
        batch: list[ProposalInput] = []
        owners: list[Request] = []
        for request in running:
            request.spec_token_ids = []
            params = request.sampling_params
            # every round counts a step of the back-off, also one that leaves the step in flight
            # unprocessed (its token a placeholder): see _needs_sync
            allowed = self._draft_backoff.allow(request.request_id)
            if (
                not allowed
                or request.num_output_placeholders
                or self._never_proposes(request)
                or request.num_computed_tokens != request.num_tokens - 1
            ):
                continue
            room = min(k, spare, self.max_model_len - request.num_tokens - 1)
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - request.num_output_tokens - 1)
            if room > 0:
                batch.append(
                    ProposalInput(request.request_id, request.prompt_token_ids, request.output_token_ids, room, params)
                )
                owners.append(request)
                spare -= room
        if batch and self._drafts_on_device:
            proposal = self.proposer.propose_on_device(batch)
            if proposal is not None:
                counts, self._device_drafts = proposal
                for request, count in zip(owners, counts):
                    request.spec_token_ids = [0] * count  # placeholders: the ids stay on the device
                batch = []
        if batch:
            for request, drafts in zip(owners, self.proposer.propose(batch)):
                request.spec_token_ids = drafts
        self._drafts_out = bool(owners)

    def _forget_drafts(self, request_ids: list[str], *, keep_backoff: bool = False) -> None:
        """Drop the proposer's state (a draft model's scratch blocks) and, unless ``keep_backoff`` (a
        preempted sequence: it resumes with the same text, so its proposals fail as before), the back-off
        of these sequences."""
        assert self.proposer is not None
        self.proposer.forget(request_ids)
        if not keep_backoff:
            self._draft_backoff.forget(request_ids)

    def _emit_verified(
        self, sequence: _Sequence, tokens: list[int], token_logprobs: list[TokenLogprobs] | None
    ) -> bool:
        """A verified step's tokens for one sequence (the scheduler appended them all), one at a
        time through the stop checks: those after a stop are discarded. True if it finished."""
        output = sequence.request.output_token_ids
        del output[len(output) - len(tokens) :]
        for i, token in enumerate(tokens):
            output.append(token)
            if self._on_token(sequence, token, token_logprobs[i] if token_logprobs else None):
                return True
        return False

    def _result(self, in_flight: tuple[SchedulerOutput, LaunchedStep, float]) -> RunnerOutput:
        """Wait for a launched step's sampled ids. The step ran from its launch, or from the arrival
        of the previous step's ids if that came later, until its own ids arrived: auto preemption
        learns its per-token cost from that span (the only host-side view of a step's time here)."""
        scheduler_output, launched, launched_at = in_flight
        output = launched.result()
        now = time.perf_counter()
        last, self._last_result_time = self._last_result_time, now
        began = launched_at if last is None else max(launched_at, last)
        self._observe_step_time(scheduler_output.num_batched_tokens, now - began)
        return output

    def _on_scheduled(self, scheduler_output: SchedulerOutput, touched: dict[str, _Group]) -> None:
        """Engine bookkeeping of a new schedule: preemptions, first-scheduled times, sequences the
        scheduler finished for capacity."""
        sequences = self._sequences
        swapped = scheduler_output.swapped_out_request_ids  # resume where they were: nothing sent again
        for request_id in scheduler_output.preempted_request_ids:
            if request_id not in swapped:
                sequences[request_id][1].prompt_logprobs_received = 0
        self.num_preemptions += len(scheduler_output.preempted_request_ids)
        if self.proposer is not None and scheduler_output.preempted_request_ids:
            # its KV is gone with the target's pages; the back-off stays (forgotten when it finishes)
            self._forget_drafts(scheduler_output.preempted_request_ids, keep_backoff=True)
        now = time.monotonic()
        for scheduled in scheduler_output.sequences:
            group = sequences[scheduled.request_id][0]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now
        for request_id in scheduler_output.capacity_finished_request_ids:
            group, sequence = sequences[request_id]
            sequence.finish_reason = RequestStatus.FINISHED_LENGTH.finish_reason
            touched[group.request_id] = group
        if self.proposer is not None and scheduler_output.capacity_finished_request_ids:
            self._forget_drafts(scheduler_output.capacity_finished_request_ids)

    def _process_step(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: RunnerOutput,
        touched: dict[str, _Group],
        finished_only: bool,
        preempted_since: set[str] | tuple[()],
    ) -> None:
        """A step's host work once its sampled ids are on the host (both orders). ``preempted_since``:
        requests preempted after it was scheduled (async order); their prompt logprobs from it are
        recomputed, so dropped here (their sampled token is kept, as the scheduler keeps it)."""
        new_token_requests = self.scheduler.update_from_output(scheduler_output, runner_output)
        sequences = self._sequences
        for request_id, entries in runner_output.prompt_logprobs.items():
            owner = sequences.get(request_id)
            if owner is None or owner[1].finish_reason is not None or request_id in preempted_since:
                continue
            group, sequence = owner
            self._on_prompt_logprobs(group, sequence, entries)
            touched[group.request_id] = group
        for request_id, hidden in runner_output.hidden_states.items():  # before their token finishes them
            owner = sequences.get(request_id)
            if owner is not None and owner[0].pooling is not None and owner[1].finish_reason is None:
                owner[0].embedding = owner[0].pooling.pool(hidden)
        logprobs = runner_output.logprobs
        on_token = self._on_token
        verified = runner_output.spec_token_ids
        if verified:
            self._count_verified(scheduler_output, verified)
        for request in new_token_requests:  # finished or aborted requests' extra tokens are not here
            request_id = request.request_id
            group, sequence = sequences[request_id]
            if verified and request_id in verified:
                tokens = verified[request_id]
                if (
                    self._emit_verified(sequence, tokens, runner_output.spec_logprobs.get(request_id))
                    or not finished_only
                ):
                    touched[group.request_id] = group
                continue
            token = request.output_token_ids[-1]
            if on_token(sequence, token, logprobs.get(request_id) if logprobs else None) or not finished_only:
                touched[group.request_id] = group
        if runner_output.spec_hidden_states is not None and self._eagle_head is not None:
            self._observe_hidden_states(scheduler_output, runner_output, preempted_since)

    def _observe_hidden_states(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: RunnerOutput,
        preempted_since: set[str] | tuple[()],
    ) -> None:
        """EAGLE: the head catches up on the positions this step computed and kept for each
        sequence still running (a verify step: its last known token and the accepted drafts)."""
        from qserve.spec_decode.eagle import ObservedRows

        rows, offset = [], 0
        for seq in scheduler_output.sequences:
            row_offset, offset = offset, offset + seq.num_new_tokens
            owner = self._sequences.get(seq.request_id)
            if owner is None or owner[1].finish_reason is not None or seq.pooling or seq.request_id in preempted_since:
                continue
            num_rows = seq.num_new_tokens
            if seq.spec_token_ids:  # rejected drafts' rows are not the sequence's
                emitted = runner_output.spec_token_ids.get(seq.request_id) or [None]
                num_rows += len(emitted) - 1 - len(seq.spec_token_ids)
            request = owner[1].request
            rows.append(
                ObservedRows(
                    seq.request_id,
                    request.prompt_token_ids,
                    request.output_token_ids,
                    seq.start_position,
                    num_rows,
                    row_offset,
                )
            )
        self.proposer.observe(rows, runner_output.spec_hidden_states)

    def _count_verified(self, scheduler_output: SchedulerOutput, verified: dict[str, list[int]]) -> None:
        """vllm:spec_decode_* counters: each sequence's drafts and how many were kept."""
        assert self.spec_stats is not None
        for seq in scheduler_output.sequences:
            tokens = verified.get(seq.request_id)
            if seq.spec_token_ids and tokens is not None:
                self.spec_stats.observe(len(seq.spec_token_ids), len(tokens) - 1)
                self._draft_backoff.observe(seq.request_id, len(tokens) - 1)
                if self.adaptive_speculation is not None:
                    self.adaptive_speculation.observe(len(seq.spec_token_ids), len(tokens) - 1)

    def _with_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The step's work plus the next-token bitmasks of its sampling sequences under a grammar."""
        matchers = self._grammar_matchers
        request_ids = [
            seq.request_id for seq in scheduler_output.sequences if seq.sample and seq.request_id in matchers
        ]
        if not request_ids:
            return scheduler_output
        return dataclasses.replace(
            scheduler_output, grammar_request_ids=request_ids, grammar_bitmask=matchers.fill_bitmask(request_ids)
        )

    def _on_prompt_logprobs(self, group: _Group, sequence: _Sequence, entries: list[TokenLogprobs]) -> None:
        for entry in entries:
            position = sequence.prompt_logprobs_received + 1  # entry i scores prompt token i + 1
            sequence.prompt_logprobs_received += 1
            if sequence.index == 0 and group.prompt_logprobs is not None and position == len(group.prompt_logprobs):
                group.prompt_logprobs.append(self._to_position_logprobs(entry))

    def _on_token(self, sequence: _Sequence, token: int, token_logprobs: TokenLogprobs | None) -> bool:
        """Add one sampled token: logprobs, text, stop checks. Returns True if it finished the sequence."""
        request = sequence.request
        if sequence.logprobs is not None and token_logprobs is not None:
            entry = self._to_position_logprobs(token_logprobs)
            sequence.logprobs.append(entry)
            sequence.cumulative_logprob += entry[token].logprob
        delta = sequence.detokenizer.add_token(token)
        decision = check_stop(
            params=request.sampling_params,
            new_token_id=token,
            num_output_tokens=request.num_output_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            output_text=sequence.detokenizer.output_text,
            new_char_count=len(delta),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        grammar_done = self._grammar_matchers.accept(request.request_id, token)
        if decision is None and grammar_done:
            # The grammar took its stop token (possible with ignore_eos): nothing may follow.
            decision = StopResult("stop", None, sequence.detokenizer.output_text)
        if decision is None:
            sequence.text = sequence.detokenizer.output_text
            return False
        sequence.text = decision.output_text
        sequence.finish_reason = decision.finish_reason
        sequence.stop_reason = decision.stop_reason
        status = RequestStatus.FINISHED_STOPPED if decision.finish_reason == "stop" else RequestStatus.FINISHED_LENGTH
        self.scheduler.finish_request(request.request_id, status)
        if self.proposer is not None:  # now, not with its group: a sibling of n may run on long after
            self._forget_drafts([request.request_id])
        return True

    def _to_position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in result:
                decoded = None if self.tokenizer is None else self.tokenizer.decode([token_id])
                result[token_id] = Logprob(logprob, rank, decoded)
        return result

    @staticmethod
    def _visible_text(params: SamplingParams, seq: _Sequence) -> str:
        """Text safe to show: while running, hold back what could still turn into a stop string."""
        hold = params.max_stop_str_len - 1 if params.stop and seq.finish_reason is None else 0
        return seq.text[: len(seq.text) - hold] if hold > 0 else seq.text

    def _make_output(self, group: _Group, finished: bool | None = None) -> RequestOutput:
        """A cumulative output of the group (copies, so later steps do not change it)."""
        if finished is None:
            finished = group.finished
        if group.pooling is not None:
            return self._make_pooling_output(group, finished)
        completions = [
            CompletionOutput(
                index=seq.index,
                text=self._visible_text(group.params, seq),
                token_ids=list(seq.request.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in group.sequences
        ]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=group.sequences[0].request.num_cached_tokens,
            metrics=self._timing(group) if finished else {},
            lora_request=group.lora_request,
        )

    def _make_pooling_output(self, group: _Group, finished: bool) -> RequestOutput:
        """An embedding request's output: its vector and no generated tokens (the one token its
        step sampled is not part of the result). Finished without a vector: aborted, or the KV
        pool could never hold it (its finish reason says which)."""
        return RequestOutput.pooling(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            group.embedding,
            group.sequences[0].finish_reason,
            finished,
            group.sequences[0].request.num_cached_tokens,
            self._timing(group) if finished else {},
            group.lora_request,
        )

    @staticmethod
    def _timing(group: _Group) -> dict[str, float]:
        """vLLM's ``RequestOutput.metrics`` names (monotonic seconds) for a finished request."""
        first = group.first_scheduled_time
        timing = {"arrival_time": group.arrival_time}
        if first is not None:  # None: aborted while still waiting
            timing["first_scheduled_time"] = first
            timing["time_in_queue"] = first - group.arrival_time
        return timing
