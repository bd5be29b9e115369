"""The front end's half of an engine step: token ids from the core in, ``RequestOutput``s out.

Knows: per request, what ``Engine`` knows in-process about its text: the incremental
detokenizer of each sequence, stop strings (``check_stop`` over the text, exactly as the engine
runs it), the text held back while a stop string may still be forming, logprob tokens decoded
as ``Engine`` decodes them, and cumulative logprobs. So the outputs equal the in-process
engine's. When a stop string ends a sequence before the core knows, it says which sequence the
core must stop (``Processed.aborts``); the ids the core made meanwhile are dropped here. Must not
know: sockets, asyncio, the scheduler.

Who decides what: the core decides eos, ``stop_token_ids``, length, grammar completion,
capacity and aborts; this module runs the same ``check_stop`` (so it agrees on the first four and
finds the stop strings the core cannot see), and takes the core's word for the rest.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from qserve.engine.core.messages import RawLogprobs, RequestDelta
from qserve.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly, TokenStrings
from qserve.engine.stop_checker import StopResult, check_stop
from qserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import SamplingParams


@dataclass(eq=False)
class _SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer | TokenIdsOnly
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    pooling: PoolingParams | None
    sequences: list[_SequenceState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    lora_request: Any = None  # the adapter it runs with (qserve.lora.request.LoRARequest), on every output

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)


@dataclass(frozen=True, slots=True)
class Processed:
    """One delta's result: the output to deliver (None if the request is unknown or already
    finished here) and the sequences the core must stop (``(request_id, index or None: all)``)."""

    output: RequestOutput | None
    aborts: list[tuple[str, int | None]]


class OutputProcessor:
    """The text side of one model's requests (event-loop thread only)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._token_strings = None if tokenizer is None else TokenStrings(tokenizer)
        self._requests: dict[str, _RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        lora_request: Any = None,
    ) -> None:
        pooling = params if isinstance(params, PoolingParams) else None
        sampling = params if isinstance(params, SamplingParams) else SamplingParams(max_tokens=1, temperature=0.0)
        sequences = []
        for index in range(sampling.n):
            detokenizer: IncrementalDetokenizer | TokenIdsOnly
            if self.tokenizer is None:
                detokenizer = TokenIdsOnly()
            else:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=sampling.skip_special_tokens,
                    token_strings=self._token_strings,
                )
            with_logprobs = sampling.logprobs is not None
            sequences.append(
                _SequenceState(
                    index,
                    detokenizer,
                    logprobs=[] if with_logprobs else None,
                    cumulative_logprob=0.0 if with_logprobs else None,
                )
            )
        state = _RequestState(request_id, prompt, list(prompt_token_ids), sampling, pooling, sequences)
        state.lora_request = lora_request
        if sampling.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self._requests[request_id] = state

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # ------------------------------------------------------------------ one delta
    def process(self, delta: RequestDelta) -> Processed:
        state = self._requests.get(delta.request_id)
        if state is None:
            return Processed(None, [])  # finished here already (a stop string), or never ours
        if delta.metrics:
            state.metrics = dict(delta.metrics)
        state.num_cached_tokens = delta.num_cached_tokens
        if delta.embedding is not None:
            state.embedding = delta.embedding
        if delta.prompt_logprobs and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(None if p is None else self._position(p) for p in delta.prompt_logprobs)
        stopped_here: list[int] = []
        for seq_delta in delta.sequences:
            seq = state.sequences[seq_delta.index]
            if seq.finish_reason is not None:
                continue  # a stop string ended it here; the core's later ids are dropped
            if not seq_delta.token_ids:
                if seq_delta.finish_reason is not None:  # aborted, or finished for capacity
                    seq.finish_reason = seq_delta.finish_reason
                    seq.stop_reason = seq_delta.stop_reason
                continue
            last = len(seq_delta.token_ids) - 1
            for k, token in enumerate(seq_delta.token_ids):
                raw = seq_delta.logprobs[k] if seq_delta.logprobs is not None and k < len(seq_delta.logprobs) else None
                decision = self._on_token(state, seq, token, raw)
                if decision is None and k == last and seq_delta.finish_reason is not None:
                    # The core's own reason (e.g. a completed grammar): the text is kept whole.
                    decision = StopResult(seq_delta.finish_reason, seq_delta.stop_reason, seq.detokenizer.output_text)
                if decision is None:
                    seq.text = seq.detokenizer.output_text
                    continue
                seq.text = decision.output_text
                seq.finish_reason = decision.finish_reason
                seq.stop_reason = decision.stop_reason
                if k != last or seq_delta.finish_reason is None:
                    stopped_here.append(seq.index)  # the core goes on until told
                break
        finished = state.finished
        aborts: list[tuple[str, int | None]] = []
        if stopped_here:
            if finished and not delta.finished:
                aborts.append((state.request_id, None))
            elif not finished:
                aborts.extend((state.request_id, index) for index in stopped_here)
        output = self._output(state, finished)
        if finished:
            del self._requests[state.request_id]
        return Processed(output, aborts)

    def _on_token(
        self, state: _RequestState, seq: _SequenceState, token: int, raw: RawLogprobs | None
    ) -> StopResult | None:
        """``Engine._on_token``'s text side (same order: logprobs, text, stop check)."""
        if seq.logprobs is not None and raw is not None:
            entry = self._position(raw)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[token].logprob  # type: ignore[operator]
        seq.token_ids.append(token)
        new_text = seq.detokenizer.add_token(token)
        return check_stop(
            params=state.params,
            new_token_id=token,
            num_output_tokens=len(seq.token_ids),
            num_prompt_tokens=len(state.prompt_token_ids),
            output_text=seq.detokenizer.output_text,
            new_char_count=len(new_text),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )

    def _position(self, raw: RawLogprobs) -> PositionLogprobs:
        """``Engine._to_position_logprobs``: token id -> Logprob, with the token decoded alone."""
        result: PositionLogprobs = {}
        for token_id, logprob, rank in zip(*raw):
            if token_id not in result:
                decoded = None if self.tokenizer is None else self.tokenizer.decode([token_id])
                result[token_id] = Logprob(logprob, rank, decoded)
        return result

    # ------------------------------------------------------------------ outputs
    def fail(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """The request ends now without the core (shutdown, a dead core): its last output."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = reason
        return self._output(state, True)

    def _output(self, state: _RequestState, finished: bool) -> RequestOutput:
        """``Engine._make_output``: a cumulative output (copies, so later steps do not change it)."""
        metrics = dict(state.metrics) if finished else {}
        if state.pooling is not None:
            return RequestOutput.pooling(
                state.request_id,
                state.prompt,
                state.prompt_token_ids,
                state.embedding,
                state.sequences[0].finish_reason,
                finished,
                state.num_cached_tokens,
                metrics,
                state.lora_request,
            )
        params = state.params
        completions = []
        for seq in state.sequences:
            text = seq.text
            hold = params.max_stop_str_len - 1 if params.stop and seq.finish_reason is None else 0
            if hold > 0:  # while running, hold back what could still turn into a stop string
                text = text[: len(text) - hold]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
            lora_request=state.lora_request,
        )
