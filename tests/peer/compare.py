"""Compare prompt logprobs: qserve vs a tool's saved logits vs the formula oracle (qserve venv).

Knows: how to get prompt logprobs out of ``qserve.LLM`` (every prompt token plus the top-k at each
position) and how to score them against float32 logits ``[T, V]`` from elsewhere (log_softmax at
position t - 1). Usage::

    python -m tests.peer.compare CKPT REF.pt [REF2.pt ...]

prints the max |Δ logprob| of qserve vs each reference and vs ``tests.peer.formula``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TOP_K = 5


def qserve_prompt_logprobs(ckpt: str | Path, prompts: list[list[int]]) -> list[list[dict[int, float]]]:
    """Per prompt, per position t >= 1: {token id: logprob} (the prompt token and the top-k)."""
    from qserve import LLM, SamplingParams

    llm = LLM(str(ckpt), device="cpu", dtype="float32")
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts], SamplingParams(max_tokens=1, prompt_logprobs=TOP_K)
    )
    result = []
    for out in outs:
        positions = out.prompt_logprobs[1:]  # position 0 has no logprob
        result.append([{tok: lp.logprob for tok, lp in pos.items()} for pos in positions])
    return result


def logits_to_positions(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """log_softmax of logits [T, V] → logprobs of token at t given prefix: rows 0..T-2."""
    return [torch.log_softmax(x.double(), dim=-1)[:-1] for x in logits]


def max_diff_qserve(qs: list[list[dict[int, float]]], ref_logits: list[torch.Tensor]) -> float:
    worst = 0.0
    for per_prompt, ref in zip(qs, logits_to_positions(ref_logits), strict=True):
        assert len(per_prompt) == ref.shape[0]
        for t, pos in enumerate(per_prompt):
            for tok, lp in pos.items():
                worst = max(worst, abs(lp - float(ref[t, tok])))
    return worst


def max_diff_logits(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Max |Δ logprob| over the whole vocabulary at every position."""
    return max(float((x - y).abs().max()) for x, y in zip(logits_to_positions(a), logits_to_positions(b), strict=True))


def compare(ckpt: str | Path, refs: list[str | Path], zero_mode: str = "nibble") -> dict[str, float]:
    from tests.peer.formula import formula_logits

    first = torch.load(str(refs[0]))
    prompts = first["prompts"]
    qs = qserve_prompt_logprobs(ckpt, prompts)
    formula = formula_logits(ckpt, prompts, zero_mode)
    report = {"qserve_vs_formula": max_diff_qserve(qs, formula)}
    for ref_path in refs:
        ref = torch.load(str(ref_path))
        name = Path(ref_path).stem
        report[f"qserve_vs_{name}"] = max_diff_qserve(qs, ref["logits"])
        report[f"formula_vs_{name}"] = max_diff_logits(formula, ref["logits"])
    return report


if __name__ == "__main__":
    print(json.dumps(compare(sys.argv[1], sys.argv[2:]), indent=2))
