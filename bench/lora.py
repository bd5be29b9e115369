"""Multi-LoRA kernel benchmark: the grouped shrink + expand (``quant_kernels.lora_triton``) against
the PyTorch reference and against the bandwidth floor of the adapters' A/B reads.

Knows: Qwen2.5-14B's adapted layers (qkv 5120 -> 5120+1024+1024, o 5120 -> 5120, gate_up 5120 ->
2x13824, down 13824 -> 5120), rank 16 (issue 30's case), batches of decode rows spread over 1, 8 or
32 distinct adapters plus a prefill chunk, how to time (``triton.testing.do_bench``, median, L2
flushed) and the copy bandwidth of this card. Must not know: the engine. Every timed configuration is
first checked against the reference on fresh random data in the same run.

    PYTHONPATH=. python bench/lora.py --out $OUT/lora.md

Per layer and case: the shrink's K split (``split x columns``, ``lora_triton.shrink_config``'s
heuristic unless ``--split-k`` / ``--block-k`` override it: comma lists, every combination timed),
``triton`` µs (shrink + expand, one call of ``lora_ops.add_lora``, the Triton kernels) replayed from a
CUDA graph of ``GRAPH_CALLS`` calls (the kernels' own time, as a decode graph runs them), ``eager`` µs
(the same call launched from Python each time: the wrappers' host work included, which is what an
eager step pays; the H200 run of 2026-12-05 timed only this, ~140 µs in every case), ``reference`` µs
(the gather-based torch path, ``QSERVE_LORA_TRITON=0``), ``floor`` µs = bytes the kernels must move
(each distinct adapter's A and B once, x read, y read and written) / the measured copy bandwidth,
and ``floor / triton``, and ``expand alone`` µs: the expand by itself replayed from a graph (what a decode
step's critical path keeps when the shrink runs beside the base GEMM); for gate_up also ``expand + SiLU`` µs
(the expand, then ``silu_and_mul`` of its output) and ``fused SiLU`` µs (the two in one launch,
``lora_ops.expand_silu_and_mul``: what ``QSERVE_LORA_FUSED_SILU=1`` puts there). ``--cases 1x1,32x8``: only
those decode-graph cases (batch x adapters).
``--tiny`` is a CPU smoke run under ``TRITON_INTERPRET=1`` at
toy sizes (wall-clock times, meaningless as performance). Rows are written to ``--out`` as they come.

``--e2e`` (issue 30's targets): a Qwen2.5-14B-shaped random GPTQ checkpoint (``bench/e2e.py``'s) under
``--budget``, rank-16 random adapters on every projection of every layer (4 distinct files,
registered under up to 32 names: each name its own slot). Decode tok/s and ms per step of the base
model (CUDA graphs) at batch 1, 32 and 128, then, on one LoRA engine (``QSERVE_LORA_TRITON=1`` and
``QSERVE_LORA_GRAPHS=1``, 32 slots), batch 32 and 128 with 1, 8 and 32 distinct adapters and batch 1
with one (the latency with an adapter), each against the base at its batch; last, the same engine
with its graphs set aside (Triton eager) at batch 32 with 8 adapters. ``--overlap 0,shrink,pair``: one
LoRA engine per ``QSERVE_LORA_OVERLAP`` mode, the same rows each (``shrink``: each shrink on a side
stream beside its base GEMM; ``pair``: the expand too, its fp32 delta added after), the eager row
with the first; ``--side-split-k default,auto,8``: each overlapping mode once per side shrink's K split
(``QSERVE_LORA_SIDE_SPLIT_K``; ``default``, the default, leaves it unset: the engine's 4); ``--fused-silu 0,1``: each
of those engines without and with ``QSERVE_LORA_FUSED_SILU`` (gate_up's expand inside the SiLU-and-mul). ``--profile-dir DIR``: then
where a decode step's time goes (``bench/profile_step.py``'s per-kernel and per-family tables, the
host's CUDA calls and Python, the GPU's idle gaps with the launches that ended them) for the base and
for the LoRA engine at batch 32 with 8 adapters, ``--profile-steps`` steps each, into DIR
(``profile_base.md``, ``profile_lora.md``, ``profile_lora_overlap_{shrink,pair}.md``, their traces
gzipped). One base engine and one LoRA engine per overlap mode, not one per configuration: the whole
run fits ``--time-limit`` (200 s on the H200); a row that would start past it is skipped and says so. The table is rewritten after every row, so a run cut short still leaves
what it measured. With ``--e2e``, ``--cases`` keeps only those LoRA rows (and the base rows at their
batches), ``--skip-eager`` drops the eager row. ``--e2e --small`` checks the script on CPU (the reference path: no Triton there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # must precede the first @triton.jit definition
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import lora_ops, reference_lora  # noqa: E402

LAYERS = {  # name -> (K, output slices)
    "qkv": (5120, [5120, 1024, 1024]),
    "o": (5120, [5120]),
    "gate_up": (5120, [13824, 13824]),
    "down": (13824, [5120]),
}
RANK = 16
MAX_LORAS = 32
# (label, rows, distinct adapters, rows per sequence, graph tiles). Graph tiles: the indices padded to the
# tile count a decode graph with MAX_LORAS slots has (lora_ops.max_lora_tiles: the padding tiles' programs
# launch and exit), as the engine's decode steps run them; else exactly the step's tiles (eager, prefill).
CASES = [
    ("decode b1 x1", 1, 1, 1, True),
    ("decode b32 x1", 32, 1, 1, True),
    ("decode b32 x8", 32, 8, 1, True),
    ("decode b32 x8, exact tiles", 32, 8, 1, False),
    ("decode b32 x32", 32, 32, 1, True),
    ("decode b128 x8", 128, 8, 1, True),
    ("decode b128 x32", 128, 32, 1, True),
    ("prefill 2048 x4", 2048, 4, 512, False),
]
TINY_LAYERS = {"qkv": (64, [64, 16, 16]), "gate_up": (64, [48, 48]), "down": (96, [64])}
TINY_CASES = [("decode b4 x2", 4, 2, 1, True), ("prefill 40 x2", 40, 2, 20, False)]


def bench_us(fn, warmup: int = 10, rep: int = 50) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


GRAPH_CALLS = 20  # add_lora calls per captured graph: the replay's launch cost spread over them


def graph_us(fn) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of ``GRAPH_CALLS`` calls (no host work in
    the timing); ``bench_us`` off CUDA."""
    if DEVICE != "cuda":
        return bench_us(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile, allocator) off the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return bench_us(graph.replay) / GRAPH_CALLS


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (1 << (30 if DEVICE == "cuda" else 20),), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src), rep=100)
    return 2 * src.numel() / (t * 1e-6)


class Table:
    """A Markdown file rewritten after every row (a run cut short keeps what it measured)."""

    def __init__(self, path: str | None, head: list[str]) -> None:
        self.path = path
        self.lines = list(head)
        self.notes: list[str] = []
        self.flush()

    def add(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)
        self.flush()

    def note(self, line: str) -> None:
        self.notes.append(line)
        print(line, flush=True)
        self.flush()

    def flush(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                f.write(self.text())

    def text(self) -> str:
        return "\n".join(self.lines + ([""] + self.notes if self.notes else [])) + "\n"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``--cases``: ``"32x8,1x1"`` -> ``[(32, 8), (1, 1)]`` (batch, distinct adapters); anything else is refused,
    naming the entry."""
    out = []
    for entry in text.split(","):
        parts = entry.strip().split("x")
        if len(parts) != 2 or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--cases {entry!r}: expected BATCHxADAPTERS, e.g. 32x8")
        out.append((int(parts[0]), int(parts[1])))
    return out


def set_env(name: str, value: str | None) -> None:
    """An environment switch for the next cases (None: unset, the default)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def run_case(
    k: int,
    sizes: list[int],
    rows: int,
    distinct: int,
    per_seq: int,
    num_slots: int,
    dtype,
    bandwidth,
    split_k: int | None = None,
    block_k: int | None = None,
    graph_tiles: bool = False,
):
    from quant_kernels import lora_triton

    gen = torch.Generator().manual_seed(rows * 31 + distinct)
    n = sum(sizes)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)  # [T, K]
    y = torch.randn(rows, n, generator=gen).to(dtype).to(DEVICE)  # [T, N]
    lora_a = (torch.randn(num_slots, len(sizes) * RANK, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    lora_b = (torch.randn(num_slots, n, RANK, generator=gen) * 0.1).to(dtype).to(DEVICE)
    seqs = -(-rows // per_seq)
    slots = np.repeat(np.arange(seqs) % distinct, per_seq)[:rows].astype(np.int32)  # [T]
    starts = [0, *np.cumsum(sizes).tolist()]
    if graph_tiles:  # as a decode graph stages them: padded to its fixed tile count (cuda_graphs.py)
        num_tiles = lora_ops.max_lora_tiles(rows, num_slots)
        host = np.zeros(lora_ops.index_layout(rows, num_tiles)[0], dtype=np.int32)
        lora_ops.fill_index_buffer(host, slots, rows, num_tiles)
        indices = lora_ops.indices_from_buffer(torch.from_numpy(host).to(DEVICE), rows, num_tiles)
    else:
        indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 132
    config = lora_triton.shrink_config(k, rows, tiles[1].numel(), len(sizes), num_sms, split_k, block_k)
    h = torch.empty(rows, lora_a.shape[1], dtype=dtype, device=DEVICE)
    want = reference_lora.lora_expand(
        y.clone(),
        reference_lora.lora_shrink(x, lora_a, indices.token_slots, h.clone()),
        lora_b,
        indices.token_slots,
        starts,
    )
    knobs = {"split_k": split_k, "block_k": block_k}
    os.environ[lora_ops.TRITON_ENV] = "1"
    got = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices, **knobs)
    if DEVICE == "cpu":  # the interpreter path: call the kernels' wrappers directly, as add_lora does on CUDA
        workspace = torch.empty(config.split_k, *h.shape, dtype=torch.float32)  # [split_k, T, S * R]
        lora_triton.lora_shrink(x, lora_a, *tiles, len(sizes), h, config, workspace, indices.tile_counters)
        block_n = lora_ops.expand_block_n(tiles[1].numel(), tuple(starts))  # the block add_lora takes on CUDA
        got = lora_triton.lora_expand(y.clone(), h, lora_b, *tiles, starts, block_n)
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error < 3e-2, f"kernel differs from the reference by {error:.2e} (relative)"
    eager_us = bench_us(lambda: lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices, **knobs))
    triton_us = graph_us(lambda: lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices, **knobs))
    # the expand alone (what a decode step's critical path keeps with the shrink on the side stream)
    h_in = reference_lora.lora_shrink(x, lora_a, indices.token_slots, h.clone())
    expand_us = graph_us(lambda: lora_ops.lora_expand(y, h_in, lora_b, starts, indices))
    silu_us = fused_us = None
    if len(sizes) == 2 and sizes[0] == sizes[1]:  # a gate_up: its expand + SiLU-and-mul, and the fused launch
        from quant_kernels import elementwise_ops

        silu_us = graph_us(lambda: elementwise_ops.silu_and_mul(lora_ops.lora_expand(y, h_in, lora_b, starts, indices)))
        fused_us = graph_us(lambda: lora_ops.expand_silu_and_mul(y, h_in, lora_b, starts, indices))
    os.environ[lora_ops.TRITON_ENV] = "0"
    reference_us = bench_us(lambda: lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices))
    elem = x.element_size()
    moved = distinct * (lora_a[0].numel() + lora_b[0].numel()) * elem + rows * (k + 2 * n) * elem
    floor_us = moved / bandwidth * 1e6
    return {
        "triton_us": triton_us,
        "expand_us": expand_us,
        "expand_silu_us": silu_us,
        "fused_silu_us": fused_us,
        "eager_us": eager_us,
        "reference_us": reference_us,
        "floor_us": floor_us,
        "error": error,
        "split_k": config.split_k,
        "tiles": tiles[1].numel(),
        "k_per_split": config.k_per_split,
        "block_k": config.block_k,
    }


def e2e(args: argparse.Namespace) -> Table:
    """Engine decode throughput with adapters vs the base model (see the module doc)."""
    import gc
    from pathlib import Path

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import e2e as e2e_bench  # bench/e2e.py: the random 14B-shaped checkpoint

    from qserve import LLM, LoRARequest, SamplingParams
    from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter

    t0 = time.perf_counter()
    shape = e2e_bench.SMALL if args.small else e2e_bench.QWEN14B
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (reference path)"
    table = Table(
        args.out,
        [
            f"# LoRA decode, rank {RANK} on every projection, {'small shape' if args.small else 'Qwen2.5-14B-shaped GPTQ'}, {device}",
            "",
            "| engine | batch | adapters | decode tok/s | ms / step | vs base |",
            "|---|---:|---:|---:|---:|---:|",
        ],
    )
    tmp = Path(args.tmp)
    ckpt = tmp / ("small-gptq" if args.small else "qwen14b-gptq")
    if not (ckpt / "config.json").is_file():
        e2e_bench.write_random_gptq(ckpt, shape)
    h, d = shape["hidden"], 128 if shape["hidden"] >= 1024 else shape["hidden"] // shape["heads"]
    shapes = projection_shapes(h, shape["inter"], shape["heads"], shape["kv_heads"], d)
    projections = tuple(shapes)
    files = []
    for i in range(4):
        path = tmp / f"lora-r{RANK}-{i}"
        if not (path / "adapter_config.json").is_file():
            write_peft_adapter(
                path, shapes, shape["layers"], targets=projections, rank=RANK, alpha=32, seed=i, std=0.01
            )
        files.append(str(path))
    table.note(f"- checkpoint and adapters ready at {time.perf_counter() - t0:.0f} s")
    names = [LoRARequest(f"a{i}", i + 1, files[i % 4]) for i in range(MAX_LORAS)]
    budget = args.budget if DEVICE == "cuda" else None
    steps = 4 if args.small else 32
    big = 4 if args.small else 128  # the largest batch (max_num_seqs: fewer graph buckets to capture)
    mid = 2 if args.small else 32
    base_ms: dict[int, float] = {}

    def start_decoding(llm: LLM, tag: str, batch: int, distinct: int, max_tokens: int, seed: int) -> None:
        """``batch`` random 128-token prompts over ``distinct`` adapters (0: the base), stepped until each
        has its first token: the steps that follow are pure decode."""
        engine = llm.engine
        gen = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(batch):
            ids = torch.randint(3, shape["vocab"], (128,), generator=gen).tolist()
            lora = names[i % distinct] if distinct else None
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params, lora_request=lora)
        while any(not seq.request.output_token_ids for _, seq in engine._sequences.values()):  # noqa: SLF001
            engine.step()

    def decode(llm: LLM, batch: int, distinct: int) -> float:
        """Seconds per decode step of ``batch`` sequences over ``distinct`` adapters (0: the base)."""
        engine = llm.engine
        start_decoding(llm, f"d{batch}-{distinct}", batch, distinct, steps + 2, seed=batch)
        e2e_bench.sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        e2e_bench.sync()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed / steps

    def measure(label: str, llm: LLM, batch: int, distinct: int) -> None:
        if time.perf_counter() - t0 > args.time_limit:
            table.add(f"| {label} | {batch} | {distinct} | skipped: past --time-limit {args.time_limit:.0f} s | | |")
            return
        seconds = decode(llm, batch, distinct)
        if not distinct:
            base_ms[batch] = seconds * 1e3
        ratio = f"{base_ms[batch] / (seconds * 1e3):.2f}x" if distinct and batch in base_ms else ""
        table.add(f"| {label} | {batch} | {distinct} | {batch / seconds:.0f} | {seconds * 1e3:.2f} | {ratio} |")

    def build(label: str, **kwargs) -> LLM:
        started = time.perf_counter()
        llm = LLM(str(ckpt), device=DEVICE, gpu_memory_budget=budget, max_model_len=4096, max_num_seqs=big, **kwargs)
        plan = llm.engine.memory_plan
        described = "" if plan is None else ": plan " + plan.describe().replace("\n", "; ")
        table.note(f"- {label} built in {time.perf_counter() - started:.0f} s{described}")
        return llm

    def release() -> None:
        """Free the engine the caller has just dropped (``del llm`` there: a ``del`` of a parameter
        here left the caller's reference, and the next engine planned around 23 GiB of a dead
        one's memory: "weights 32.46 GiB" on the H200, 2026-12-05)."""
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    def profile(name: str, llm: LLM, batch: int, distinct: int) -> None:
        """Where a decode step of ``batch`` sequences over ``distinct`` adapters goes (``--profile-dir``)."""
        if not args.profile_dir:
            return
        if time.perf_counter() - t0 > args.time_limit:
            table.note(f"- profile {name}: skipped, past --time-limit {args.time_limit:.0f} s")
            return
        import profile_step  # bench/profile_step.py

        engine, steps_each = llm.engine, args.profile_steps
        start_decoding(llm, f"p{name}", batch, distinct, 5 * steps_each + 8, seed=batch + 1)
        out = Path(args.profile_dir)
        result = profile_step.profiled_steps(llm, lambda: None, steps_each, trace=out / f"trace_{name}.json")
        title = f"{name}, decode, batch {batch}, {distinct} distinct adapters"
        lines = profile_step.table(title, result["wall_ms"], result["kernels"], result)
        (out / f"profile_{name}.md").write_text("\n".join(lines) + "\n")
        table.note(f"- profile {name}: wall {result['wall_ms']:.2f} ms/step, written to {out}/profile_{name}.md")
        while engine.has_unfinished_requests():
            engine.step()

    def measure_eager(label: str, llm: LLM, batch: int, distinct: int) -> None:
        """The same engine decoding without its graphs. A function of its own so that no local of the
        caller keeps the runner (and through it the engine) alive after ``del llm``: the next engine
        planned around the dead one's memory ("weights (32.00 GiB)", H100, 2026-12-07)."""
        runner = llm.engine.runner
        graphs, runner.decode_graphs = runner.decode_graphs, None
        try:
            measure(label, llm, batch, distinct)
        finally:
            runner.decode_graphs = graphs

    # --cases: the LoRA engines' (batch, adapters) rows, e.g. "32x8,1x1" (default: all seven below)
    every = ((mid, 8), (mid, 1), (mid, MAX_LORAS), (big, 8), (big, 1), (big, MAX_LORAS), (1, 1))
    scale = {32: mid, 128: big}  # the full-size batches stand for --small's
    lora_rows = [(scale.get(b, b), a) for b, a in parse_cases(args.cases)] if args.cases else every
    llm = build("base, CUDA graphs")
    for batch in sorted({b for b, _ in lora_rows}, key=lambda b: (b == 1, b)):
        measure("base, CUDA graphs", llm, batch, 0)
    profile("base", llm, mid, 0)
    del llm
    release()
    os.environ[lora_ops.TRITON_ENV] = "1"
    os.environ["QSERVE_LORA_GRAPHS"] = "1"
    # --overlap: one LoRA engine per QSERVE_LORA_OVERLAP mode, in the order given
    variants = args.overlap.split(",")  # checked by main()
    # --side-split-k: each overlapping mode once per side-stream shrink split (QSERVE_LORA_SIDE_SPLIT_K)
    # ("default": QSERVE_LORA_SIDE_SPLIT_K unset, the engine's DEFAULT_SIDE_SPLIT_K)
    splits = args.side_split_k.split(",")
    # --fused-silu: each of those engines once per QSERVE_LORA_FUSED_SILU value (gate_up's expand in the SiLU)
    fused_values = args.fused_silu.split(",")  # checked by main()
    engines = [
        (o, split, fused) for o in variants for split in (["default"] if o == "0" else splits) for fused in fused_values
    ]
    for overlap, side_split, fused in engines:
        os.environ[lora_ops.FUSED_SILU_ENV] = fused
        os.environ[lora_ops.OVERLAP_ENV] = overlap
        if side_split == "default":
            os.environ.pop(lora_ops.SIDE_SPLIT_K_ENV, None)
        else:
            os.environ[lora_ops.SIDE_SPLIT_K_ENV] = side_split
        shown = f"{lora_ops.DEFAULT_SIDE_SPLIT_K} (default)" if side_split == "default" else side_split
        label = "LoRA, triton + graphs" + (f" + overlap {overlap}" if overlap != "0" else "")
        label += f", side split {shown}" if overlap != "0" else ""
        label += ", fused SiLU" if fused == "1" else ""
        llm = build(label, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=RANK)
        for batch, distinct in lora_rows:
            measure(label, llm, batch, min(distinct, batch))
        name = (
            "lora"
            if overlap == "0"
            else f"lora_overlap_{overlap}" + ("" if side_split == "default" else f"_split{side_split}")
        ) + ("_fused_silu" if fused == "1" else "")
        profile(name, llm, mid, min(8, mid))
        if (overlap, side_split, fused) == engines[0] and not args.skip_eager:
            measure_eager("LoRA, triton eager", llm, mid, min(8, mid))
        del llm
        release()
    os.environ.pop(lora_ops.OVERLAP_ENV, None)
    os.environ.pop(lora_ops.SIDE_SPLIT_K_ENV, None)
    os.environ.pop(lora_ops.FUSED_SILU_ENV, None)
    table.note(f"- total {time.perf_counter() - t0:.0f} s")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the table (Markdown) and the raw JSON beside it")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--split-k", default="", help="comma list of shrink K splits to time (default: heuristic)")
    parser.add_argument(
        "--expand-block-n",
        default="",
        help="comma list of QSERVE_LORA_EXPAND_BLOCK_N values to time (64, 128, 256, auto; default: unset, auto)",
    )
    parser.add_argument("--block-k", default="", help="comma list of shrink K blocks to time (default: heuristic)")
    parser.add_argument("--e2e", action="store_true", help="engine decode throughput with adapters (issue 30)")
    parser.add_argument("--small", action="store_true", help="--e2e on a tiny shape (CPU check of the script)")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--tmp", default="/tmp/qserve-bench")
    parser.add_argument("--time-limit", type=float, default=180.0, help="--e2e: start no row after this (s)")
    parser.add_argument(
        "--cases",
        default="",
        help="the rows as BATCHxADAPTERS, comma-separated (default: all); the kernel table keeps those decode-graph cases",
    )
    parser.add_argument("--skip-eager", action="store_true", help="--e2e: no eager row")
    parser.add_argument("--profile-dir", default=None, help="--e2e: profile batch 32 x 8 adapters and the base there")
    parser.add_argument("--profile-steps", type=int, default=4, help="--profile-dir: profiled steps per kind")
    parser.add_argument(
        "--overlap",
        default="0",
        help="--e2e: comma list of QSERVE_LORA_OVERLAP modes (0, shrink, pair), one LoRA engine each",
    )
    parser.add_argument(
        "--fused-silu",
        default="0",
        help="--e2e: comma list of QSERVE_LORA_FUSED_SILU values (0, 1: gate_up's expand inside the SiLU-and-mul), "
        "one LoRA engine each per overlap mode and side split",
    )
    parser.add_argument(
        "--side-split-k",
        default="default",
        help="--e2e: comma list of QSERVE_LORA_SIDE_SPLIT_K values (default: unset, the engine's 4; auto: the "
        "heuristic; 1..32), one engine each per overlapping mode",
    )
    args = parser.parse_args()
    try:
        wanted = set(parse_cases(args.cases)) if args.cases else None
    except ValueError as error:
        parser.error(str(error))
    for value in args.side_split_k.split(","):
        try:
            if value != "default":
                lora_ops.parse_side_split_k(value)
        except ValueError as error:
            parser.error(f"--side-split-k: {error}")
    if not set(args.fused_silu.split(",")) <= {"0", "1"}:
        parser.error(f"--fused-silu {args.fused_silu}: expected a comma list of 0 and 1")
    unknown = [mode for mode in args.overlap.split(",") if mode not in lora_ops.OVERLAP_MODES]
    if unknown:
        parser.error(f"--overlap {','.join(unknown)}: expected a comma list of {', '.join(lora_ops.OVERLAP_MODES)}")
    if args.e2e:
        print(e2e(args).text())
        return
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    tiny = args.tiny or DEVICE == "cpu"
    layers, cases = (TINY_LAYERS, TINY_CASES) if tiny else (LAYERS, CASES)
    if wanted is not None:  # those decode cases, with a decode graph's padded tiles
        known = [f"{c[1]}x{c[2]}" for c in cases if c[4]]
        cases = [c for c in cases if (c[1], c[2]) in wanted and c[4]]
        if not cases:
            parser.error(f"--cases {args.cases}: none of this run's decode-graph cases ({', '.join(known)})")
    splits = [int(v) for v in args.split_k.split(",") if v] or [None]
    expand_ns = [v for v in args.expand_block_n.split(",") if v] or [None]
    blocks = [int(v) for v in args.block_k.split(",") if v] or [None]
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (interpreter)"
    table = Table(
        args.out,
        [
            f"# LoRA shrink + expand, rank {RANK}, {args.dtype}, {device}; copy bandwidth {bandwidth / 1e9:.0f} GB/s",
            "",
            "| layer | case | split x columns | expand | triton µs (graph) | expand alone µs (graph) | expand + SiLU µs (graph) "
            "| fused SiLU µs (graph) | triton µs (eager) | reference µs | floor µs | floor / triton |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ],
    )
    raw = []

    def shown(us: float | None) -> str:
        return "" if us is None else f"{us:.1f}"

    for name, (k, sizes) in layers.items():
        for label, rows, distinct, per_seq, graph_tiles in cases:
            for split_k, block_k, expand_n in itertools.product(splits, blocks, expand_ns):
                set_env(lora_ops.EXPAND_BLOCK_N_ENV, expand_n)
                expand_label = f"tiles {expand_n or 'auto'}"
                result = run_case(
                    k, sizes, rows, distinct, per_seq, max(distinct, 2 if tiny else MAX_LORAS), dtype,
                    bandwidth, split_k, block_k, graph_tiles,
                )  # fmt: skip
                raw.append({"layer": name, "case": label, "expand": expand_label} | result)
                table.add(
                    f"| {name} | {label} ({result['tiles']} tiles) | {result['split_k']} x {result['k_per_split']} | "
                    f"{expand_label} | "
                    f"{result['triton_us']:.1f} | {result['expand_us']:.1f} | {shown(result['expand_silu_us'])} | "
                    f"{shown(result['fused_silu_us'])} | {result['eager_us']:.1f} | "
                    f"{result['reference_us']:.1f} | "
                    f"{result['floor_us']:.1f} | {result['floor_us'] / result['triton_us']:.2f} |"
                )
    set_env(lora_ops.EXPAND_BLOCK_N_ENV, None)
    print(table.text())
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
