"""W4A16 kernel benchmark: the MMA-operand kernel vs cuBLAS fp16, GemLite, tinygemm.

Knows: Qwen2.5-14B linear shapes, how to time (CUDA-graph replay of 8 calls on 8 weight copies,
``triton.testing.do_bench`` median), the int4 bandwidth floor (bytes that must move / copy
bandwidth measured in this run). Must not know: anything of the engine. Every configuration it
times is first checked against the reference on fresh random data (NaN-poisoned output,
relative error bound), in the same run.

    PYTHONPATH=. python bench/kernels.py --sweep --out $OUT/kernels.md

``--sweep`` times every candidate config of the MMA kernel per (shape, M) and reports the
fastest (the table the dispatch defaults come from) beside the built-in dispatch; without it
only the built-in dispatch (``select_config``) is timed. Peers: cuBLAS fp16 on the dense weight
(``x @ W``), GemLite (``gemlite``, its H100 config, if installed) and torch's tinygemm
(M <= 256). ``--ptx`` also compiles the kernel for sm90 and sm86 on this machine's Triton
and counts shared-memory stores in the PTX. ``--jobs N`` compiles every kernel variant the run will
time in N processes first (Triton's on-disk cache), so a whole sweep fits one device call.

``--ampere-proxy`` times the code the users' cards run (3090 / A10G: sm86; 4090: sm89) on this
Hopper card: Triton's ``DISABLE_MMA_V3=1`` makes an sm90 compile emit ``mma.sync`` instead of
wgmma, the weights take the Ampere/Ada MMA-operand layout (``mma_kwidth((8, 6))``) and every
launch is fitted to sm86's 99 KB of shared memory per block (``fit_shared``). The PTX is then the
sm86 compile's line for line (tests/kernels/test_w4a16_ptx.py checks it), so the sweep ranks tile
configs of that code path; the card is not an Ampere card (132 SMs, 4.8 TB/s, wgmma cuBLAS as the
baseline): a proxy for the dispatch table, not for the users' speeds. It runs in a Triton cache
of its own (the variable is not part of Triton's cache key).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import device as kdevice  # noqa: E402
from quant_kernels import reference  # noqa: E402
from quant_kernels import w4a16_mma_triton as mma  # noqa: E402
from quant_kernels.layout import PackedQuantWeight, pack_codes  # noqa: E402
from quant_kernels.repack import mma_kwidth  # noqa: E402

AMPERE_PROXY_ENV = "QSERVE_BENCH_AMPERE_PROXY"  # set by --ampere-proxy for this process and its compile workers
SM86_MAX_SHARED = 99 * 1024  # shared memory one block may use on sm86 / sm89


def ampere_proxy() -> bool:
    return os.environ.get(AMPERE_PROXY_ENV) == "1"


def enter_ampere_proxy() -> None:
    """mma.sync code, the Ampere operand layout and sm86's shared-memory limit from here on (call
    before the first compile; the compile workers inherit the environment and call it again)."""
    import tempfile

    os.environ[AMPERE_PROXY_ENV] = "1"
    os.environ["DISABLE_MMA_V3"] = "1"  # read by Triton's AccelerateMatmul pass at each compile
    if "QSERVE_BENCH_PROXY_CACHE" not in os.environ:  # not in Triton's cache key: a cache of its own
        os.environ["QSERVE_BENCH_PROXY_CACHE"] = tempfile.mkdtemp(prefix="triton-ampere-proxy-")
    os.environ["TRITON_CACHE_DIR"] = os.environ["QSERVE_BENCH_PROXY_CACHE"]
    kdevice.max_shared = lambda device: SM86_MAX_SHARED  # w4a16_gemm fits every launch to it


def prepare_weight(weight: PackedQuantWeight) -> mma.MmaQuantWeight:
    """The load-time shuffle into this card's MMA-operand order (the Ampere one under the proxy)."""
    return mma.prepare(weight, kwidth=mma_kwidth((8, 6)) if ampere_proxy() else None)


SHAPES = {  # name: (K, N) of Qwen2.5-14B
    "qkv": (5120, 7168),
    "o": (5120, 5120),
    "gate_up": (5120, 27648),
    "down": (13824, 5120),
    # Qwen3-30B-A3B's attention projections (issue 32: at batch 1 they were 6.1 µs a launch, 96 a step)
    "a3b_qkv": (2048, 5120),
    "a3b_o": (4096, 2048),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
GROUP = 128
REL_TOL = 1e-2  # fp16 output vs the reference: measured ~3e-4
GRAPH_LAYERS = 8  # distinct weight copies per graph: together far larger than the 50 MB L2
COPIES_BYTES = 200e6  # a shape's copies together at least this (four L2s): the small layers get more


def graph_copies(k: int, n: int) -> int:
    """Distinct 4-bit weight copies a graph cycles through: ``GRAPH_LAYERS``, or more where that many would
    sit in L2 (Qwen3-30B-A3B's 5 MB projections: 40, as its 48 layers never stay there)."""
    return max(GRAPH_LAYERS, math.ceil(COPIES_BYTES / (k * n / 2)))


def bench_us(fn, warmup: int = 10, rep: int = 25) -> float:
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")  # [1 GiB]
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src), rep=100)
    return 2 * (1 << 30) / (t * 1e-6)


def graph_us(calls: list, rep: int = 50, repeats: int = 3) -> float:
    """Per-call µs of a CUDA graph that runs ``calls`` back to back, as a decode step does: no
    Python launch cost inside the timing, and every call on its own weight copy so nothing is
    served from L2."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile / warm outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    t = statistics.median(bench_us(graph.replay, rep=rep) for _ in range(repeats)) / len(calls)
    del graph
    return t


def check(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_weight(k: int, n: int, group: int) -> tuple[PackedQuantWeight, torch.Tensor]:
    codes = torch.randint(0, 16, (k, n), dtype=torch.int32, device="cuda")  # [K, N]
    scales = (torch.rand(k // group, n, device="cuda") * 0.02 + 0.005).half()  # [K/G, N]
    return PackedQuantWeight(4, group, pack_codes(codes, 4), scales), codes


def make_tinygemm(codes: torch.Tensor, weight: PackedQuantWeight):
    """torch's tinygemm int4 (bf16 activations) for the same codes; None if it does not run here."""
    try:
        w_nk = codes.t().contiguous()  # [N, K]
        packed_u8 = (w_nk[:, ::2] << 4 | w_nk[:, 1::2]).to(torch.uint8)  # [N, K/2]
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
        scales = weight.scales.to(torch.bfloat16)  # [K/G, N]
        scale_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=2).contiguous()  # [K/G, N, 2]

        def run(x: torch.Tensor) -> torch.Tensor:
            return torch._weight_int4pack_mm(x, packed, weight.group_size, scale_zeros)

        run(torch.randn(2, weight.in_features, dtype=torch.bfloat16, device="cuda"))
        return run
    except Exception as exc:  # noqa: BLE001 - reported as n/a
        print(f"tinygemm unavailable: {type(exc).__name__}: {exc}", flush=True)
        return None


def make_gemlite(codes: torch.Tensor, weight: PackedQuantWeight):
    """GemLite 0.6 (Triton) A16W4 layer for the same codes and scales; None if not installed."""
    try:
        from gemlite import DType, GemLiteLinearTriton
    except ImportError:
        return None
    k, n = codes.shape
    layer = GemLiteLinearTriton(4, weight.group_size, k, n, DType.FP16, DType.FP16)
    scales = weight.scales.t().contiguous()  # [N, K/G]
    zeros = torch.full_like(scales, 8.0)  # symmetric: W = (q - 8) * s
    layer.pack(codes.t().contiguous().to(torch.uint8), scales, zeros, bias=None)  # W_q [N, K]
    return layer


def load_gemlite_config() -> str:
    try:
        import gemlite
    except ImportError:
        return "not installed"
    path = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    ok = gemlite.load_config(path)
    return f"gemlite {gemlite.__version__}, config {os.path.basename(path)} loaded={ok}"


def time_candidate(fn_one, calls, ref, m, n) -> tuple[float | None, float]:
    """(µs, rel err) of one candidate: checked on a poisoned buffer first, then graph-timed."""
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")  # poisoned
    fn_one(out)
    err = check(out, ref)
    out2 = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    fn_one(out2)  # second call: split-K counters must be back at zero
    err = max(err, check(out2, ref))
    if err > REL_TOL:
        return None, err
    return graph_us(calls, rep=20, repeats=1), err


def bench_shape(name, ms, sweep, bw, rows, sweep_log, t_start, budget_s, peers, sweep_ms=None, pdl=False) -> None:
    k, n = SHAPES[name]
    weight, codes = make_weight(k, n, GROUP)
    dense = reference.dequantize(weight, torch.float16)  # [K, N]
    layers = graph_copies(k, n)
    denses = [dense] + [dense.clone() for _ in range(layers - 1)]
    tinys = [make_tinygemm(codes, weight) for _ in range(layers)] if "tiny" in peers else [None]
    tinys = tinys if all(t is not None for t in tinys) else None
    gems = [make_gemlite(codes, weight) for _ in range(layers)] if "gemlite" in peers else [None]
    gems = gems if all(g is not None for g in gems) else None
    new_w = prepare_weight(weight)  # load-time shuffle into the MMA-operand order
    copies = [new_w] + [
        dataclasses.replace(new_w, qweight=new_w.qweight.clone(), scales=new_w.scales.clone())
        for _ in range(layers - 1)
    ]
    counters = [torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda") for _ in range(layers)]
    del codes
    for m in ms:
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")  # [M, K] fresh per M
        ref = x @ dense  # cuBLAS fp16 on the dequantized weight: the baseline and the reference
        t_cublas = graph_us([lambda x=x, d=d: x @ d for d in denses])
        row = {"shape": name, "K": k, "N": n, "M": m, "cublas_us": t_cublas}
        if tinys is not None and m <= 256:
            xb = x.bfloat16()
            try:
                row["tiny_us"] = graph_us([lambda xb=xb, f=f: f(xb) for f in tinys])
            except Exception as exc:  # noqa: BLE001
                print(f"tinygemm failed at M={m}: {exc}", flush=True)
        if gems is not None:
            try:
                err = check(gems[0](x), ref)
                row["gemlite_err"] = err
                if err <= REL_TOL:
                    row["gemlite_us"] = graph_us([lambda x=x, g=g: g(x) for g in gems])
                else:
                    print(f"  WRONG gemlite {name} M={m}: rel err {err:.2e}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"gemlite failed at M={m}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)

        default = mma.select_config(new_w, torch.float16, m)
        cfgs = [default]
        if sweep and (sweep_ms is None or m in sweep_ms) and time.time() - t_start < budget_s:
            cfgs += [c for c in mma.candidate_configs(m, k, n, GROUP) if c != default]
        timed = []
        for cfg in cfgs:
            calls = [
                lambda w=w, c=c, cfg=cfg, x=x: mma.w4a16_gemm(x, w, None, cfg, c) for w, c in zip(copies, counters)
            ]
            try:
                t, err = time_candidate(
                    lambda out, cfg=cfg, x=x: mma.w4a16_gemm(x, new_w, None, cfg, counters[0], out=out),
                    calls,
                    ref,
                    m,
                    n,
                )
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                print(f"  {name} M={m} {cfg.short()}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            sweep_log.append({"shape": name, "m": m, "cfg": cfg.short(), "cfg_repr": repr(cfg), "us": t, "err": err})
            if t is None:
                print(f"  WRONG {name} M={m} {cfg.short()}: rel err {err:.2e}", flush=True)
                if cfg == default:  # the dispatch itself is wrong: the run will end non-zero
                    row["default_wrong"] = True
                continue
            timed.append((t, cfg, err))
        if not timed:  # reported, not fatal: the other rows still get measured
            print(f"  NO CORRECT CONFIG {name} M={m}: row skipped", flush=True)
            rows.append({**row, "no_correct_config": True})
            continue
        timed.sort(key=lambda r: r[0])
        retimed = []
        for _, cfg, err in timed[:3]:  # re-time the 3 fastest as carefully as the baselines
            calls = [
                lambda w=w, c=c, cfg=cfg, x=x: mma.w4a16_gemm(x, w, None, cfg, c) for w, c in zip(copies, counters)
            ]
            retimed.append((graph_us(calls), cfg, err))
        best = min(retimed, key=lambda r: r[0])
        default_t = next((t for t, c, _ in retimed if c == default), None)
        if default_t is None and not row.get("default_wrong"):
            calls = [
                lambda w=w, c=c, x=x, d=default: mma.w4a16_gemm(x, w, None, d, c) for w, c in zip(copies, counters)
            ]
            default_t = graph_us(calls)
        if pdl and not row.get("default_wrong"):  # the default again, every launch with PDL (sm90)
            calls = [
                lambda w=w, c=c, x=x, d=default: mma.w4a16_gemm(x, w, None, d, c, pdl=True)
                for w, c in zip(copies, counters)
            ]
            t_pdl, err_pdl = time_candidate(
                lambda out, x=x, d=default: mma.w4a16_gemm(x, new_w, None, d, counters[0], out=out, pdl=True),
                calls,
                ref,
                m,
                n,
            )
            if t_pdl is None:
                print(f"  WRONG {name} M={m} default with PDL: rel err {err_pdl:.2e}", flush=True)
                row["default_wrong"] = True
            else:
                row["pdl_us"] = graph_us(calls)
        floor_bytes = k * n // 2 + (k // GROUP) * n * 2 + m * k * 2 + m * n * 2
        row.update(
            us=best[0],
            cfg=best[1].short(),
            cfg_repr=repr(best[1]),
            err=best[2],
            default_us=default_t,
            default_cfg=default.short(),
            floor_us=floor_bytes / bw * 1e6,
        )
        rows.append(row)

        def ratio(key: str, over: str = "us", row: dict = row) -> str:
            return f"{row[key] / row[over]:.2f}x" if row.get(key) else "n/a"

        pdl_note = f"dflt+PDL {row['pdl_us']:.1f}us ({ratio('cublas_us', 'pdl_us')})" if row.get("pdl_us") else ""
        print(
            f"{name:8s} M={m:5d} new {best[0]:8.1f}us [{best[1].short()}] "
            f"dflt {f'{default_t:8.1f}us' if default_t else '   WRONG'}  "
            f"cuBLAS {t_cublas:8.1f}us ({ratio('cublas_us')})  gemlite {ratio('gemlite_us')}  "
            f"tiny {ratio('tiny_us')}  floor {100 * row['floor_us'] / best[0]:5.1f}%  err {best[2]:.1e}  "
            f"{pdl_note}"
            f"({time.time() - t_start:.0f}s)",
            flush=True,
        )


def _compile_worker(tasks: list[tuple[int, int, int, mma.MmaConfig]]) -> int:
    """Run each (K, N, M, config) once on random data so Triton compiles it into its on-disk cache."""
    if ampere_proxy():
        enter_ampere_proxy()
    torch.cuda.init()
    done = 0
    made: dict[tuple[int, int], tuple] = {}
    for k, n, m, cfg in tasks:
        if (k, n) not in made:
            weight, _ = make_weight(k, n, GROUP)
            made[(k, n)] = (
                prepare_weight(weight),
                torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda"),
            )
        w, counters = made[(k, n)]
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")  # [M, K]
        try:
            mma.w4a16_gemm(x, w, None, cfg, counters)
            done += 1
        except Exception as exc:  # noqa: BLE001 - the timing pass reports it
            print(f"precompile {cfg.short()}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(jobs: int, shapes: list[str], ms: list[int], sweep: bool, sweep_ms: set[int] | None) -> float:
    """Compile every kernel variant the run will time, in ``jobs`` processes (one compile per
    distinct specialization: sizes do not matter, all shapes share K/N divisibility), so the
    timing pass finds them in Triton's cache. Returns the seconds it took."""
    import multiprocessing as mp

    t0 = time.time()
    seen: set = set()
    tasks: list = []
    for name in shapes:
        k, n = SHAPES[name]
        for m in ms:
            cfgs = [mma.default_config(m, k, n, GROUP)]
            if sweep and (sweep_ms is None or m in sweep_ms):
                cfgs += mma.candidate_configs(m, k, n, GROUP)
            for cfg in cfgs:
                cfg = mma._fix(cfg, m, k, n, GROUP)
                key = dataclasses.replace(cfg, split_k=min(cfg.split_k, 2)) if cfg.kind == "mma" else "dequant"
                if key in seen:
                    continue
                seen.add(key)
                tasks.append((k, n, m, cfg))
    tasks.sort(key=lambda t: (t[0], t[1]))  # few distinct shapes per worker: few random weights
    batches = [tasks[i::jobs] for i in range(jobs)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        n_done = sum(pool.map(_compile_worker, [b for b in batches if b]))
    print(f"precompiled {n_done}/{len(tasks)} variants in {time.time() - t0:.0f}s with {jobs} processes", flush=True)
    return time.time() - t0


def ptx_counts() -> list[dict]:
    """st.shared / wgmma / mma.sync counts of the kernel's PTX for sm90 and sm86 (this Triton)."""
    import re

    out = []
    for arch in (90, 86):
        for cfg in (mma.MmaConfig(block_m=16, block_n=128, block_k=128),):
            for ng, asym, perm in ((1, False, False), (2, True, True)):
                ptx = mma.compile_ptx(arch, cfg, group_tile=ng, asym=asym, act_order=perm)
                out.append(
                    {
                        "arch": arch,
                        "cfg": cfg.short(),
                        "ng": ng,
                        "asym": asym,
                        "perm": perm,
                        "st.shared": len(re.findall(r"\bst\.shared", ptx)),
                        "wgmma": ptx.count("wgmma.mma_async"),
                        "mma.sync": ptx.count("mma.sync"),
                    }
                )
                print("ptx", out[-1], flush=True)
    return out


def write_table(path: str, rows: list[dict], bw: float, header: str) -> None:
    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if v else "n/a"

    lines = [
        header,
        "",
        "| shape (KxN) | M | new µs | xcuBLAS | xGemLite | xtiny | % floor | cuBLAS µs | GemLite µs "
        "| default µs | default+PDL µs (xcuBLAS) | rel err | best config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("no_correct_config"):
            lines.append(f"| {r['shape']} {r['K']}x{r['N']} | {r['M']} | WRONG: no correct config |" + " |" * 10)
            continue
        us = r["us"]
        default = f"{r['default_us']:.1f}" if r.get("default_us") else "WRONG"
        with_pdl = f"{r['pdl_us']:.1f} ({r['cublas_us'] / r['pdl_us']:.2f}x)" if r.get("pdl_us") else "n/a"
        lines.append(
            f"| {r['shape']} {r['K']}x{r['N']} | {r['M']} | {us:.1f} | {r['cublas_us'] / us:.2f} | "
            f"{f(r.get('gemlite_us') and r['gemlite_us'] / us, '{:.2f}')} | "
            f"{f(r.get('tiny_us') and r['tiny_us'] / us, '{:.2f}')} | {100 * r['floor_us'] / us:.0f} | "
            f"{r['cublas_us']:.1f} | {f(r.get('gemlite_us'))} | {default} "
            f"[{r['default_cfg']}] | {with_pdl} | {r['err']:.1e} | {r['cfg']} |"
        )
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time every candidate config, report the fastest")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--peers", default="gemlite,tiny", help="comma-separated: gemlite, tiny")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop sweeping (keep timing defaults) after this")
    ap.add_argument("--sweep-ms", default="", help="sweep only these M (others: built-in dispatch); default all")
    ap.add_argument("--ptx", action="store_true", help="also count st.shared in the sm90/sm86 PTX")
    ap.add_argument("--jobs", type=int, default=0, help="compile the kernel variants first in this many processes")
    ap.add_argument(
        "--pdl", action="store_true", help="also time the default with PDL launches (sm90; quant_kernels.pdl)"
    )
    ap.add_argument(
        "--ampere-proxy",
        action="store_true",
        help="the sm86/sm89 code path on this Hopper card (DISABLE_MMA_V3=1, Ampere layout, 99 KB shared)",
    )
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels.md"))
    args = ap.parse_args()
    if args.ampere_proxy:
        enter_ampere_proxy()
    torch.manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    peers = set(args.peers.split(",")) if args.peers else set()
    sweep_ms = {int(v) for v in args.sweep_ms.split(",")} if args.sweep_ms else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json_path = os.path.splitext(args.out)[0] + ".json"

    bw = copy_bandwidth()
    gem = load_gemlite_config() if "gemlite" in peers else "not run"
    header = (
        f"# W4A16 kernels: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}, copy bandwidth {bw / 1e12:.2f} TB/s; {gem}"
    )
    if args.ampere_proxy:
        header += (
            "; AMPERE PROXY: the sm86 code path (mma.sync, Ampere operand layout, 99 KB shared per block) on "
            "this card; xcuBLAS is against this card's cuBLAS (wgmma), not an Ampere card's"
        )
    print(header, flush=True)
    ptx = ptx_counts() if args.ptx else []
    if args.jobs > 0:
        try:
            precompile(args.jobs, args.shapes.split(","), ms, args.sweep, sweep_ms)
        except Exception as exc:  # noqa: BLE001 - the timing pass compiles what is missing itself
            print(f"precompile failed ({type(exc).__name__}: {exc}); compiling in the timing pass", flush=True)
    rows: list[dict] = []
    sweep_log: list[dict] = []
    t_start = time.time()
    for name in args.shapes.split(","):
        bench_shape(name, ms, args.sweep, bw, rows, sweep_log, t_start, args.budget_s, peers, sweep_ms, args.pdl)
        torch.cuda.empty_cache()
        with open(json_path, "w") as fh:  # partial results survive a timeout
            json.dump({"rows": rows, "sweep": sweep_log, "copy_bw": bw, "ptx": ptx, "header": header}, fh, indent=1)
        write_table(args.out, rows, bw, header)
    print("\nshape       M   new µs  xcuBLAS  xGemLite  default")
    wrong = [r for r in rows if r.get("default_wrong") or r.get("no_correct_config")]
    rows = [r for r in rows if not r.get("no_correct_config")]
    for r in rows:
        gem_x = f"{r['gemlite_us'] / r['us']:.2f}" if r.get("gemlite_us") else "n/a"
        print(
            f"{r['shape']:8s} {r['M']:5d} {r['us']:8.1f} {r['cublas_us'] / r['us']:7.2f} {gem_x:>8s}"
            f"  {r['cublas_us'] / r['default_us']:.2f} [{r['default_cfg']}]"
            if r["default_us"]
            else "  WRONG"
        )
    if wrong:  # a dispatch that computes the wrong product fails the run, after the other rows
        for r in wrong:
            print(f"WRONG DEFAULT DISPATCH: {r['shape']} M={r['M']}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
