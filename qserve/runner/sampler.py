"""Turn one step's logits into next tokens (and logprobs), vectorized over the batch.

Knows: the math of vLLM's sampling (penalties, min_tokens masking, greedy, temperature,
top-k, top-p, min-p, per-request seeds) and "raw" logprobs. Must not know: the scheduler,
requests, the model or the tokenizer. Inputs are plain lists (built once per step into a
``SamplingMetadata``) and a logits tensor; outputs are plain Python lists.

Order of operations (as vLLM):
  0. padded vocabulary: ids at or past the tokenizer's (``valid_vocab_size``) get -inf, so no
     step below can sample them or report them in logprobs.
  1. logprobs: ``log_softmax`` of the ORIGINAL logits (vLLM's default "raw_logprobs").
  2. penalties: repetition over prompt+output tokens (positive logits divided, negative
     multiplied), then frequency (x count) and presence (x seen) over OUTPUT tokens.
  2b. logit_bias: added to the chosen tokens' logits (OpenAI's ``logit_bias``).
  2c. structured outputs: tokens a row's grammar forbids get -inf (one batched op over the
      constrained rows, from a ``[G, ceil(V/32)]`` int32 bitmask the engine filled).
  3. min_tokens: eos (unless ignore_eos) and stop_token_ids get -inf while
     ``len(output) < min_tokens``.
  4. greedy rows (temperature < 1e-5): argmax.
  5. random rows: / temperature, top-k, top-p, min-p, softmax, then the exponential race
     ``argmax(probs / q)`` with ``q ~ Exp(1)``: a sample from ``probs``.

``process_logits`` (steps 2-3) and ``random_probs`` (step 5's distribution) are also what the
rejection sampler of speculative decoding verifies draft tokens against.

Determinism: a row with ``seed`` draws its noise from a generator seeded with a hash of
(seed, output index), so its token depends only on (seed, index, its logits) and never on
the rest of the batch. Unseeded rows share the Sampler's own generator (no global RNG).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from qserve.sampling_params import SAMPLING_EPS, SamplingParams
from qserve.scheduler.output import TokenLogprobs

_MASK64 = (1 << 64) - 1
# A sampler call works on this many rows at a time: its temporaries (penalties, top-k / top-p
# sorts, noise, logprobs; ~50 bytes per logit at worst) then scale with this, not with
# max_num_seqs (on a 152k vocabulary: 0.5 GiB instead of 2 GiB at 256 rows). The planner
# reserves one chunk. Each chunk is still one vectorized pass.
SAMPLER_CHUNK_ROWS = 64
# Prompt logprobs are computed this many positions at a time (logits, log-softmax, ranks), so
# a long prompt's transient memory is bounded; the memory planner reserves one such slice.
PROMPT_LOGPROBS_CHUNK_ROWS = 256
# The output-token slot of a token still being sampled by the step in flight (async scheduling),
# until the runner writes the real id there on the device; an index no scatter accepts.
PENDING_TOKEN = -1


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step, per-row sampling inputs as tensors on the logits' device. R = number of rows."""

    vocab_size: int
    temperature: torch.Tensor  # [R] float32; 1.0 on greedy rows (they take argmax instead)
    is_greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [R] int64, vocab_size where off; None when no row uses it
    top_p: torch.Tensor | None  # [R] float32, 1.0 where off; None when no row uses it
    min_p: torch.Tensor | None  # [R] float32, 0.0 where off; None when no row uses it
    # Penalties (None when no row has any).
    presence_penalties: torch.Tensor | None  # [R] float32
    frequency_penalties: torch.Tensor | None  # [R] float32
    repetition_penalties: torch.Tensor | None  # [R] float32
    prompt_token_ids: torch.Tensor | None  # [R, max_prompt_len] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None  # [R, max_output_len] int64, padded with vocab_size
    # min_tokens masking: logits[min_tokens_rows[i], min_tokens_token_ids[i]] = -inf.
    min_tokens_rows: torch.Tensor | None  # [M] int64
    min_tokens_token_ids: torch.Tensor | None  # [M] int64
    # Per-request seeds: seeds[r] is None for unseeded rows; output_indices[r] = len(output).
    seeds: list[int | None]
    output_indices: list[int]
    # Logprobs: per-row k (None = not requested) and the largest k (None when no row asks).
    num_logprobs: list[int | None]
    max_num_logprobs: int | None
    # logit_bias: logits[logit_bias_rows[i], logit_bias_token_ids[i]] += logit_bias_values[i].
    logit_bias_rows: torch.Tensor | None = None  # [B] int64
    logit_bias_token_ids: torch.Tensor | None = None  # [B] int64
    logit_bias_values: torch.Tensor | None = None  # [B] float32
    # Structured outputs: row token_bitmask_rows[g] may only take the tokens set in token_bitmask[g].
    token_bitmask_rows: torch.Tensor | None = None  # [G] int64
    token_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32
    # is_greedy on the host: row chunks read it without a device sync (async scheduling)
    is_greedy_rows: list[bool] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.seeds)

    def to(self, device: torch.device | str) -> SamplingMetadata:
        """The same metadata on ``device``. CUDA copies go from pinned memory without blocking:
        a blocking copy would wait for the work already queued (async scheduling's step in flight)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        moved = {
            f.name: value.pin_memory().to(device, non_blocking=True)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
    token_bitmask: tuple[Sequence[int], Any] | None = None,
    num_pending_tokens: Sequence[int] | None = None,
) -> SamplingMetadata:
    """Gather the rows' sampling parameters into tensors.

    ``eos_token_ids`` are the MODEL's end-of-sequence ids (one or several, e.g. from
    ``generation_config.json``), shared by all rows. ``output_token_ids[r]`` are the tokens
    generated so far for row r (the token sampled now gets index ``len(output_token_ids[r])``).
    ``token_bitmask``: (rows, ``[G, ceil(V/32)]`` int32 array) for the rows under a grammar.
    ``num_pending_tokens[r]``: row r's output tokens sampled by a step still in flight (async
    scheduling, at most one), counted by min_tokens and the seeded output index. With penalties,
    a row's pending token gets a slot at the end of its ``output_token_ids`` row holding
    ``PENDING_TOKEN``, which the caller overwrites on the device with the in-flight step's sampled
    id (``pending_output_slots`` says where); left unfilled, the penalty's scatter fails loudly.
    """
    num_rows = len(params)
    assert len(prompt_token_ids) == num_rows and len(output_token_ids) == num_rows
    device = torch.device(device)

    greedy = [p.temperature < SAMPLING_EPS for p in params]
    temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    f32 = {"dtype": torch.float32, "device": device}

    top_k = top_p = min_p = None
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], device=device)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], **f32)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], **f32)

    num_outputs = [len(out) for out in output_token_ids]
    if num_pending_tokens is not None and any(num_pending_tokens):
        num_outputs = [n + k for n, k in zip(num_outputs, num_pending_tokens)]
    presence = frequency = repetition = prompt_ids = output_ids = None
    if any(p.has_penalties for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], **f32)
        frequency = torch.tensor([p.frequency_penalty for p in params], **f32)
        repetition = torch.tensor([p.repetition_penalty for p in params], **f32)
        prompt_ids = _pad(prompt_token_ids, vocab_size, device)
        pending = num_pending_tokens if num_pending_tokens is not None else [0] * num_rows
        if any(k > 1 for k in pending):
            raise ValueError("penalties: at most one output token per row may still be in flight")
        output_ids = _pad(
            [list(out) + [PENDING_TOKEN] * k for out, k in zip(output_token_ids, pending)], vocab_size, device
        )

    mt_rows: list[int] = []
    mt_ids: list[int] = []
    for row, (p, num_out) in enumerate(zip(params, num_outputs)):
        if num_out < p.min_tokens:
            blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ids = sorted(t for t in blocked if 0 <= t < vocab_size)
            mt_rows.extend([row] * len(ids))
            mt_ids.extend(ids)
    min_tokens_rows = min_tokens_ids = None
    if mt_rows:
        min_tokens_rows = torch.tensor(mt_rows, dtype=torch.int64, device=device)
        min_tokens_ids = torch.tensor(mt_ids, dtype=torch.int64, device=device)

    lb_rows: list[int] = []
    lb_ids: list[int] = []
    lb_values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            for token, bias in p.logit_bias.items():
                if token < vocab_size:  # the engine refuses ids past the vocabulary up front
                    lb_rows.append(row)
                    lb_ids.append(token)
                    lb_values.append(bias)
    logit_bias_rows = logit_bias_ids = logit_bias_values = None
    if lb_rows:
        logit_bias_rows = torch.tensor(lb_rows, dtype=torch.int64, device=device)
        logit_bias_ids = torch.tensor(lb_ids, dtype=torch.int64, device=device)
        logit_bias_values = torch.tensor(lb_values, **f32)

    bitmask_rows = bitmask = None
    if token_bitmask is not None and len(token_bitmask[0]):
        bitmask_rows = torch.tensor(list(token_bitmask[0]), dtype=torch.int64, device=device)  # [G]
        bitmask = torch.as_tensor(token_bitmask[1]).to(device=device, dtype=torch.int32)  # [G, W]

    num_logprobs = [p.logprobs for p in params]
    requested = [k for k in num_logprobs if k is not None]
    return SamplingMetadata(
        vocab_size=vocab_size,
        temperature=torch.tensor(temperature, **f32),
        is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        min_tokens_rows=min_tokens_rows,
        min_tokens_token_ids=min_tokens_ids,
        seeds=[p.seed for p in params],
        output_indices=num_outputs,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(requested) if requested else None,
        logit_bias_rows=logit_bias_rows,
        logit_bias_token_ids=logit_bias_ids,
        logit_bias_values=logit_bias_values,
        token_bitmask_rows=bitmask_rows,
        token_bitmask=bitmask,
        is_greedy_rows=greedy,
    )


def pending_output_slots(
    output_token_ids: Sequence[Sequence[int]], num_pending_tokens: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(rows, columns) of ``SamplingMetadata.output_token_ids`` that hold ``PENDING_TOKEN``: the
    in-flight token of each row that has one (``build_sampling_metadata`` with penalties)."""
    rows = [r for r, k in enumerate(num_pending_tokens) if k]
    return rows, [len(output_token_ids[r]) for r in rows]


def _pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [pad_id] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)  # [R, width]


class Sampler:
    """Callable: ``sampled, logprobs = Sampler(seed)(logits, metadata)``.

    Owns one torch.Generator per device for unseeded rows, seeded from ``seed`` (the
    engine's seed), so runs are reproducible without touching torch's global RNG.
    """

    def __init__(self, seed: int = 0, valid_vocab_size: int | None = None) -> None:
        self.seed = seed
        # Ids at or past this (model rows beyond the tokenizer: Qwen pads 151851 tokens to
        # 151936 rows) are never sampled nor reported; None: every id is a token.
        self.valid_vocab_size = valid_vocab_size
        self._batch_generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, *, on_device: bool = False
    ) -> tuple[Any, list[TokenLogprobs | None]]:
        return self.forward(logits, metadata, on_device=on_device)

    def forward(
        self, logits: torch.Tensor, metadata: SamplingMetadata, *, on_device: bool = False
    ) -> tuple[Any, list[TokenLogprobs | None]]:
        """Sampled ids as a list, or with ``on_device`` as an int64 ``[R]`` tensor on the logits'
        device (no host sync for them; logprobs are still gathered to the host)."""
        # logits: [R, V]
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_rows, (logits.shape, metadata.num_rows)
        assert logits.shape[1] == metadata.vocab_size, (logits.shape, metadata.vocab_size)
        num_rows = metadata.num_rows
        plain_greedy = (
            metadata.all_greedy and metadata.max_num_logprobs is None and metadata.repetition_penalties is None
        )
        if num_rows <= SAMPLER_CHUNK_ROWS or plain_greedy:  # an argmax needs no temporaries
            sampled, logprobs = self._forward_rows(logits, metadata)
            return (sampled if on_device else sampled.tolist()), logprobs
        chunks: list[torch.Tensor] = []
        logprobs: list[TokenLogprobs | None] = []
        for start in range(0, num_rows, SAMPLER_CHUNK_ROWS):
            end = min(start + SAMPLER_CHUNK_ROWS, num_rows)
            chunk_sampled, chunk_logprobs = self._forward_rows(logits[start:end], slice_metadata(metadata, start, end))
            chunks.append(chunk_sampled)
            logprobs += chunk_logprobs
        sampled = torch.cat(chunks)  # [R]
        return (sampled if on_device else sampled.tolist()), logprobs

    def _forward_rows(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        original = logits.float()  # [R, V], a copy unless the logits already are float32
        # Masking the copy in place saves a second [R, V] copy; the caller's tensor is never written.
        original = mask_padded_vocab(original, self.valid_vocab_size, in_place=original is not logits)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(original, dim=-1)  # [R, V]
        logits = self.process_logits(original, metadata)  # [R, V]

        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)  # [R]
        else:
            random_sampled = self._sample_random(logits, metadata)  # [R]
            if metadata.all_random:
                sampled = random_sampled
            else:
                sampled = torch.where(metadata.is_greedy, logits.argmax(dim=-1), random_sampled)

        logprobs: list[TokenLogprobs | None] = [None] * metadata.num_rows
        if raw_logprobs is not None:
            rows = [r for r, n in enumerate(metadata.num_logprobs) if n is not None]
            if len(rows) < metadata.num_rows:
                index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [L]
                raw_logprobs, chosen = raw_logprobs[index], sampled[index]  # [L, V], [L]
            else:
                chosen = sampled
            gathered = gather_logprobs(
                raw_logprobs, chosen, _num_real(metadata.max_num_logprobs or 0, self.valid_vocab_size)
            )
            for r, full in zip(rows, gathered):
                n = (metadata.num_logprobs[r] or 0) + 1  # chosen + its own top-k
                logprobs[r] = TokenLogprobs(full.token_ids[:n], full.logprobs[:n], full.ranks[:n])
        return sampled, logprobs  # [R] int64

    def process_logits(self, original: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 2 to 3 (penalties, logit_bias, grammar masks, min_tokens) on float32 logits
        ``[R, V]`` whose padded vocabulary is masked already; ``original`` is never written."""
        # Never modify the caller's tensor: every step below makes a new tensor, except the
        # min_tokens mask, which clones first if nothing has yet (greedy rows copy nothing).
        logits = original  # [R, V]
        if metadata.repetition_penalties is not None:
            logits = apply_penalties(logits, metadata)
        if metadata.logit_bias_rows is not None:
            if logits is original:
                logits = logits.clone()
            logits.index_put_(
                (metadata.logit_bias_rows, metadata.logit_bias_token_ids), metadata.logit_bias_values, accumulate=True
            )
        if metadata.token_bitmask_rows is not None:
            rows = metadata.token_bitmask_rows
            constrained = apply_token_bitmask(logits[rows], metadata.token_bitmask)  # [G, V] (a copy)
            logits = logits.index_copy(0, rows, constrained)  # [R, V] new tensor
        if metadata.min_tokens_rows is not None:
            if logits is original:
                logits = logits.clone()
            logits.index_put_(
                (metadata.min_tokens_rows, metadata.min_tokens_token_ids),
                logits.new_full((), float("-inf")),  # no host-to-device copy (it would sync)
            )
        return logits

    def random_probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Step 5's distribution of processed logits ``[R, V]``: temperature, top-k, top-p,
        min-p, softmax (a new ``[R, V]`` float32 tensor)."""
        logits = logits / md.temperature.unsqueeze(1)  # [R, V]
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        return torch.softmax(logits, dim=-1)  # [R, V]

    # ------------------------------------------------------------------ internals
    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = self.random_probs(logits, md)  # [R, V]
        noise = self._exponential_noise(probs, md)  # [R, V]
        return probs.div_(noise).argmax(dim=-1)  # [R]

    def _exponential_noise(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        noise = torch.empty_like(probs)  # [R, V]
        device = probs.device
        if any(s is None for s in md.seeds):
            noise.exponential_(generator=self._batch_generator(device))
        seeded = [(r, s) for r, s in enumerate(md.seeds) if s is not None]
        if seeded:
            gen = self._row_generators.get(device)
            if gen is None:
                gen = self._row_generators[device] = torch.Generator(device=device)
            for row, seed in seeded:  # the only per-row loop: one generator state per request
                gen.manual_seed(row_seed(seed, md.output_indices[row]))
                noise[row].exponential_(generator=gen)
        return noise

    def _batch_generator(self, device: torch.device) -> torch.Generator:
        gen = self._batch_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed & _MASK64)
            self._batch_generators[device] = gen
        return gen


def slice_metadata(md: SamplingMetadata, start: int, end: int) -> SamplingMetadata:
    """The metadata of rows ``[start, end)`` (for the sampler's row chunks)."""

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:end]

    def sparse(row_ids: torch.Tensor | None, *values: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Entries of a per-row list (``row_ids`` [E] with ``values`` [E, ...]) that fall in the
        chunk, their rows renumbered from ``start``; all None when none does."""
        if row_ids is None:
            return (None,) * (1 + len(values))
        keep = (row_ids >= start) & (row_ids < end)  # [E]
        if not bool(keep.any()):
            return (None,) * (1 + len(values))
        return (row_ids[keep] - start, *(v[keep] for v in values))

    min_rows, min_ids = sparse(md.min_tokens_rows, md.min_tokens_token_ids)
    bias_rows, bias_ids, bias_values = sparse(md.logit_bias_rows, md.logit_bias_token_ids, md.logit_bias_values)
    mask_rows, mask = sparse(md.token_bitmask_rows, md.token_bitmask)
    greedy = md.is_greedy[start:end]
    greedy_rows = None if md.is_greedy_rows is None else md.is_greedy_rows[start:end]
    if greedy_rows is not None:
        all_greedy, all_random = md.all_greedy or all(greedy_rows), md.all_random or not any(greedy_rows)
    else:
        all_greedy, all_random = md.all_greedy or bool(greedy.all()), md.all_random or not bool(greedy.any())
    num_logprobs = md.num_logprobs[start:end]
    requested = [k for k in num_logprobs if k is not None]
    return SamplingMetadata(
        vocab_size=md.vocab_size,
        temperature=md.temperature[start:end],
        is_greedy=greedy,
        all_greedy=all_greedy,
        all_random=all_random,
        is_greedy_rows=greedy_rows,
        top_k=rows(md.top_k),
        top_p=rows(md.top_p),
        min_p=rows(md.min_p),
        presence_penalties=rows(md.presence_penalties),
        frequency_penalties=rows(md.frequency_penalties),
        repetition_penalties=rows(md.repetition_penalties),
        prompt_token_ids=rows(md.prompt_token_ids),
        output_token_ids=rows(md.output_token_ids),
        min_tokens_rows=min_rows,
        min_tokens_token_ids=min_ids,
        logit_bias_rows=bias_rows,
        logit_bias_token_ids=bias_ids,
        logit_bias_values=bias_values,
        token_bitmask_rows=mask_rows,
        token_bitmask=mask,
        seeds=md.seeds[start:end],
        output_indices=md.output_indices[start:end],
        num_logprobs=num_logprobs,
        max_num_logprobs=max(requested) if requested else None,
    )


def row_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed from (request seed, output index): splitmix64 of both."""
    x = ((seed & _MASK64) ^ (((index + 1) * 0x9E3779B97F4A7C15) & _MASK64)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties; returns new logits."""
    assert md.prompt_token_ids is not None and md.output_token_ids is not None
    assert md.presence_penalties is not None and md.frequency_penalties is not None
    assert md.repetition_penalties is not None
    num_rows, vocab = logits.shape
    # Pad id == vocab: scatter into one extra column, then drop it.
    output_counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)  # [R, V+1]
    output_counts.scatter_add_(1, md.output_token_ids, torch.ones_like(md.output_token_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]  # [R, V]
    prompt_mask = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)  # [R, V+1]
    prompt_mask.scatter_(1, md.prompt_token_ids, True)
    output_mask = output_counts > 0  # [R, V]
    seen = prompt_mask[:, :vocab] | output_mask  # [R, V]

    rep = torch.where(seen, md.repetition_penalties.unsqueeze(1), 1.0)  # [R, V]
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - md.presence_penalties.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k largest logits (ties at the k-th kept) and the smallest nucleus with mass >= p."""
    vocab = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [R, V] ascending
    if top_k is not None:
        kth_pos = (vocab - top_k).clamp(min=0, max=vocab - 1).unsqueeze(1)  # [R, 1]
        kth_value = logits_sort.gather(1, kth_pos)  # [R, 1]
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)  # [R, V]
        cum = probs_sort.cumsum(dim=-1)  # [R, V] ascending mass
        drop = cum <= (1.0 - top_p).unsqueeze(1)  # [R, V]
        drop[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` x the top token's probability."""
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Entry 0: ``token_ids[r]`` with its logprob and 1-based rank; then the top-k of row r.

    logprobs: [N, V] normalized log-probabilities; token_ids: [N] int64.
    """
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    ids = token_ids.unsqueeze(1)  # [N, 1]
    values = chosen
    if k > 0:
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)  # [N, k]
        ids = torch.cat([ids, top_ids], dim=1)  # [N, 1 + k]
        values = torch.cat([values, top_values], dim=1)  # [N, 1 + k]
    ids_list = ids.tolist()
    values_list = values.tolist()
    ranks_list = ranks.tolist()
    num_top = ids.shape[1] - 1
    top_ranks = list(range(1, num_top + 1))
    return [
        TokenLogprobs(token_ids=i, logprobs=v, ranks=[r, *top_ranks])
        for i, v, r in zip(ids_list, values_list, ranks_list)
    ]


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, k: int, valid_vocab_size: int | None = None
) -> list[TokenLogprobs]:
    """Logprobs of the actual next prompt tokens. logits: [T, V]; target_token_ids: [T].

    Entry 0 of each result is the target token (``k == 0`` gives only that), then the top-k.
    ``valid_vocab_size``: as ``Sampler``'s, ids past it get no probability mass.
    """
    logprobs = torch.log_softmax(mask_padded_vocab(logits.float(), valid_vocab_size), dim=-1)  # [T, V]
    return gather_logprobs(logprobs, target_token_ids, _num_real(k, valid_vocab_size))


def mask_padded_vocab(logits: torch.Tensor, valid_vocab_size: int | None, *, in_place: bool = False) -> torch.Tensor:
    """``logits`` [R, V] with the columns at or past ``valid_vocab_size`` set to -inf, as a new
    tensor (the caller's is left alone unless ``in_place``); ``logits`` itself when there are no
    such columns.
    A model's vocabulary may be padded past its tokenizer's (Qwen: 151936 rows for 151851
    tokens): those rows hold no token, so they must never be sampled or reported."""
    if valid_vocab_size is None or valid_vocab_size >= logits.shape[-1]:
        return logits
    masked = logits if in_place else logits.clone()
    masked[..., valid_vocab_size:] = float("-inf")
    return masked


def _num_real(k: int, valid_vocab_size: int | None) -> int:
    """A top-k of at most the real tokens: past them only masked padding (-inf) is left."""
    return k if valid_vocab_size is None else min(k, valid_vocab_size)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed tokens to -inf, in place, for the whole batch at once; returns ``logits``.

    logits: [R, V] float; bitmask: [R, W] int32 on the same device, bit ``j`` of word ``w``
    allowing token ``32 * w + j`` (the layout xgrammar and llguidance fill). A row of all ones
    (-1) allows everything. Tokens past ``32 * W`` (a model vocabulary padded beyond the
    tokenizer's) are disallowed. The bits are unpacked a byte at a time through a 256-entry
    table (one gather), which is cheaper than 32 shifts per word.
    """
    num_rows, vocab = logits.shape
    table = _bit_table(bitmask.device)  # [256, 8] bool
    as_bytes = bitmask.contiguous().view(torch.uint8).to(torch.int64)  # [R, 4 W] little-endian bytes
    allowed = table[as_bytes].reshape(num_rows, -1)  # [R, 32 W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)  # [R, V]
    return logits.masked_fill_(~allowed[:, :vocab], float("-inf"))


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _bit_table(device: torch.device) -> torch.Tensor:
    """Row b holds the 8 bits of byte b, least significant first. Cached per device (a constant)."""
    table = _BIT_TABLES.get(device)
    if table is None:
        byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)  # [256, 1]
        table = ((byte >> torch.arange(8)) & 1).bool().to(device)  # [256, 8]
        _BIT_TABLES[device] = table
    return table
