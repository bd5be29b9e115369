"""Sliding-window perplexity, HF style, scored by any "log-probability of each prompt token" function.

Knows: the windowing of the Hugging Face perplexity guide (windows of ``max_length`` tokens
starting every ``stride`` tokens; each window scores only the tokens the previous window did not,
so every token after the first is scored exactly once, with up to ``max_length − 1`` tokens of
context), and how to get per-token log-probabilities from qserve's offline API through
``prompt_logprobs``. Must not know: checkpoint formats or quantizers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Given windows of token ids, return for each window the log-probability of every token given the
# tokens before it in that window (index 0 has no context: None).
WindowScorer = Callable[[list[list[int]]], list[list[float | None]]]


@dataclass(frozen=True, slots=True)
class Window:
    begin: int  # first token of the window
    end: int  # one past the last token
    first_scored: int  # tokens [first_scored, end) are scored in this window


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_scored: int
    num_windows: int


def sliding_windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The HF sliding windows over ``num_tokens`` tokens."""
    if max_length < 2 or stride < 1 or stride > max_length:
        raise ValueError(f"need max_length >= 2 and 1 <= stride <= max_length (got {max_length}, {stride})")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        first = max(prev_end, begin + 1)  # the window's first token has no context
        if first < end:
            windows.append(Window(begin, end, first))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def perplexity(
    token_ids: Sequence[int], scorer: WindowScorer, max_length: int = 512, stride: int = 256, batch: int = 16
) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``scorer`` (see the module docstring)."""
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens to compute perplexity, got {len(token_ids)}")
    windows = sliding_windows(len(token_ids), max_length, stride)
    total_nll, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        scores = scorer([list(token_ids[w.begin : w.end]) for w in chunk])
        for w, logprobs in zip(chunk, scores):
            for pos in range(w.first_scored, w.end):
                lp = logprobs[pos - w.begin]
                if lp is None:
                    raise ValueError(f"scorer gave no log-probability for token {pos}")
                total_nll -= lp
                count += 1
    nll = total_nll / count
    return PerplexityResult(math.exp(nll), nll, count, len(windows))


def qserve_scorer(llm) -> WindowScorer:  # noqa: ANN001 - qserve.LLM (imported lazily by callers)
    """A scorer backed by ``LLM.generate(..., SamplingParams(max_tokens=1, prompt_logprobs=0))``."""
    from qserve.sampling_params import SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def score(windows: list[list[int]]) -> list[list[float | None]]:
        outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
        result = []
        for window, out in zip(windows, outputs):
            entries = out.prompt_logprobs
            row: list[float | None] = [None]
            for pos in range(1, len(window)):
                entry = entries[pos]
                row.append(entry[window[pos]].logprob if entry is not None else None)
            result.append(row)
        return result

    return score
