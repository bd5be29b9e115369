"""Sliding-window perplexity: window bookkeeping, and qserve's prompt-logprob scorer against transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from qserve import LLM
from qserve.quantize.perplexity import perplexity, qserve_scorer, sliding_windows
from tests.quantize.conftest import CALIB_TEXT, run_command


@pytest.mark.parametrize(
    ("num_tokens", "max_length", "stride"), [(1000, 128, 64), (100, 512, 256), (257, 64, 63), (10, 4, 1)]
)
def test_every_token_after_the_first_is_scored_once(num_tokens: int, max_length: int, stride: int) -> None:
    scored = []
    for w in sliding_windows(num_tokens, max_length, stride):
        assert w.end - w.begin <= max_length and w.begin < w.first_scored <= w.end
        scored.extend(range(w.first_scored, w.end))
    assert scored == list(range(1, num_tokens))


def test_without_overlap_window_starts_have_no_context_and_are_not_scored() -> None:
    windows = sliding_windows(200, 64, 64)  # as in the HF guide with stride == max_length
    scored = [p for w in windows for p in range(w.first_scored, w.end)]
    assert scored == [p for p in range(200) if p % 64 != 0]


def hf_sliding_perplexity(model, ids: torch.Tensor, max_length: int, stride: int) -> float:
    """The Hugging Face perplexity guide's loop, summing exact token NLLs."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + max_length, ids.numel())
        trg_len = end - prev_end
        window = ids[begin:end].unsqueeze(0)
        with torch.no_grad():
            logits = model(window).logits[0].float()  # [L, vocab]
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, window[0, 1:].unsqueeze(1)).squeeze(1)  # [L-1]
        keep = logprobs[-min(trg_len, logprobs.numel()) :]
        total -= float(keep.sum())
        count += keep.numel()
        prev_end = end
        if end == ids.numel():
            break
    return math.exp(total / count)


def test_qserve_perplexity_matches_transformers(llama_ckpt, tmp_path, capsys) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(llama_ckpt))
    ids = tokenizer(CALIB_TEXT[:1500])["input_ids"][:300]
    llm = LLM(str(llama_ckpt), device="cpu", dtype="float32", max_model_len=129, enable_prefix_caching=False)
    ours = perplexity(ids, qserve_scorer(llm), max_length=128, stride=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32).eval()
    theirs = hf_sliding_perplexity(model, torch.tensor(ids), 128, 64)
    assert ours.num_scored == len(ids) - 1
    assert ours.perplexity == pytest.approx(theirs, rel=1e-3)

    text = tmp_path / "t.txt"
    text.write_text(CALIB_TEXT[:1500])
    argv = [str(llama_ckpt), "--text", str(text), "--max-length", "128", "--stride", "64", "--device", "cpu", "--json"]
    assert run_command("eval-ppl", argv) == 0
    model_dtype = json.loads(capsys.readouterr().out)
    # An fp8 cache stores rounded keys and values: the score moves, but only a little.
    assert run_command("eval-ppl", [*argv, "--kv-cache-dtype", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["perplexity"] != model_dtype["perplexity"]
    assert fp8["perplexity"] == pytest.approx(model_dtype["perplexity"], rel=0.05)
