"""Per-token cost of constrained decoding on CPU: xgrammar vs llguidance (the numbers behind
the choice in docs/structured_output.md).

For each library and tokenizer it measures
  - compile: one JSON schema -> the library's grammar object (cold, then cached),
  - per-token host cost of one request: fill the next-token bitmask + accept the token,
  - batch: B requests in one step, filled one by one vs with the library's batch call
    (``xgrammar.BatchGrammarMatcher`` / ``llguidance.torch.fill_next_token_bitmask_par``),
  - apply: the batched tensor op that turns [B, ceil(V/32)] int32 bitmasks into -inf logits.

Tokens are walked by picking, at each step, a random allowed token (so strings, numbers and
arrays of the schema all get exercised), identically for both libraries' matchers.

    python bench/grammar_backends.py                # demo tokenizer (2 048) and a 32 000-token BPE
    python bench/grammar_backends.py --vocab 2048   # only the demo tokenizer
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qserve.runner.sampler import apply_token_bitmask  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "recipes" / "demo" / "model"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "kind", "address"],
}


def load_tokenizer(vocab: int):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if vocab == 2048:
        return AutoTokenizer.from_pretrained(str(DEMO))
    # A larger byte-level BPE trained on the Python standard library (no download).
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = len(tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.vocab = len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, bitmask_row.unsqueeze(0))
    return torch.nonzero(logits[0] > float("-inf")).flatten().tolist()


def walk(lib, compiled, rng: random.Random, max_tokens: int = 200) -> tuple[int, list[float]]:
    """One request: fill + accept per token; returns (tokens, per-token seconds)."""
    matcher = lib.matcher(compiled)
    bitmask = lib.bitmask(1)
    times = []
    for n in range(max_tokens):
        t0 = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        t1 = time.perf_counter()
        choices = allowed_tokens(bitmask[0], lib.vocab)
        token = rng.choice(choices)
        t2 = time.perf_counter()
        lib.accept(matcher, token)
        t3 = time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
        if lib.done(matcher):
            return n + 1, times
    return max_tokens, times


def batch_step(lib, compiled, batch: int, steps: int, rng: random.Random) -> tuple[float, float]:
    """Mean seconds per step to fill B rows one by one, and with the batch call."""
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    bitmask = lib.bitmask(batch)
    seq = par = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        for row, m in enumerate(matchers):
            lib.fill(m, bitmask, row)
        t1 = time.perf_counter()
        lib.fill_batch(matchers, bitmask)
        t2 = time.perf_counter()
        seq += t1 - t0
        par += t2 - t1
        for row, m in enumerate(matchers):
            if lib.done(m):
                continue
            lib.accept(m, rng.choice(allowed_tokens(bitmask[row], lib.vocab)))
    return seq / steps, par / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, nargs="*", default=[2048, 32000])
    parser.add_argument("--walks", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for vocab in args.vocab:
        tokenizer = load_tokenizer(vocab)
        print(f"\n## tokenizer: {len(tokenizer)} tokens")
        for cls in (XGrammar, LLGuidance):
            t0 = time.perf_counter()
            lib = cls(tokenizer)
            setup = time.perf_counter() - t0
            t0 = time.perf_counter()
            compiled = lib.compile(SCHEMA)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            lib.compile(SCHEMA)
            warm = time.perf_counter() - t0
            per_token: list[float] = []
            lengths = []
            for w in range(args.walks):
                n, times = walk(lib, compiled, random.Random(w))
                lengths.append(n)
                per_token.extend(times)
            med = statistics.median(per_token) * 1e6
            p99 = sorted(per_token)[int(0.99 * (len(per_token) - 1))] * 1e6
            print(
                f"{lib.name:10s} tokenizer setup {setup * 1e3:7.1f} ms | compile cold {cold * 1e3:7.1f} ms, "
                f"again {warm * 1e3:6.2f} ms | per token (fill+accept) median {med:6.1f} us, p99 {p99:7.1f} us "
                f"over {sum(lengths)} tokens"
            )
            for batch in (8, 32):
                seq, par = batch_step(lib, compiled, batch, 20, random.Random(batch))
                print(
                    f"{'':10s} batch {batch:3d}: fill one by one {seq * 1e3:6.2f} ms/step, "
                    f"batch call {par * 1e3:6.2f} ms/step"
                )
        for batch in (8, 32):
            logits = torch.randn(batch, len(tokenizer))
            mask = torch.full((batch, (len(tokenizer) + 31) // 32), -1, dtype=torch.int32)
            mask[:, ::3] = 0x0F0F0F0F
            apply_token_bitmask(logits.clone(), mask)
            t0 = time.perf_counter()
            for _ in range(50):
                apply_token_bitmask(logits.clone(), mask)
            print(f"apply_token_bitmask [{batch}, {len(tokenizer)}]: {(time.perf_counter() - t0) / 50 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
