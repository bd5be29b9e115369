"""Decide, after each new token, whether a sequence is finished and how much text to keep.

Knows: vLLM's stop semantics (eos, stop_token_ids, stop strings, max_tokens, the model's
context length, min_tokens). Must not know: torch, the tokenizer, the scheduler. Pure
function over plain values; the engine calls it after the detokenizer has added the token.

Rules (vLLM):
- The first ``min_tokens`` output tokens never stop the sequence (eos, stop ids, stop strings
  are ignored); length caps still apply.
- eos (unless ``ignore_eos``) -> "stop", stop_reason None. The eos id stays in the output
  token ids; its text is dropped (unless ``include_stop_str_in_output``).
- a token in ``stop_token_ids`` -> "stop", stop_reason = that id; its text dropped likewise.
- a stop string in the output text -> "stop", stop_reason = the string; the text is cut
  before it (or just after it with ``include_stop_str_in_output``). Only the new delta plus
  the ``len(stop) - 1`` characters before it are searched, so a stop string split across
  tokens is found, the search stays O(delta), and the prompt is never searched.
- ``len(output) >= max_tokens`` or ``len(prompt) + len(output) >= max_model_len`` -> "length".
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from qserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopResult:
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # the stop token id or stop string; None for eos / length
    output_text: str  # the text to keep (the detokenizer's text, possibly truncated)


def check_stop(
    *,
    params: SamplingParams,
    new_token_id: int,
    num_output_tokens: int,
    num_prompt_tokens: int,
    output_text: str,
    new_char_count: int,
    eos_token_ids: Collection[int],
    max_model_len: int | None = None,
) -> StopResult | None:
    """Return a ``StopResult`` if the sequence finishes with ``new_token_id``, else None.

    ``num_output_tokens`` includes the new token; ``output_text`` is the detokenized output
    so far (including the new token's delta, whose length is ``new_char_count``).
    """
    if num_output_tokens > params.min_tokens:
        if not params.ignore_eos and new_token_id in eos_token_ids:
            return StopResult("stop", None, _drop_delta(output_text, new_char_count, params))
        if new_token_id in params.stop_token_ids:
            return StopResult("stop", new_token_id, _drop_delta(output_text, new_char_count, params))
        if params.stop and new_char_count > 0:
            found = find_stop_string(output_text, new_char_count, params.stop, params.include_stop_str_in_output)
            if found is not None:
                stop_str, keep_len = found
                return StopResult("stop", stop_str, output_text[:keep_len])
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return StopResult("length", None, output_text)
    if max_model_len is not None and num_prompt_tokens + num_output_tokens >= max_model_len:
        return StopResult("length", None, output_text)
    return None


def _drop_delta(output_text: str, new_char_count: int, params: SamplingParams) -> str:
    if params.include_stop_str_in_output or new_char_count == 0:
        return output_text
    return output_text[:-new_char_count]


def find_stop_string(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find the earliest stop string touching the last ``new_char_count`` characters.

    Returns ``(stop_string, keep_len)``: keep ``output_text[:keep_len]``.
    """
    best: tuple[int, str] | None = None
    text_len = len(output_text)
    for stop_str in stop:
        start = max(text_len - new_char_count - len(stop_str) + 1, 0)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    keep_len = index + len(stop_str) if include_stop_str_in_output else index
    return stop_str, keep_len


def stop_buffer_len(params: SamplingParams) -> int:
    """Characters the streamer must hold back so a partial stop string is never sent."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return params.max_stop_str_len - 1
