"""End-to-end per-token overhead of constrained decoding in the engine, on CPU.

A tiny random Llama keeps the model forward small, so the difference between an
unconstrained batch and the same batch under a grammar is the structured-output work per step:
filling each constrained row's bitmask (xgrammar, one call per row), moving it into the
sampling metadata, the batched mask op in the sampler, and advancing the matchers.

    python bench/structured_output.py                    # batches 1, 8, 32
    python bench/structured_output.py --batch 8 --vocab 32000

Each request decodes up to ``--tokens`` tokens under ``ignore_eos`` (the regex never ends; a
JSON row ends when its grammar does). Reported: wall time per generated token, all rows
together (best of ``--repeats``), and the overhead per token = constrained - free.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qserve import LLM, SamplingParams  # noqa: E402
from qserve.structured.params import StructuredOutputsParams  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint  # noqa: E402

# Every row stays inside the grammar for the whole run: letters and spaces, never complete.
NEVER_ENDING = r"[a-z ]+"
JSON_SCHEMA = {
    "type": "array",
    "items": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}}},
}


def token_us(llm: LLM, batch: int, tokens: int, constraint: StructuredOutputsParams | None, repeats: int) -> float:
    """Best wall time per generated token (all rows together), in microseconds."""
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=tokens, ignore_eos=True, structured_outputs=constraint)
    prompts = [f"prompt {i}" for i in range(batch)]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm: grammar compiled, kernels ready
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        best = min(best, elapsed / generated)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=None, help="model vocabulary (default: the test tokenizer's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = {"vocab_size": args.vocab} if args.vocab else {}
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_checkpoint(make_tiny_model("LlamaForCausalLM", seed=0, **overrides), tmp)
        llm = LLM(tmp, device="cpu", dtype="float32", num_kv_blocks=1024, max_model_len=512, max_num_seqs=64)
        vocab = llm.engine.model_config.vocab_size
        print(f"tiny Llama, vocab {vocab}, {args.tokens} decode tokens per request, best of {args.repeats}")
        print("| batch | free us/token | regex us/token | json us/token | overhead us/token (regex, json) |")
        print("|---|---|---|---|---|")
        for batch in args.batch:
            free = token_us(llm, batch, args.tokens, None, args.repeats)
            regex = token_us(llm, batch, args.tokens, StructuredOutputsParams(regex=NEVER_ENDING), args.repeats)
            schema = token_us(llm, batch, args.tokens, StructuredOutputsParams(json=JSON_SCHEMA), args.repeats)
            print(f"| {batch} | {free:.0f} | {regex:.0f} | {schema:.0f} | {regex - free:.0f}, {schema - free:.0f} |")


if __name__ == "__main__":
    main()
