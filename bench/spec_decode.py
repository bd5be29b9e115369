"""Decode speed with and without speculative decoding (n-gram, a draft model, EAGLE heads), against the
measured acceptance.

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
    python bench/spec_decode.py --batches 1 --eagle layers1,layers4,random --adaptive \
        --adaptive-modes eagle-random,eagle-random-dg --eagle-decode-graphs both --verify graphs \
        --out spec_decode_eagle.md                                          # EAGLE heads built from the target
    python bench/spec_decode.py --batches 1 --eagle layers4 --eagle-decode-graphs on --eagle-head-graphs on \
        --verify graphs --profile-modes off,eagle-layers4-dg-hg --profile-dir $OUT/prof   # where a cycle goes

``--profile-modes`` (with ``--profile-dir``): after a mode's timed runs, one sequence of the repeat prompts
decodes under ``bench/profile_step.py``'s profilers (wall of unprofiled steps; kernels and CUDA runtime
calls under torch.profiler; the host's Python under cProfile; the GPU's idle gaps and the frames of ours
through them, ``bench/gpu_gaps.py``, from a chrome trace with Python stacks, ``trace_<mode>.json``), written
to ``profile_<mode>.md``: for a speculating mode one step is one whole cycle (verify, the proposer's
catch-up and drafting).

The table goes to stdout and ``--out`` (markdown).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import QWEN14B, SMALL, write_random_gptq  # noqa: E402
from qserve import LLM, SamplingParams  # noqa: E402
from qserve.engine.engine import (  # noqa: E402
    EAGLE_CATCH_UP_GRAPHS_ENV,
    EAGLE_DECODE_GRAPHS_ENV,
    EAGLE_DEVICE_DRAFTS_ENV,
    EAGLE_HEAD_GRAPHS_ENV,
    SPEC_GRAPHS_ENV,
)

# The EAGLE launch-path switches a mode sets (suffix in its name: on; absent: off): flag, suffix, variable, what.
EAGLE_SWITCHES = (
    ("decode-graphs", "-dg", EAGLE_DECODE_GRAPHS_ENV, "decode graphs hand the head its hidden states"),
    ("head-graphs", "-hg", EAGLE_HEAD_GRAPHS_ENV, "the head's k - 1 drafting forwards replay CUDA graphs"),
    ("catch-up-graphs", "-cg", EAGLE_CATCH_UP_GRAPHS_ENV, "the head's catch-up forward replays CUDA graphs"),
    ("device-drafts", "-dd", EAGLE_DEVICE_DRAFTS_ENV, "drafts stay on the device for the verify step"),
)


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


def gptq_v1_dense(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The fp16 ``[N, K]`` weight (an HF Linear's layout) of one GPTQ v1 4-bit linear, unpacked with
    the loaders' own helpers (codes packed along K, zeros along N and stored minus one in v1)."""
    from loaders.packing import unpack_n, v1_words_to_v2
    from quant_kernels.layout import unpack_codes

    codes = unpack_codes(tensors[f"{prefix}.qweight"], 4)  # [K, N]
    scales = tensors[f"{prefix}.scales"].float()  # [K/g, N]
    zeros = unpack_n(v1_words_to_v2(tensors[f"{prefix}.qzeros"], 4), 4, codes.shape[1])  # [K/g, N]
    group = codes.shape[0] // scales.shape[0]
    dense = (codes - zeros.repeat_interleave(group, 0)).float() * scales.repeat_interleave(group, 0)  # [K, N]
    return dense.t().contiguous().half()


def write_eagle_head(target: Path, path: Path, construction: str) -> None:
    """An EAGLE (v1) head checkpoint for the target, in the layout vLLM loads (``EagleLlamaForCausalLM``:
    ``fc [H, 2H]``, one Llama layer whose input norm is skipped; the target's embedding and lm_head).
    No trained head can be built here, so two constructions whose acceptance is measured, not assumed:

    - ``layersN`` (``layers1``, ``layers4``, ...): the head is the target's own first N layers
      (dequantized to fp16) run on the next token's embedding: ``fc = [I | 0]`` passes the embedding
      through as the stream; the first layer skips its input norm in a head, so its q/k/v weights
      take the norm's place: scaled by the norm's weights times the inverse RMS of the embedding
      table (each row's own RMS is within about 1% of it at this width). The target's lm_head scores
      the output (the target's final norm has unit weights here, so skipping it changes no argmax).
      The EAGLE analogue of the draft model made of the target's first layers; each draft token
      reads N fp16 layers (about 4x the bytes of N of the target's 4-bit layers).
    - ``random``: random fp16 weights (the acceptance of an unrelated head, near 0%: the cost of the
      head when it is always wrong).
    """
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "eos_token_id")  # fmt: skip
    head = {k: config[k] for k in keys if k in config}
    head.update(architectures=["EagleLlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                tie_word_embeddings=False, torch_dtype="float16")  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    if construction.startswith("layers") and construction[len("layers") :].isdigit():
        num_layers = int(construction[len("layers") :])
        if not 1 <= num_layers <= config["num_hidden_layers"]:
            raise ValueError(
                f"--eagle {construction}: N must be 1..{config['num_hidden_layers']} (the target's layers)"
            )
        head["num_hidden_layers"] = num_layers
        index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
        embed = load_file(str(target / index["model.embed_tokens.weight"]))["model.embed_tokens.weight"]
        scale = float(embed[:4096].float().pow(2).mean().rsqrt())  # rows sampled: the table is ~1.5 GB
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, :hidden] = torch.eye(hidden)
        tensors["fc.weight"] = fc.half()
        for i in range(num_layers):
            layer = load_file(str(target / index[f"model.layers.{i}.self_attn.q_proj.qweight"]))
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
                weight = gptq_v1_dense(layer, f"model.layers.{i}.{name}")  # [N, K]
                if i == 0 and name.startswith("self_attn.") and not name.endswith("o_proj"):
                    norm = layer["model.layers.0.input_layernorm.weight"].float()  # [K]
                    weight = (weight.float() * (norm * scale)).half()  # the skipped input norm, folded in
                tensors[f"layers.{i}.{name}.weight"] = weight
            norms = ("post_attention_layernorm",) if i == 0 else ("input_layernorm", "post_attention_layernorm")
            for norm in norms:
                tensors[f"layers.{i}.{norm}.weight"] = layer[f"model.layers.{i}.{norm}.weight"]
    elif construction == "random":
        gen = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * 0.02).half()

        q, kv = heads * head_dim, kv_heads * head_dim
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
        for name, shape in (("self_attn.q_proj", (q, hidden)), ("self_attn.k_proj", (kv, hidden)),
                            ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, q)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):  # fmt: skip
            tensors[f"layers.0.{name}.weight"] = rand(*shape)
        tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
    else:
        raise ValueError(f"unknown EAGLE head construction {construction!r} (layersN or random)")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


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


def profile_mode(llm: LLM, mode: str, prompt: list[int], args: argparse.Namespace) -> None:
    """One sequence decoding ``prompt`` under bench/profile_step.py's profilers; each profiled step is
    one engine step (for a speculating mode: verify, catch-up and drafting). Writes profile_<mode>.md."""
    from bench.profile_step import profiled_steps, table

    engine = llm.engine
    steps = max(1, args.profile_steps)
    # 1 + 4 * steps steps of up to k + 1 tokens each, and the sequence must still be running at the end
    params = SamplingParams(temperature=0, max_tokens=(4 * steps + 4) * (args.k + 1) + 8, ignore_eos=True)
    engine.add_request(f"profile-{mode}", {"prompt_token_ids": prompt}, params)
    while not any(seq.request.output_token_ids for _, seq in engine._sequences.values()):
        engine.step()
    stats = engine.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0)
    start_tokens = sum(len(seq.request.output_token_ids) for _, seq in engine._sequences.values())
    folder = Path(args.profile_dir)
    result = profiled_steps(llm, lambda: None, steps, trace=folder / f"trace_{mode}.json")
    tokens = sum(len(seq.request.output_token_ids) for _, seq in engine._sequences.values()) - start_tokens
    taken = 1 + 4 * steps
    rate = ""
    if stats is not None and stats.num_draft_tokens > before[0]:
        rate = f", acceptance {(stats.num_accepted_tokens - before[1]) / (stats.num_draft_tokens - before[0]):.0%}"
    while engine.has_unfinished_requests():
        engine.step()
    title = f"{mode}, batch 1, repeat prompt: {tokens / taken:.2f} tokens per step{rate}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"profile_{mode}.md").write_text("\n".join(table(title, result["wall_ms"], result["kernels"], result)))
    print(f"profile {mode}: wall {result['wall_ms']:.2f} ms/step, {tokens / taken:.2f} tokens/step{rate}")


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
        "--eagle",
        default="",
        help="also measure method eagle with heads built from the target, comma-separated constructions: "
        "layersN (the target's first N layers on the next token's embedding, e.g. layers1), random (an unrelated head)",
    )
    for flag, suffix, env, what in EAGLE_SWITCHES:
        parser.add_argument(
            f"--eagle-{flag}",
            choices=("off", "on", "both"),
            default="off",
            help=f"the EAGLE modes with {env}=1 ({what}): off, on, or both (the {suffix} modes; off sets it to 0)",
        )
    parser.add_argument(
        "--eagle-draft-lm-head",
        choices=("target", "int4", "both"),
        default="target",
        help='the EAGLE modes with speculative_config "draft_lm_head": the target\'s lm_head, a 4-bit copy '
        "(the -q4 modes), or both",
    )
    parser.add_argument(
        "--eagle-draft-layers",
        choices=("checkpoint", "int4", "both"),
        default="checkpoint",
        help='the EAGLE modes with speculative_config "draft_layers": the head\'s layers as loaded, 4-bit copies '
        "(the -l4 modes), or both",
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
    parser.add_argument(
        "--adaptive-modes",
        default="",
        help="with --adaptive: only these methods (comma-separated names as in the table, e.g. eagle-random); "
        "default every method",
    )
    parser.add_argument("--adaptive-row-cost", type=float, default=None, help="adaptive_verification_row_cost")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each (prompts, batch) this many times on the same engine and keep the median run: one run "
        "of each mode moved by ~3%% between two H100 sessions, more than issue 29's 2-point batch-128 target",
    )
    parser.add_argument(
        "--profile-modes",
        default="",
        help="comma-separated modes (names as in the table, off included) to profile at batch 1 after their "
        "timed runs: profile_<mode>.md in --profile-dir",
    )
    parser.add_argument("--profile-dir", default="spec_profile")
    parser.add_argument("--profile-steps", type=int, default=6)
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
    for construction in filter(None, args.eagle.split(",")):
        head_path = Path(f"{path}-eagle-{construction}")
        if not (head_path / "config.json").is_file():
            write_eagle_head(path, head_path, construction)
        eagle = {"method": "eagle", "model": str(head_path), "num_speculative_tokens": args.k}
        eagle["disable_by_batch_size"] = args.disable_by_batch_size
        choices = [
            {"off": [""], "on": [suffix], "both": ["", suffix]}[getattr(args, f"eagle_{flag.replace('-', '_')}")]
            for flag, suffix, _, _ in EAGLE_SWITCHES
        ]
        lm_heads = {"target": ["target"], "int4": ["int4"], "both": ["target", "int4"]}[args.eagle_draft_lm_head]
        layer_kinds = {"checkpoint": ["checkpoint"], "int4": ["int4"], "both": ["checkpoint", "int4"]}
        modes += [
            (
                f"eagle-{construction}{''.join(suffixes)}{'-q4' if lm_head == 'int4' else ''}"
                f"{'-l4' if layers == 'int4' else ''}",
                {
                    **eagle,
                    **({"draft_lm_head": lm_head} if lm_head != "target" else {}),
                    **({"draft_layers": layers} if layers != "checkpoint" else {}),
                },
            )
            for suffixes in itertools.product(*choices)
            for lm_head in lm_heads
            for layers in layer_kinds[args.eagle_draft_layers]
        ]
    if args.adaptive:
        adaptive = {"enable_adaptive_verification": True}
        if args.adaptive_row_cost is not None:
            adaptive["adaptive_verification_row_cost"] = args.adaptive_row_cost
        chosen = set(filter(None, args.adaptive_modes.split(",")))
        unknown = sorted(chosen - {mode for mode, _ in modes[1:]})
        if unknown:
            parser.error(f"--adaptive-modes {','.join(unknown)}: not among the methods {[m for m, _ in modes[1:]]}")
        for mode, config in list(modes[1:]):
            if chosen and mode not in chosen:
                continue
            fixed = {k: v for k, v in config.items() if k != "disable_by_batch_size"}
            modes.append((f"{mode}-adaptive", {**fixed, **adaptive}))
    profiled = set(filter(None, args.profile_modes.split(",")))
    unknown = sorted(profiled - {mode for mode, _ in modes})
    if unknown:
        parser.error(f"--profile-modes {','.join(unknown)}: not among the modes {[m for m, _ in modes]}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Verify graphs are captured on CUDA only (the engine captures no graph on the CPU).
    verify_modes = ["eager", "graphs"] if args.verify == "both" else [args.verify]
    if device != "cuda":
        verify_modes = ["eager"]
    results: dict[tuple[str, int, str, str], tuple[float, int, int]] = {}
    acceptance: dict[tuple[str, int, str, str], tuple[float, float]] = {}
    for mode, config in modes:
        os.environ[SPEC_GRAPHS_ENV] = "1" if config is not None and "graphs" in verify_modes else "0"
        for _, suffix, env, _ in EAGLE_SWITCHES:
            os.environ[env] = "1" if suffix in mode else "0"
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
        for verify in verify_modes if config is not None else ["eager"]:  # as it goes: a cut run keeps these
            cells = [
                f"{kind} b{batch} {results[(kind, batch, mode, verify)][0]:,.0f} tok/s"
                f" ({acceptance.get((kind, batch, mode, verify), (0.0, 0.0))[0]:.0%})"
                for kind in ("repeat", "random")
                for batch in batches
            ]
            print(f"{mode} [{verify}]: {'; '.join(cells)}", flush=True)
        if mode in profiled:
            profile_mode(llm, mode, prompts("repeat", 1, shape["vocab"], seed=1)[0], args)
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
