"""Decode speed with and without speculative decoding (n-gram), against the measured acceptance.

One engine per mode on a Qwen2.5-14B-shaped random GPTQ-4bit checkpoint (``bench/e2e.py``'s
``write_random_gptq``, written to ``--checkpoint`` if it is not there yet), greedy, at each batch
size: B prompts are prefilled, then the time until every sequence has ``--max-tokens`` tokens
gives decode tok/s. Two prompt kinds: ``repeat`` (a random 32-token segment four times: the
lookup always finds drafts, and whether the model continues the pattern is measured, not
assumed) and ``random`` (random tokens: few drafts, mostly rejected). Per row: tok/s off and on,
the speedup, the acceptance rate (accepted / draft tokens), drafts per sequence-step and the
steps taken, and how many of the timed steps verified drafts. With random weights the acceptance
is whatever greedy decoding of that model gives; the speedup is reported against it (issue 29:
>= 2.0x at >= 70% acceptance with k = 4, <= 5% slower at 0%, >= 0.98x at batch 128 with
``disable_by_batch_size``).

``--verify eager|graphs|both`` (default both, CUDA only for graphs): each speculating engine starts
with ``QSERVE_SPEC_GRAPHS=1`` (verify graphs; a draft model's decode and catch-up graphs) and is
measured twice, with those graphs detached (``eager``: the verify steps and the draft's steps run
eagerly, as without the variable) and attached (``graphs``); the plain decode graphs are the same
in both. At batch 128 (above ``disable_by_batch_size``) every step is the plain decode step; the
"verify steps" column counts the timed steps that still verified drafts: the tail of the run,
once finished sequences bring the batch under the threshold.

    python bench/spec_decode.py --out spec_decode.md                        # H200
    python bench/spec_decode.py --draft-layers 12 --out spec_decode.md      # also a draft model: the
                                                                            # target's first 12 layers
    python bench/spec_decode.py --small --out /tmp/spec_decode.md           # tiny model, CPU or GPU
    python bench/spec_decode.py --verify eager --out spec_decode.md         # as before: no verify graphs
    python bench/spec_decode.py --batches 1 --draft-layers 12 --mismatched-draft --adaptive \
        --verify graphs --out spec_decode_0.md                              # the 0%-acceptance case
    python bench/spec_decode.py --batches 128 --draft-layers 12 --verify graphs --repeats 5 \
        --out spec_decode_128.md                                            # batch 128: median of 5 runs

The table goes to stdout and ``--out`` (markdown).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e import QWEN14B, SMALL, write_random_gptq  # noqa: E402

from qserve import LLM, SamplingParams  # noqa: E402
from qserve.engine.engine import SPEC_GRAPHS_ENV  # noqa: E402


def write_draft(target: Path, path: Path, num_layers: int, mismatched: bool = False) -> None:
    """A draft checkpoint that is the target's first ``num_layers`` layers plus its embeddings, final
    norm and head (same tokenizer, same quantization): its acceptance is measured, not assumed.
    ``mismatched``: the head's rows rolled by half the vocabulary, so the draft proposes the token
    half a vocabulary away from its own choice: the target accepts next to nothing (issue 29's
    0%-acceptance case, measured with the same draft cost)."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in sorted(target.glob("*.safetensors")):
        tensors = load_file(str(shard))
        kept = {
            name: t
            for name, t in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }
        if mismatched and "lm_head.weight" in kept:
            head = kept["lm_head.weight"]  # [vocab, hidden]
            kept["lm_head.weight"] = torch.roll(head, head.shape[0] // 2, dims=0).contiguous()
        save_file(kept, str(path / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(kept, shard.name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(config))
    for other in target.iterdir():  # tokenizer and quantization files
        if (
            other.is_file()
            and other.suffix != ".safetensors"
            and other.name not in ("config.json", "model.safetensors.index.json")
        ):
            (path / other.name).write_bytes(other.read_bytes())


def prompts(kind: str, batch: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "repeat":
        return [torch.randint(3, vocab, (32,), generator=gen).tolist() * 4 for _ in range(batch)]
    return [torch.randint(3, vocab, (128,), generator=gen).tolist() for _ in range(batch)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_decode(llm: LLM, batch_prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, int, int]:
    """Decode tok/s once the prompts are in, the number of steps it took and how many of them
    verified drafts."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(batch_prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    while any(not seq.request.output_token_ids for _, seq in engine._sequences.values()):
        engine.step()
    done = sum(len(seq.request.output_token_ids) for _, seq in engine._sequences.values())
    verify_steps = []
    schedule = engine.scheduler.schedule

    def counted():  # noqa: ANN202
        out = schedule()
        verify_steps.append(bool(out.num_spec_tokens))
        return out

    engine.scheduler.schedule = counted
    sync()
    start, steps = time.perf_counter(), 0
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        sync()
    finally:
        del engine.scheduler.schedule  # the bound method again
    return (len(batch_prompts) * max_tokens - done) / (time.perf_counter() - start), steps, sum(verify_steps)


def attach_spec_graphs(llm: LLM, attach: bool, detached: dict) -> None:
    """Detach (``attach=False``) or re-attach the graphs of speculative steps: the target's verify
    graphs, a draft model's decode and catch-up graphs (``detached`` keeps them meanwhile). The
    target's decode graphs stay: steps without drafts run as always."""
    engine = llm.engine
    runners = {"target": (engine.runner, ("row_graphs",))}
    draft = getattr(engine.proposer, "runner", None)
    if draft is not None:
        runners["draft"] = (draft, ("decode_graphs", "row_graphs"))
    for name, (runner, fields) in runners.items():
        for field in fields:
            key = (name, field)
            if attach and key in detached:
                setattr(runner, field, detached.pop(key))
            elif not attach and getattr(runner, field) is not None:
                detached[key] = getattr(runner, field)
                setattr(runner, field, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--checkpoint", default="/tmp/qserve-bench/qwen14b-gptq")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--out", default="spec_decode.md")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--disable-by-batch-size", type=int, default=64)
    parser.add_argument(
        "--verify",
        choices=("eager", "graphs", "both"),
        default="both",
        help="verify (and draft-model) steps eager, under CUDA graphs (QSERVE_SPEC_GRAPHS=1), or both, one engine each method",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="also measure method draft_model with the target's first N layers as the draft (0: n-gram only)",
    )
    parser.add_argument(
        "--mismatched-draft",
        action="store_true",
        help="with --draft-layers: the draft's head rolled by half the vocabulary (acceptance near 0%%), "
        "the case where speculation must cost (almost) nothing",
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="also measure each method with enable_adaptive_verification (k per step from acceptance and "
        "batch size; no disable_by_batch_size): it should never be slower than off",
    )
    parser.add_argument("--adaptive-row-cost", type=float, default=None, help="adaptive_verification_row_cost")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each (prompts, batch) this many times on the same engine and keep the median run: one run "
        "of each mode moved by ~3%% between two H100 sessions, more than issue 29's 2-point batch-128 target",
    )
    args = parser.parse_args()
    shape = SMALL if args.small else QWEN14B
    path = Path(args.checkpoint + ("-small" if args.small else ""))
    if not (path / "config.json").is_file():
        write_random_gptq(path, shape)
    batches = [int(b) for b in args.batches.split(",")]
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    modes: list[tuple[str, dict | None]] = [("off", None), ("ngram", spec)]
    if args.draft_layers:
        suffix = "-mismatched" if args.mismatched_draft else ""
        draft_path = Path(f"{path}-draft{args.draft_layers}{suffix}")
        if not (draft_path / "config.json").is_file():
            write_draft(path, draft_path, args.draft_layers, mismatched=args.mismatched_draft)
        draft = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": args.k}
        name = f"draft{args.draft_layers}{suffix}"
        modes.append((name, {**draft, "disable_by_batch_size": args.disable_by_batch_size}))
    if args.adaptive:
        adaptive = {"enable_adaptive_verification": True}
        if args.adaptive_row_cost is not None:
            adaptive["adaptive_verification_row_cost"] = args.adaptive_row_cost
        for mode, config in list(modes[1:]):
            fixed = {k: v for k, v in config.items() if k != "disable_by_batch_size"}
            modes.append((f"{mode}-adaptive", {**fixed, **adaptive}))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Verify graphs are captured on CUDA only (the engine captures no graph on the CPU).
    verify_modes = ["eager", "graphs"] if args.verify == "both" else [args.verify]
    if device != "cuda":
        verify_modes = ["eager"]
    results: dict[tuple[str, int, str, str], tuple[float, int, int]] = {}
    acceptance: dict[tuple[str, int, str, str], tuple[float, float]] = {}
    for mode, config in modes:
        os.environ[SPEC_GRAPHS_ENV] = "1" if config is not None and "graphs" in verify_modes else "0"
        llm = LLM(
            str(path),
            device=device,
            gpu_memory_budget=args.budget if device == "cuda" else None,
            max_num_seqs=max(256, 2 * max(batches)),  # room for drafts: a step samples <= max_num_seqs rows
            speculative_config=config,
        )
        detached: dict = {}
        for n, verify in enumerate(verify_modes if config is not None else ["eager"]):
            attach_spec_graphs(llm, verify == "graphs", detached)
            for batch in batches if n == 0 else ():  # compile / warm up every shape first (graphs: at capture)
                timed_decode(llm, prompts("random", batch, shape["vocab"], 99), 8, f"warm{batch}")
            for kind in ("repeat", "random"):
                for batch in batches:
                    stats = llm.engine.spec_stats
                    before = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts) if stats else None
                    batch_prompts = prompts(kind, batch, shape["vocab"], seed=batch)
                    key = (kind, batch, mode, verify)
                    runs = [
                        timed_decode(llm, batch_prompts, args.max_tokens, f"{verify}{kind}{batch}r{r}")
                        for r in range(max(1, args.repeats))
                    ]
                    results[key] = sorted(runs, key=lambda run: run[0])[len(runs) // 2]  # the median run by tok/s
                    if stats is not None:
                        drafted = stats.num_draft_tokens - before[0]
                        accepted = stats.num_accepted_tokens - before[1]
                        drafts = stats.num_drafts - before[2]
                        acceptance[key] = (accepted / drafted if drafted else 0.0, drafted / max(drafts, 1))
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    lines = [
        f"speculative decoding, {device}, {'small' if args.small else 'Qwen2.5-14B-shaped GPTQ-4bit'}, greedy, "
        f"{args.max_tokens} tokens per sequence; configs {json.dumps([c for _, c in modes[1:]])}; verify: eager "
        f"(as without {SPEC_GRAPHS_ENV}) or graphs ({SPEC_GRAPHS_ENV}=1: verify steps and a draft model's steps "
        "under CUDA graphs)",
        "",
        "| method | verify | prompts | batch | off tok/s | on tok/s | speedup | acceptance | drafts per draft step "
        "| steps off / on | verify steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, _ in modes[1:]:
        for verify in verify_modes:
            for kind in ("repeat", "random"):
                for batch in batches:
                    off, off_steps, _ = results[(kind, batch, "off", "eager")]
                    on, on_steps, verify_steps = results[(kind, batch, mode, verify)]
                    rate, per_draft = acceptance.get((kind, batch, mode, verify), (0.0, 0.0))
                    lines.append(
                        f"| {mode} | {verify} | {kind} | {batch} | {off:,.0f} | {on:,.0f} | {on / off:.2f}x "
                        f"| {rate:.0%} | {per_draft:.2f} | {off_steps} / {on_steps} | {verify_steps} |"
                    )
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
