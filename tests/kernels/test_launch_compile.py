"""Every Triton launch the engine makes compiles for the GPU of each CI job (no GPU needed).

The CPU kernel tests run the kernels through Triton's interpreter, which checks numerics and
shapes but never compiles them, and the PTX / SASS tests compile kernels with signatures written
by hand. Neither saw main at b0d3937 crash at the first token on every GPU (issue 24): the W4A16
GEMM passed its fp16 output as the int32 split-K counters of every launch that did not split,
and Triton type-checked the atomic it had not folded away. Here the engine's own code — model
runner, decode-graph forward, layers, dispatch, kernel wrappers — runs at real model shapes on a
simulated GPU (``tests/helpers/kernel_launches.py``); every launch is captured with its exact
arguments and compiled ahead of time for that GPU (``tests/helpers/engine_launches.py`` lists
what is driven: five model shapes and their checkpoint formats, fp16 and bf16, every KV cache
dtype, the warm-up steps, eager and CUDA-graph decodes, the W4A16 sweep candidates, PDL).

Each unit's drive runs in its own subprocess (interpreted kernels, which the kernel tests' conftest
turns on for this machine, cannot be compiled), queued with the module's other compile scripts on two
niced background workers from the end of collection (tests/conftest.py); the module runs last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.engine_launches import DRAFT_LAYER_SHAPES, DRAFT_ROWS
from tests.helpers.result_scripts import BackgroundJob, BackgroundPool, StartedScript, run_result_script, script_env

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _job_units() -> dict[str, tuple[str, str]]:
    """What each CI job compiles, one unit a job, chosen by this Triton's generation. Before 3.8 (the
    lowest job; 3.6 is the device machine's compiler): sm90 (the H100 / H200 qserve is measured on and
    the smoke runs) in fp16, the engine's every path (issue 24's crash was there). From 3.8 (the newest
    job, a fresh install's Triton): sm89 (RTX 4090 / L4) in bf16, the consumer cards' code generator
    (mma.sync, 99 KB of shared memory a block), which gives sm86 (RTX 3090 / A10G) the same operand layout
    from 3.8 on. Two units a job (sm86 fp16 under 3.6, sm90 bf16 under 3.8 as well) kept CI over its 20
    minutes; ``python -m tests.helpers.engine_launches --gpu sm86 --dtypes fp16`` (any card, any dtype,
    any Triton) checks the rest, and the README asks for it before a kernel or dispatch change."""
    from quant_kernels.repack import mma_kwidth

    if mma_kwidth((8, 6)) == 4:  # before Triton 3.8
        return {"sm90-fp16": ("sm90", "fp16")}
    return {"consumer": ("sm89", "bf16")}


# One subprocess each, queued early in both CI jobs. ``python -m tests.helpers.engine_launches
# --tier full`` covers more (README, "Contributing").
UNITS = _job_units()
SM90_UNIT = next((name for name in UNITS if name.startswith("sm90")), None)  # the lowest job's


def _env(tmp: Path, name: str) -> dict[str, str]:
    env = script_env()
    env["TRITON_CACHE_DIR"] = str(tmp / f"triton-cache-{name}")  # cold: every launch really compiles
    env["TRITON_DISABLE_LINE_INFO"] = "1"  # ~15% less compile time; no effect on what a launch needs
    return env


# What ``pytest_collection_finish`` (tests/conftest.py) queued through ``start_early``: the units' drives
# ({unit: (job, report path, log path)}) and the other compile tests' scripts ({test name: StartedScript}).
# Queued there on two workers at low CPU priority, they compile while the session's other tests run (one
# pytest keeps about one of CI's two cores busy), and the session runs this module last
# (``pytest_collection_modifyitems``), so its tests mostly find the work done instead of waiting for it.
EARLY_UNITS = pytest.StashKey[dict]()
EARLY_SCRIPTS = pytest.StashKey[dict]()


def start_units(units: set[str], tmp: Path, pool: BackgroundPool) -> dict[str, tuple[BackgroundJob, Path, Path]]:
    """Queue the drive of each of ``units`` (one subprocess each, niced) on ``pool``, writing into ``tmp``."""
    jobs = {}
    for unit in sorted(units):
        gpu, dtypes = UNITS[unit]
        out, log_path = tmp / f"{unit}.json", tmp / f"{unit}.log"
        cmd = [
            sys.executable,
            "-m",
            "tests.helpers.engine_launches",
            "--gpu",
            gpu,
            "--dtypes",
            dtypes,
            "--out",
            str(out),
        ]
        jobs[unit] = (pool.submit(BackgroundJob(cmd, _env(tmp, unit), log_path)), out, log_path)
    return jobs


def selected_units(items: list[pytest.Item]) -> set[str]:
    """The units whose tests the session runs (both tests read the units' reports)."""
    return {
        item.callspec.params["unit"]
        for item in items
        if getattr(item, "originalname", None) in ("test_every_launch_compiles", "test_every_kernel_is_launched")
        and hasattr(item, "callspec")
        and item.callspec.params["unit"] in UNITS  # the newest job has no sm90 unit for the every-kernel test
    }


def start_early(items: list[pytest.Item], tmp: Path, pool: BackgroundPool) -> tuple[dict, dict[str, StartedScript]]:
    """Queue on ``pool`` the units' drives, then the scripts of the compile tests among ``items``."""
    units = start_units(selected_units(items), tmp, pool)
    names = {getattr(item, "originalname", item.name) for item in items}
    scripts = {}
    for name in sorted(names & set(_SCRIPTS)):
        script, args = _SCRIPTS[name]
        scripts[name] = StartedScript(script, *args(), env=_env(tmp, name), folder=tmp, name=name, pool=pool)
    return units, scripts


@pytest.fixture(scope="module")
def reports(request, tmp_path_factory) -> dict[str, dict]:
    """The report of every selected unit: from the drives started at collection, else started now."""
    jobs = request.config.stash.get(EARLY_UNITS, None)
    if jobs is None:
        pool = BackgroundPool()
        request.addfinalizer(pool.shutdown)
        jobs = start_units(selected_units(request.session.items), tmp_path_factory.mktemp("launches"), pool)
    result = {}
    for unit, (job, out, log_path) in jobs.items():
        returncode = job.wait(timeout=1200)
        text = log_path.read_text()
        if "backend" in text.lower() and "nvidia" in text.lower() and not out.exists():
            pytest.skip("this triton has no NVIDIA backend")
        assert out.exists(), f"the {unit} drive ended without a report (exit {returncode}):\n{text[-4000:]}"
        result[unit] = json.loads(out.read_text()) | {"log": text}
    return result


@pytest.mark.parametrize("unit", list(UNITS))
def test_every_launch_compiles(reports, unit) -> None:
    report = reports[unit]
    failures = [launch for launch in report["launches"] if launch["error"]]
    print(report["log"].strip().splitlines()[-1])
    shown = "\n".join(
        f"- {f['error']}\n  {f['kernel']} at {f['site']} [{f['where']}]\n  args {', '.join(f['signature'])}\n"
        f"  {', '.join(f'{k}={v}' for k, v in f['constexprs'])}"
        for f in failures[:20]
    )
    assert not failures, f"{len(failures)} of {len(report['launches'])} launches fail on {unit}:\n{shown}"


# Skipped by a mark, not in the body: the ``reports`` fixture is then never set up for it, so under
# pytest-xdist a worker that draws only this test does not compile the job's unit a second time.
@pytest.mark.parametrize(
    "unit",
    [
        pytest.param(
            SM90_UNIT or "sm90-fp16",
            marks=pytest.mark.skipif(
                SM90_UNIT is None, reason="the lowest job's unit (its fp16 drive is the one that reaches every kernel)"
            ),
        )
    ],
)
def test_every_kernel_is_launched(reports, unit) -> None:
    """The drive reaches every Triton kernel quant_kernels defines (a kernel nothing launches here
    would be one this check silently stopped covering); sm90's fp16 unit runs every path (LoRA and
    the stream-K GEMM are driven in fp16 only); the newest job, whose one unit is sm89 in bf16, leaves
    the check to the lowest job's sm90 fp16 unit. Also reached: the opt-in ``QK_NORM`` variant of
    ``rotary_kernel`` (QSERVE_FUSED_QK_NORM_ROPE=1: ``drive_qk_norm_rope``, under a second of the unit;
    with its ``STORE_KV``, QSERVE_FUSED_ROPE_KV_STORE's default, with and without ``QK_NORM``)."""
    import importlib
    import pkgutil

    import triton

    import quant_kernels

    defined = set()
    for module_info in pkgutil.iter_modules(quant_kernels.__path__):
        if module_info.name.endswith("_triton"):
            module = importlib.import_module(f"quant_kernels.{module_info.name}")
            defined |= {
                name
                for name, value in vars(module).items()
                if name.endswith("_kernel") and isinstance(value, triton.runtime.jit.KernelInterface)
            }
    launched = {launch["kernel"] for launch in reports[unit]["launches"]}
    assert defined, "no Triton kernel found in quant_kernels"
    assert not defined - launched, f"never launched on {unit}: {sorted(defined - launched)}"
    qk_norm = [
        x for x in reports[unit]["launches"] if x["kernel"] == "rotary_kernel" and dict(x["constexprs"]).get("QK_NORM")
    ]
    assert qk_norm, f"rotary_kernel's QK_NORM variant (QSERVE_FUSED_QK_NORM_ROPE=1) never launched on {unit}"


_CONTROL = r"""
import json, torch
from tests.helpers import broken_kernels
from tests.helpers.kernel_launches import GPUS, simulated_gpu
result = {}
for name in ("sm90", "sm86"):
    with simulated_gpu(GPUS[name]) as capture:
        broken_kernels.launch_split_or_direct(torch.empty(16, dtype=torch.float16))
        a = torch.empty(128, 512, dtype=torch.float16)
        broken_kernels.launch_big_tile(a, torch.empty(512, 128, dtype=torch.float16), torch.empty(128, 128))
        broken_kernels.launch_tall_grid(torch.empty(70_000))
    result[name] = {launch.kernel: launch.error for launch in capture.launches.values()}
print("RESULT" + json.dumps(result))
"""


def _script_result(request: pytest.FixtureRequest, tmp_path: Path) -> object:
    """The ``RESULT`` of this test's script (``_SCRIPTS``): started at collection, else run now."""
    name = request.node.originalname
    started = request.config.stash.get(EARLY_SCRIPTS, {}).get(name)
    if started is not None:
        return started.result()
    script, args = _SCRIPTS[name]
    return run_result_script(script, *args(), env=_env(tmp_path, name), timeout=900)


def test_the_check_catches_what_broke_main(request, tmp_path) -> None:
    """Controls: b0d3937's branch pattern with the fp16 output as the counters fails to compile
    (on every GPU), a kernel needing more shared memory than an sm86 block has fails there (and
    only there), and a grid past CUDA's limits fails even when the kernel compiled for a smaller one."""
    result = _script_result(request, tmp_path)
    for gpu in ("sm90", "sm86"):
        assert "atomic_xchg does not support fp16" in (result[gpu]["split_or_direct_kernel"] or ""), result[gpu]
    assert result["sm90"]["big_tile_kernel"] is None, result["sm90"]
    assert "shared memory" in (result["sm86"]["big_tile_kernel"] or ""), result["sm86"]
    for gpu in ("sm90", "sm86"):
        assert "grid (1, 70000)" in (result[gpu]["fill_kernel"] or ""), result[gpu]


_LORA = r"""
import json, torch
from tests.helpers.engine_launches import drive_lora_kernels
from tests.helpers.kernel_launches import GPUS, simulated_gpu
result = {}
for name in ("sm90", "sm89", "sm86"):
    with simulated_gpu(GPUS[name]) as capture:
        for dtype, dtype_name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            drive_lora_kernels(capture, dtype, dtype_name)
    result[name] = [
        {"kernel": l.kernel, "signature": l.signature, "constexprs": dict(l.constexprs), "error": l.error, "where": l.where}
        for l in capture.launches.values()
    ]
print("RESULT" + json.dumps(result, default=str))
"""


def _compiled_launches(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, list[dict]]:
    """This test's launch script's captured launches by GPU, after checking that every one compiled."""
    result = _script_result(request, tmp_path)
    for gpu, launches in result.items():
        failures = [f"{x['kernel']} [{x['where']}]: {x['error']}" for x in launches if x["error"]]
        assert not failures, f"{gpu}:\n" + "\n".join(failures)
    return result


def test_lora_launches_compile(request, tmp_path) -> None:
    """The multi-LoRA kernels as ``lora_ops.add_lora`` launches them (QSERVE_LORA_TRITON=1) at
    Qwen2.5-14B's qkv and down shapes, fp16 and bf16, compile for sm90, sm89 and sm86: the split-K
    shrink (workspace, arrival counters, the last program's reduction) and the one-split shrink, and
    the expand, into y and (QSERVE_LORA_OVERLAP=pair, through begin_lora / finish_lora) into an fp32 delta, and
    gate_up's expand fused into the SiLU-and-mul (QSERVE_LORA_FUSED_SILU, finish_lora_silu_and_mul). Selectable alone (``-k lora``): no engine drive, about a minute."""
    for gpu, launches in _compiled_launches(request, tmp_path).items():
        splits = {x["constexprs"]["SPLIT_PAD"] for x in launches if x["kernel"] == "lora_shrink_kernel"}
        assert 1 in splits and max(splits) == 32, (gpu, splits)  # one split, and the heuristic's decode split
        expands = {x["signature"][0] for x in launches if x["kernel"] == "lora_expand_kernel"}  # Y's type
        # into y (fp16 / bf16), and into QSERVE_LORA_OVERLAP=pair's fp32 delta
        assert "*float32" in expands and len(expands) >= 2, (gpu, expands)
        fused = [x for x in launches if x["kernel"] == "lora_expand_silu_mul_kernel"]  # QSERVE_LORA_FUSED_SILU
        assert {x["signature"][0] for x in fused} == {"*float16", "*bfloat16"}, (gpu, fused)


_MOE_DIRECT = r"""
import json, torch
from tests.helpers.engine_launches import drive_moe_direct_blocks
from tests.helpers.kernel_launches import GPUS, simulated_gpu
result = {}
for name, dtype, dtype_name in (("sm90", torch.float16, "fp16"), ("sm89", torch.bfloat16, "bf16")):
    with simulated_gpu(GPUS[name], compile=False) as capture:  # the units' drives compile these launches
        drive_moe_direct_blocks(capture, dtype, dtype_name)
    result[name] = [
        {"kernel": l.kernel, "constexprs": dict(l.constexprs), "error": l.error, "where": l.where, "grid": l.grid,
         "count": l.count}
        for l in capture.launches.values()
    ]
print("RESULT" + json.dumps(result, default=str))
"""


@pytest.mark.slow  # a few seconds: recorded, not compiled
def test_moe_direct_blocks_launches(request, tmp_path) -> None:
    """The sort-free MoE step (QSERVE_MOE_DIRECT_BLOCKS=32, the default) as ``moe_ops`` runs it at
    Qwen3-30B-A3B's shapes, on sm90 (fp16) and sm89 (bf16): the router's one program writing the block
    layout (one token, and four for an expert-parallel rank), or with the opt-in
    QSERVE_FUSED_ROUTER_GEMM=1 the one launch that also computes the logits (32 programs of 4 router
    rows, the last one choosing), then the MMA kernel's two GEMMs over T*k blocks of 16 rows (split
    along K at one token, by the default QSERVE_MOE_SPLIT_K=auto), and no token sort. Recorded without
    compiling: the units' drives
    (``test_every_launch_compiles``) compile the same launches for the job's cards (``drive_moe``'s
    companion ``drive_moe_direct_blocks``). Selectable alone (``-k direct``)."""
    for gpu, launches in _compiled_launches(request, tmp_path).items():
        kernels = {x["kernel"] for x in launches}
        # no sort; one token splits along K (too few programs), four tokens of a rank's share do not
        assert kernels == {
            "router_topk_blocks_kernel", "router_gemm_topk_blocks_kernel", "moe_mma_split_kernel", "moe_mma_kernel",
        }, (gpu, kernels)  # fmt: skip
        routers = [x for x in launches if x["kernel"] == "router_topk_blocks_kernel"]
        assert {x["constexprs"]["T_PAD"] for x in routers} == {1, 4}, gpu
        assert all(x["grid"] == [1] and x["constexprs"]["BLOCK_M"] == 16 for x in routers), gpu
        fused = [x for x in launches if x["kernel"] == "router_gemm_topk_blocks_kernel"]
        # 128 experts / 4 rows a program; one token's 2048 hidden columns in one step, four tokens' in 4
        assert {(x["constexprs"]["T_PAD"], x["constexprs"]["BLOCK_H"]) for x in fused} == {(1, 2048), (4, 512)}, gpu
        assert {x["constexprs"].get("PACKED_TOPK", False) for x in fused} == {False, True}, gpu
        assert all(x["grid"] == [32] and x["constexprs"]["BLOCK_EG"] == 4 and x["constexprs"]["BLOCK_M"] == 16
                   for x in fused), gpu  # fmt: skip
        for kernel, blocks in (("moe_mma_split_kernel", 8), ("moe_mma_kernel", 32)):  # T*k: 1 x top-8, 4 x top-8
            mma = [x for x in launches if x["kernel"] == kernel]
            # gate_up and down after each of the three routers: F.linear + the top-k, the fused one, the fused
            # one with QSERVE_MOE_PACKED_TOPK=1
            assert sum(x["count"] for x in mma) == 6, (gpu, kernel)
            assert {x["grid"][0] for x in mma} == {blocks}, (gpu, kernel)


_MOE = r"""
import json, sys, torch
from tests.helpers.engine_launches import drive_moe, layout_without_shuffling
from tests.helpers.kernel_launches import GPUS, simulated_gpu
result = {}
for name in sys.argv[1:]:
    with simulated_gpu(GPUS[name]) as capture, layout_without_shuffling():  # launches need the experts' shapes only
        drive_moe(capture, torch.float16, "fp16")
    result[name] = [
        {"kernel": l.kernel, "signature": l.signature, "constexprs": dict(l.constexprs), "error": l.error,
         "where": l.where, "grid": l.grid}
        for l in capture.launches.values()
    ]
print("RESULT" + json.dumps(result, default=str))
"""


@pytest.mark.slow  # ~25 s (the newest CI job runs it)
def test_moe_launches_compile(request, tmp_path) -> None:
    """The MoE launches as ``moe_ops`` makes them at Qwen3-30B-A3B's shapes, and what they must look
    like: the one-program token sort (int32 ids, all experts and an expert-parallel rank's share with
    the sentinel group, one chunk and several), the fused kernel's grouped GEMMs
    (QSERVE_MOE_KERNEL=fused), the default MMA-operand kernel's (symmetric, with zeros, one rank's
    share), its split-K kernel's (QSERVE_MOE_SPLIT_K) and the router top-k's one launch
    (the default). The engine units compile the same launches for sm90 (the lowest job) and sm89
    (the newest); this checks sm86, which neither builds. Selectable alone (``-k moe``)."""
    for gpu, launches in _compiled_launches(request, tmp_path).items():
        aligns = [x for x in launches if x["kernel"] == "moe_align_block_size_kernel"]
        assert all(x["signature"][0] == "*int32" and x["grid"] == [1] for x in aligns), (gpu, aligns)
        assert {x["constexprs"]["NUM_BINS"] for x in aligns} == {128, 64}, gpu  # 128 experts; 32 + the sentinel
        assert max(x["constexprs"]["CHUNK"] for x in aligns) < 512 * 8, gpu  # 4096 pairs: several chunks
        kernels = {x["kernel"] for x in launches}
        assert kernels == {
            "moe_align_block_size_kernel", "moe_w4a16_kernel", "moe_mma_kernel", "moe_mma_split_kernel",
            "router_topk_kernel",
        }, gpu  # fmt: skip


_MOE_SPLIT = r"""
import json, sys, torch
from tests.helpers.engine_launches import drive_moe_mma_split, layout_without_shuffling
from tests.helpers.kernel_launches import GPUS, simulated_gpu
result = {}
for name, dtype, dtype_name in (("sm90", torch.float16, "fp16"), ("sm89", torch.bfloat16, "bf16")):
    # the units' drives compile these launches; the experts' words are left unshuffled (launches need shapes only)
    with simulated_gpu(GPUS[name], compile=False) as capture, layout_without_shuffling():
        drive_moe_mma_split(capture, dtype, dtype_name)
    result[name] = [
        {"kernel": l.kernel, "signature": l.signature, "constexprs": dict(l.constexprs), "error": l.error,
         "where": l.where, "grid": l.grid}
        for l in capture.launches.values()
    ]
print("RESULT" + json.dumps(result, default=str))
"""


@pytest.mark.slow  # a few seconds: recorded, not compiled
def test_moe_split_k_launches(request, tmp_path) -> None:
    """The MMA-operand MoE kernel's split-K launches, all of ``moe_mma_split_kernel`` (none of
    the default ``moe_mma_kernel``), with QSERVE_MOE_SPLIT_K "auto" at one token and 2 at 32 tokens
    for one expert-parallel rank with zeros, as ``moe_ops`` makes them at Qwen3-30B-A3B's shapes on
    sm90 (fp16) and sm89 (bf16): gate_up with the workspace, the int32 arrival counters and the
    zeroing of down's accumulator; down adding into that float32 accumulator. Recorded without
    compiling: the units' drives compile the same launches (``drive_moe`` ends with
    ``drive_moe_mma_split``), so the counters' atomics are type-checked there (issue 24's failure).
    Selectable alone (``-k split``)."""
    for gpu, launches in _compiled_launches(request, tmp_path).items():
        assert not [x for x in launches if x["kernel"] == "moe_mma_kernel"], gpu  # the default kernel: no split
        mma = [x for x in launches if x["kernel"] == "moe_mma_split_kernel"]
        gate_up = [x for x in mma if x["constexprs"]["SILU_MUL"]]
        down = [x for x in mma if not x["constexprs"]["SILU_MUL"]]
        assert gate_up and all(x["constexprs"]["ZERO_OUT"] for x in gate_up), gpu
        # positional arguments: moe_mma_kernel's 23 (a, qw, scales, zeros, c, ...), then ws, cnt, zero, ...
        assert all(x["signature"][23:26] == ["*float32", "*int32", "*float32"] for x in gate_up), gpu
        assert down and all(x["signature"][4] == "*float32" and x["constexprs"]["OUT_ROW_DIV"] == 8 for x in down), gpu
        assert {x["grid"][2] for x in mma} == {4, 2}, (gpu, [x["grid"] for x in mma])  # "auto" at 1 token: 4


def _other_consumer_card() -> tuple[str, ...]:
    """A consumer card no unit of this job builds: sm86 (the newest job's unit is sm89)."""
    built = {gpu for gpu, _ in UNITS.values()}
    return ("sm86",) if "sm86" not in built else ("sm89",)


# The compile tests that run one script each: {test: (script, its arguments)}; ``start_early`` starts them.
_DRAFT_INT4 = r"""
import json, torch
from tests.helpers.engine_launches import drive_draft_int4, layout_without_shuffling
from tests.helpers.kernel_launches import GPUS, simulated_gpu
result = {}
for name in ("sm90", "sm89", "sm86"):
    with simulated_gpu(GPUS[name]) as capture, layout_without_shuffling():
        drive_draft_int4(capture, torch.float16, "fp16")
    result[name] = [
        {"kernel": l.kernel, "constexprs": dict(l.constexprs), "error": l.error, "where": l.where, "count": l.count}
        for l in capture.launches.values()
    ]
print("RESULT" + json.dumps(result, default=str))
"""


@pytest.mark.slow  # the newest CI job runs it
def test_draft_int4_launches_compile(request, tmp_path) -> None:
    """An EAGLE head's 4-bit copies (speculative_config "draft_lm_head" / "draft_layers": "int4") as
    ``draft_lm_head.logits`` and ``DraftInt4LinearMethod.apply`` launch them at a 14B target's shapes (the
    152,064-row lm_head; fc, EAGLE-3's qkv and down), 1-130 rows, asymmetric zeros, compile for sm90,
    sm89 and sm86. Selectable alone (``-k draft_int4``)."""
    # each call one W4A16 launch (a launch is recorded once per specialization, under its first call's place):
    # the lm_head's row counts, the 130 rows as 128 + 2, and every layer shape's row counts
    calls = len(DRAFT_ROWS) + 2 + len(DRAFT_LAYER_SHAPES) * len(DRAFT_ROWS)
    for gpu, launches in _compiled_launches(request, tmp_path).items():
        assert sum(x["count"] for x in launches) == calls, (gpu, launches)
        assert all(x["kernel"].startswith("w4a16") and x["constexprs"]["HAS_ZEROS"] for x in launches), gpu
        places = {x["where"].rsplit(" rows=", 1)[0] for x in launches}
        assert {"draft lm_head int4 fp16", "draft layer int4 fc fp16"} <= places, (gpu, sorted(places))


_SCRIPTS = {
    "test_the_check_catches_what_broke_main": (_CONTROL, tuple),
    "test_lora_launches_compile": (_LORA, tuple),
    "test_moe_direct_blocks_launches": (_MOE_DIRECT, tuple),
    "test_moe_launches_compile": (_MOE, _other_consumer_card),
    "test_moe_split_k_launches": (_MOE_SPLIT, tuple),
    "test_draft_int4_launches_compile": (_DRAFT_INT4, tuple),
}
