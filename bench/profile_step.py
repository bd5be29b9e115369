"""Where a step's time goes: per-kernel CUDA time of mixed steps (prefill chunks riding with
running decodes) and of pure-decode steps, on the Qwen2.5-14B-shaped random GPTQ-4bit checkpoint
under the 24 GiB budget, with the step's wall time beside its GPU kernel time.

Knows: how to build a step of a chosen shape through the public engine (``decode`` running
sequences plus ``prefills`` new prompts of ``prefill_len`` tokens, all of which fit one step's
token budget), how to time it (``torch.profiler``; wall from before ``step()`` to after a device
sync) and how to group kernels into families by name. Must not know: the engine's internals
beyond ``add_request`` / ``step`` / ``has_unfinished_requests``.

    PYTHONPATH=. python3 bench/profile_step.py --out $OUT --ckpt /tmp/qb        # on the GPU
    PYTHONPATH=. python3 bench/profile_step.py --small --out /tmp/prof          # CPU smoke
    PYTHONPATH=. python3 bench/profile_step.py --out $OUT --piecewise both      # eager vs piecewise graphs
    PYTHONPATH=. python3 bench/profile_step.py --model qwen3-30b-a3b --ckpt /tmp/qbm --decode 1,32 --out $OUT

``--model qwen3-30b-a3b``: the Qwen3-30B-A3B-shaped random GPTQ-4bit checkpoint of ``bench/e2e.py`` (issue
32: where a batch-1 MoE step's 3.9 ms go); the MoE kernels get families of their own (router, token sort,
grouped GEMMs), and ``QSERVE_MOE_KERNEL`` / ``QSERVE_FUSED_ROUTER`` choose what the engine runs as usual.

``--piecewise`` (off | on | both; default: on, as the engine on CUDA, unless ``QSERVE_PIECEWISE_GRAPHS=0``
is set) sets that variable for the engine (both: one engine
after the other, same shapes and seeds), so the mixed step's wall and GPU time can be compared with
and without piecewise CUDA graphs; ``--piecewise-buckets`` sets ``QSERVE_PIECEWISE_BUCKETS`` (fewer
buckets capture faster). The pure-decode rows replay the decode graphs either way.

Writes ``profile_step.md`` (summary + one kernel table per step kind) to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import (  # noqa: E402
    QWEN3_30B_A3B,
    QWEN14B,
    SMALL,
    SMALL_MOE,
    start_decoding,
    sync,
    write_random_gptq,
    write_random_moe_gptq,
)
from qserve import LLM, SamplingParams  # noqa: E402
from qserve.runner.piecewise_graphs import PIECEWISE_BUCKETS_ENV, PIECEWISE_GRAPHS_ENV  # noqa: E402

FAMILIES = (  # first match wins; names as the profiler reports them
    ("LoRA shrink / expand", ("lora_",)),
    ("MoE grouped GEMM", ("moe_mma", "moe_w4a16")),
    ("MoE token sort", ("moe_align",)),
    ("MoE router top-k", ("router_topk",)),
    ("w4a16 GEMM (MMA layout)", ("w4a16_mma",)),
    ("w4a16 GEMM (other)", ("w4a16", "_w4a16")),
    ("dequantize (for cuBLAS)", ("dequant",)),
    ("cuBLAS / fp16 GEMM", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("attention", ("attention", "attn", "paged")),
    ("KV store", ("store_kv", "kv_store", "reshape_and_cache", "store")),
    ("norms / residual", ("rms", "norm", "add")),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "gelu", "act")),
    ("sampling / logits", ("softmax", "argmax", "topk", "sort", "sample", "logit", "max", "gather", "scatter")),
    ("copies / fills", ("copy", "fill", "memcpy", "memset", "cat", "index")),
)


def family(name: str) -> str:
    low = name.lower()
    for label, keys in FAMILIES:
        if any(k in low for k in keys):
            return label
    return "other"


def profiled_steps(llm: LLM, make_step, steps: int, trace: Path | None = None) -> dict:  # noqa: ANN001
    """Run ``make_step()`` (adds requests, returns nothing) then one ``step()``, ``steps`` times
    unprofiled (wall), ``steps`` times under cProfile (the host's Python) and ``steps`` times under
    the profiler (kernels, and the CUDA runtime calls the host made: a ``cudaMalloc`` or a stream
    sync inside a step stalls the GPU). The profilers slow the host, so the wall comes from the
    unprofiled steps. Returns per-step means. ``trace``: ``steps`` more under the profiler with
    Python stacks, its chrome trace written there and its GPU idle gaps (``bench/gpu_gaps.py``)
    returned as ``gaps`` (markdown lines; the stacks slow the host, so the gaps are longer than
    unprofiled: read them for where, not how long)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine

    def timed_step() -> float:
        make_step()
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        return time.perf_counter() - start

    timed_step()  # compiles / tunes whatever this shape reaches first
    walls = [timed_step() for _ in range(steps)]
    prof_py = cProfile.Profile()
    for _ in range(steps):
        make_step()
        sync()
        prof_py.enable()
        engine.step()
        sync()
        prof_py.disable()
    text = io.StringIO()
    pstats.Stats(prof_py, stream=text).sort_stats("tottime").print_stats(25)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            timed_step()
    events = prof.key_averages()
    kernels = [
        (e.key, e.self_device_time_total / steps, e.count // max(steps, 1))
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    ]
    runtime = [  # host-side CUDA runtime / driver calls
        (e.key, e.self_cpu_time_total / steps, e.count / steps)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith(("cuda", "cu"))
    ]
    gaps: list[str] = []
    if trace is not None:
        from bench.gpu_gaps import gaps_from_file

        with profile(activities=activities, with_stack=True) as prof_stacks:
            for _ in range(steps):
                timed_step()
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof_stacks.export_chrome_trace(str(trace))
        gaps = gaps_from_file(trace, steps)
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:  # tens of MB as text
            shutil.copyfileobj(raw, packed)
        trace.unlink()
    return {
        "wall_ms": 1e3 * sum(walls) / len(walls),
        "kernels": sorted(kernels, key=lambda k: -k[1]),
        "runtime": sorted(runtime, key=lambda k: -k[1]),
        "host_python": text.getvalue(),
        "gaps": gaps,
    }


def table(title: str, wall_ms: float, kernels: list[tuple[str, float, int]], result: dict) -> list[str]:
    busy = sum(k[1] for k in kernels) / 1e3
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us, calls in kernels:
        groups[family(name)][0] += us
        groups[family(name)][1] += calls
    lines = [
        f"## {title}",
        "",
        f"wall {wall_ms:.2f} ms/step, GPU kernel time {busy:.2f} ms/step "
        f"({100 * busy / max(wall_ms, 1e-9):.0f}% of wall), {sum(k[2] for k in kernels)} kernels/step",
        "",
        "| family | ms/step | share of GPU time | calls/step |",
        "|---|---|---|---|",
    ]
    for label, (us, calls) in sorted(groups.items(), key=lambda g: -g[1][0]):
        lines.append(f"| {label} | {us / 1e3:.2f} | {100 * us / 1e3 / max(busy, 1e-9):.0f}% | {calls} |")
    lines += ["", "| kernel | µs/step | calls/step |", "|---|---|---|"]
    lines += [f"| {name[:100]} | {us:.1f} | {calls} |" for name, us, calls in kernels[:30]]
    lines += ["", "CUDA runtime calls on the host (profiled steps):", "", "| call | host µs/step | calls/step |"]
    lines += ["|---|---|---|"] + [f"| {n} | {us:.1f} | {c:.1f} |" for n, us, c in result["runtime"][:12]]
    if result.get("gaps"):
        lines += ["", *result["gaps"]]
    lines += ["", "Host Python, cProfile by own time (per all profiled steps):", "", "```"]
    lines += [ln for ln in result["host_python"].splitlines() if ln.strip()][:40] + ["```"]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model (CPU smoke; numbers mean nothing)")
    parser.add_argument("--model", default="qwen2.5-14b", choices=("qwen2.5-14b", "qwen3-30b-a3b"))
    parser.add_argument("--ckpt", default="/tmp/qb", help="checkpoint folder (written first if missing)")
    parser.add_argument("--out", default="profile_step_out")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--decode", default="1,128", help="running decode sequences per measured shape")
    parser.add_argument("--prefills", type=int, default=4, help="new prompts per mixed step")
    parser.add_argument("--prefill-len", type=int, default=224, help="tokens per new prompt")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--piecewise",
        choices=("off", "on", "both"),
        default="off" if os.environ.get(PIECEWISE_GRAPHS_ENV) == "0" else "on",
        help=f"mixed steps through piecewise CUDA graphs ({PIECEWISE_GRAPHS_ENV}=1): off, on, or both engines "
        f"in turn (default: on, as the engine on CUDA, unless {PIECEWISE_GRAPHS_ENV}=0 is set)",
    )
    parser.add_argument("--piecewise-buckets", default="", help=f"{PIECEWISE_BUCKETS_ENV}: e.g. 256,512,1024,2048")
    args = parser.parse_args()

    moe = args.model == "qwen3-30b-a3b"
    shape = (SMALL_MOE if moe else SMALL) if args.small else (QWEN3_30B_A3B if moe else QWEN14B)
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").is_file():
        (write_random_moe_gptq if moe else write_random_gptq)(ckpt, shape)
    cuda = torch.cuda.is_available()
    if args.piecewise_buckets:
        os.environ[PIECEWISE_BUCKETS_ENV] = args.piecewise_buckets
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.piecewise]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Step profile: {'small' if args.small else ('Qwen3-30B-A3B' if moe else 'Qwen2.5-14B') + '-shaped GPTQ-4bit'}"
        f"{' (MoE)' if moe and args.small else ''}, "
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}",
        "",
        f"mixed step = the running decodes + {args.prefills} new prompts of {args.prefill_len} tokens "
        f"({args.prefills * args.prefill_len} prefill tokens, one chunk each); {args.steps} profiled steps per row; "
        f"piecewise = {PIECEWISE_GRAPHS_ENV}=1 (mixed steps through piecewise CUDA graphs)",
        "",
    ]
    summary = [
        "| step | piecewise | running decodes | prefill tokens | wall ms | GPU ms | GPU / wall |",
        "|---|---|---|---|---|---|---|",
    ]
    details: list[str] = []
    for piecewise in modes:
        os.environ[PIECEWISE_GRAPHS_ENV] = "1" if piecewise else "0"
        profile_engine(args, shape, ckpt, cuda, "on" if piecewise else "off", lines, summary, details, out)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    (out / "profile_step.md").write_text("\n".join(lines + summary + [""] + details) + "\n")


def profile_engine(args, shape, ckpt, cuda, label, lines, summary, details, out) -> None:  # noqa: ANN001
    """One engine (the current environment's piecewise setting): every ``--decode`` shape's pure
    decode and mixed step, appended to ``summary`` / ``details`` and written as it goes."""
    budget = args.budget if cuda else None
    llm = LLM(  # synchronous order: each timed step() is that step's own work
        str(ckpt),
        device="cuda" if cuda else "cpu",
        gpu_memory_budget=budget,
        max_model_len=4096,
        max_num_seqs=256,
        async_scheduling=False,
    )
    engine = llm.engine
    graphs = engine.runner.piecewise_graphs
    if graphs is not None:
        lines.append(
            f"piecewise graphs: token buckets {list(graphs.buckets)}, static buffers "
            f"{graphs.static_bytes / 2**20:.1f} MiB, pool growth at capture {graphs.capture_bytes / 2**20:.1f} MiB"
        )
        lines.append("")
    gen = torch.Generator().manual_seed(17)
    counter = iter(range(10**9))
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # finishes in its prefill step

    def add_prefills() -> None:
        for _ in range(args.prefills):
            ids = torch.randint(3, shape["vocab"], (args.prefill_len,), generator=gen).tolist()
            engine.add_request(f"mix-{next(counter)}", {"prompt_token_ids": ids}, once)

    for batch in (int(b) for b in args.decode.split(",")):
        start_decoding(llm, batch, 128, 4 * args.steps + 24, shape["vocab"], seed=batch, tag="prof")
        for kind, make in (("pure decode", lambda: None), ("mixed", add_prefills)):
            result = profiled_steps(llm, make, args.steps)
            wall, kernels = result["wall_ms"], result["kernels"]
            busy = sum(k[1] for k in kernels) / 1e3
            tokens = 0 if kind == "pure decode" else args.prefills * args.prefill_len
            summary.append(
                f"| {kind} | {label} | {batch} | {tokens} | {wall:.2f} | {busy:.2f} | {busy / max(wall, 1e-9):.2f} |"
            )
            title = f"{kind}, piecewise {label}, {batch} running decodes, {tokens} prefill tokens"
            details += table(title, wall, kernels, result)
            (out / "profile_step.md").write_text("\n".join(lines + summary + [""] + details) + "\n")
            print(summary[-1], flush=True)
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
