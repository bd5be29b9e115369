"""The core process's ``Engine``: the same scheduler, runner and stop rules, but token ids out,
never text.

Knows: which parts of ``Engine``'s per-token work move to the front end (detokenization, stop
strings, decoding logprob tokens) and how a touched request becomes a ``RequestDelta`` (the ids,
logprob entries and prompt logprobs it gained since the last one). Everything else is
``Engine``'s: eos, ``stop_token_ids``, ``max_tokens``, the context length and ``min_tokens`` are
still decided here (``check_stop`` sees no text, so it never finds a stop string), as are
grammar completion, capacity finishes, preemption and async scheduling. Must not know: sockets,
HTTP, the tokenizer beyond what ``Engine`` itself does with it (grammars, eos ids).

A stop string the front end finds arrives as ``finish_sequence``: the sequence stops here too
(its pages are freed) one or two steps later; the tokens made meanwhile are dropped by the front
end, which cut the output at the stop string, so the output equals the in-process one.
"""

from __future__ import annotations

from typing import Any

from qserve.engine.core.messages import RawLogprobs, RequestDelta, SequenceDelta
from qserve.engine.detokenizer import TokenIdsOnly
from qserve.engine.engine import Engine, _Group
from qserve.lora.request import LoRARequest
from qserve.outputs import Logprob, PositionLogprobs
from qserve.pooling_params import PoolingParams
from qserve.request import RequestStatus
from qserve.sampling_params import SamplingParams
from qserve.scheduler.output import TokenLogprobs


def _raw(position: PositionLogprobs | None) -> RawLogprobs | None:
    if position is None:
        return None
    ids = list(position)
    return ids, [position[t].logprob for t in ids], [position[t].rank for t in ids]


class CoreEngine(Engine):
    """``Engine`` whose ``step()`` returns ``RequestDelta``s (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # What was already sent: sequence id -> [token ids, logprob entries]; request id ->
        # [prompt logprob entries, timing sent (0/1)].
        self._sent: dict[str, list[int]] = {}
        self._request_sent: dict[str, list[int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        *,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        super().add_request(request_id, prompt, params, tenant=tenant, lora_request=lora_request)
        for sequence in self._groups[request_id].sequences:
            sequence.detokenizer = TokenIdsOnly()  # no text in the core: check_stop sees none
            self._sent[sequence.request.request_id] = [0, 0]
        # prompt entry 0 (the first prompt token has none) is known to both sides
        self._request_sent[request_id] = [1, 0]

    def finish_sequence(self, request_id: str, index: int) -> None:
        """The front end found a stop string in sequence ``index`` of ``request_id``: stop it now
        (pages freed). The front end already knows its result; what follows here is dropped."""
        group = self._groups.get(request_id)
        if group is None or not 0 <= index < len(group.sequences):
            return
        sequence = group.sequences[index]
        if sequence.finish_reason is None:
            self.scheduler.finish_request(sequence.request.request_id, RequestStatus.FINISHED_STOPPED)
            sequence.finish_reason = "stop"
        if group.finished:
            self._pending_outputs[request_id] = group  # collected (and forgotten) by the next step

    def _to_position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        # Same entries as Engine's, without decoding the tokens (the front end decodes them).
        result: PositionLogprobs = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, None)
        return result

    def _make_output(self, group: _Group, finished: bool | None = None) -> RequestDelta:  # type: ignore[override]
        if finished is None:
            finished = group.finished
        if group.pooling is not None:
            pooled = self._make_pooling_output(group, finished)
            reason = pooled.outputs[0].finish_reason
            return RequestDelta(
                group.request_id,
                [SequenceDelta(0, [], finish_reason=reason)],
                finished,
                num_cached_tokens=pooled.num_cached_tokens,
                embedding=pooled.embedding,
                metrics=pooled.metrics or None,
            )
        sequences = []
        for seq in group.sequences:
            sent = self._sent.get(seq.request.request_id)
            if sent is None:  # already finished and forgotten
                continue
            token_ids = seq.request.output_token_ids
            new_ids = token_ids[sent[0] :]
            sent[0] = len(token_ids)
            logprobs = None
            if seq.logprobs is not None:
                logprobs = [_raw(p) for p in seq.logprobs[sent[1] :]]
                sent[1] = len(seq.logprobs)
            sequences.append(
                SequenceDelta(seq.index, list(new_ids), logprobs, seq.finish_reason, seq.stop_reason)  # type: ignore[arg-type]
            )
        sent = self._request_sent.setdefault(group.request_id, [1, 0])
        prompt_logprobs = None
        if group.prompt_logprobs is not None and len(group.prompt_logprobs) > sent[0]:
            prompt_logprobs = [_raw(p) for p in group.prompt_logprobs[sent[0] :]]
            sent[0] = len(group.prompt_logprobs)
        # Timing once it is known (the front end may finish the request first: a stop string), and at the end.
        metrics = None
        if finished or (not sent[1] and group.first_scheduled_time is not None):
            metrics = self._timing(group)
            sent[1] = 1
        if finished:
            for seq in group.sequences:
                self._sent.pop(seq.request.request_id, None)
            self._request_sent.pop(group.request_id, None)
        return RequestDelta(
            group.request_id,
            sequences,
            finished,
            num_cached_tokens=group.sequences[0].request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            metrics=metrics,
        )
