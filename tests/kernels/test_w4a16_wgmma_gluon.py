"""The Gluon W4A16 kernel for Hopper (``quant_kernels.w4a16_wgmma_gluon``).

Gluon kernels do not run under TRITON_INTERPRET, so on CPU this file compiles the kernel for sm90 with
the argument types its wrapper launches with (Triton's own ptxas and nvdisasm, no GPU) and checks what
the design rests on:

- the dequantized tile reaches wgmma from registers (no shared-memory store of it: the only
  ``stmatrix`` / ``st.shared`` is the output tile's);
- ptxas keeps the wgmmas asynchronous (no C7515 "serialized" advisory in ``ptxas -v``);
- no register of an in-flight wgmma's A operand is written before its group retires, along the loop's
  back edges and the paths into and out of it (tests/helpers/sass_hazards.py), and the peeled first
  tile and the tail tile (the path that skips the loop) use different A registers.

The ``gpu``-marked tests run the kernel against an fp32 oracle on NaN-poisoned outputs: odd and even
K-tile counts (the peeled tile, the unrolled pairs, the tail), ragged M and N, asymmetric zeros, bias,
bf16, per-column groups, split-K, and under CUDA-graph capture.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.helpers.sass_hazards import a_operand_hazards, fallthrough_a_operand_hazards, hgmma_groups

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from quant_kernels import reference  # noqa: E402
from quant_kernels import w4a16_mma_triton as mma  # noqa: E402
from quant_kernels import w4a16_wgmma_gluon as glk  # noqa: E402
from quant_kernels.layout import PackedQuantWeight, pack_codes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)

# (config, dtype, asym, bias): the default candidate and the bench's others, each feature once
COMPILE_CASES = [
    (glk.WgmmaConfig(), "fp16", False, False),
    (glk.WgmmaConfig(), "bf16", True, True),
    # the bench's other candidates, scales one K-tile ahead as it runs them (bench/w4a16_gluon.py)
    (glk.WgmmaConfig(block_m=128, block_n=64, stages=4, num_warps=4, scales_ahead=1), "fp16", True, False),
    (glk.WgmmaConfig(block_m=128, block_n=128, stages=4, num_warps=8, scales_ahead=1), "fp16", True, False),
    (glk.WgmmaConfig(block_m=64, block_n=128, stages=4, num_warps=8, scales_ahead=1), "fp16", False, True),
    (glk.WgmmaConfig(block_m=256, block_n=128, stages=2, num_warps=8, scales_ahead=1), "fp16", False, False),
    (glk.WgmmaConfig(split_k=2), "fp16", False, True),
    (glk.WgmmaConfig(split_k=3), "bf16", True, True),
    (glk.WgmmaConfig(block_m=64, stages=4, split_k=3), "fp16", True, True),  # the narrow launch (33-64 rows)
    (glk.WgmmaConfig(scales_ahead=1), "fp16", True, True),
    # 128 weight rows a warpgroup in 64-deep K-tiles (QSERVE_W4A16_GLUON_TILE's measured candidates): no C7511
    (glk.WgmmaConfig(block_m=64, block_n=128, block_k=64, stages=4), "bf16", True, True),
    (glk.WgmmaConfig(block_m=128, block_n=128, block_k=64, stages=3), "fp16", False, False),
]


_COMPILE_SCRIPT = """
import sys
from pathlib import Path
from quant_kernels import w4a16_wgmma_gluon as glk
from tests.kernels.test_w4a16_wgmma_gluon import COMPILE_CASES
for i, (cfg, dtype, asym, bias) in enumerate(COMPILE_CASES):
    kernel = glk.compile_for(90, cfg, dtype=dtype, asym=asym, bias=bias)
    Path(sys.argv[1], f"{i}.ptx").write_text(kernel.asm["ptx"])
    Path(sys.argv[1], f"{i}.cubin").write_bytes(kernel.asm["cubin"])
"""


def _fresh_env() -> dict:
    """This environment without the interpreter or a GPU: what a Gluon compile needs (see ``compiled``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    return env


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    """Each compile case's PTX, ``ptxas -v`` report and SASS. The kernels compile in a fresh process: in a
    pytest worker that has run a Triton kernel under TRITON_INTERPRET (the dispatch tests here), a Gluon
    compile that misses the cache failed in the frontend (``'ir.value' object has no attribute 'dtype'`` at
    the first ``program_id`` product), so whether this fixture passed hung on xdist's test order."""
    if not (BIN / "ptxas").exists() or not (BIN / "nvdisasm").exists():
        pytest.skip("this Triton ships no ptxas / nvdisasm")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", _COMPILE_SCRIPT, tmp],
            capture_output=True,
            text=True,
            env=_fresh_env(),
            cwd=ROOT,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for i, (cfg, dtype, asym, bias) in enumerate(COMPILE_CASES):
            ptx, cubin = Path(tmp, f"{i}.ptx"), Path(tmp, f"{i}.cubin")
            ptxas = subprocess.run(
                [str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp, "v.cubin"))],
                capture_output=True,
                text=True,
                check=True,
            )
            sass = subprocess.run([str(BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True)
            label = f"{cfg.short()} {dtype}{' asym' if asym else ''}{' bias' if bias else ''}"
            out.append(
                {"label": label, "ptx": ptx.read_text(), "ptxas": ptxas.stderr + ptxas.stdout, "sass": sass.stdout}
            )
    return out


def test_weight_tile_reaches_wgmma_from_registers(compiled) -> None:
    for case in compiled:
        ptx = case["ptx"]
        assert "wgmma.mma_async.sync.aligned" in ptx, case["label"]
        # the A operand is a register vector ({%r..}), not a shared-memory descriptor
        assert "wgmma.mma_async.sync.aligned.m64n" in ptx and ", {%r" in ptx, case["label"]
        # the split-K counter's atomic result, broadcast to the program's threads, is not a weight tile
        atomic_results = set(re.findall(r"atom\.global\S* (%r\d+),", ptx))
        stores = [
            ln
            for ln in ptx.splitlines()
            if "st.shared" in ln
            and "mbarrier" not in ln
            and ln.rstrip(" ;").split(",")[-1].strip() not in atomic_results
        ]
        assert not stores, f"{case['label']}: a shared-memory store besides the output tile's stmatrix: {stores[:2]}"


def test_ptxas_keeps_the_wgmmas_asynchronous(compiled) -> None:
    for case in compiled:
        assert "C7515" not in case["ptxas"] and "serialized" not in case["ptxas"], f"{case['label']}: {case['ptxas']}"
        assert "spill stores" in case["ptxas"]
        assert "0 bytes spill stores" in case["ptxas"], f"{case['label']}: {case['ptxas']}"


def test_no_a_register_is_rewritten_under_an_inflight_wgmma(compiled) -> None:
    for case in compiled:
        seen, found = a_operand_hazards(case["sass"])
        assert seen > 0, f"{case['label']}: no register-A HGMMA in a loop: the SASS parse is stale"
        assert not found, f"{case['label']}: {found[:3]}"
        assert not fallthrough_a_operand_hazards(case["sass"]), case["label"]
        groups = hgmma_groups(case["sass"])
        # address order: the peeled first tile, the loop's two tiles, the tail tile (the loop may be skipped)
        assert len(groups) == 4, f"{case['label']}: {len(groups)} HGMMA groups, the kernel's structure changed"
        assert not groups[0] & groups[3], f"{case['label']}: the peeled tile and the tail share A registers"


_LAYOUT_SCRIPT = r"""
import json, re
from quant_kernels import w4a16_mma_triton as mma
out = {}
for bm, bn, bk, warps in [(128, 128, 128, 8), (128, 64, 128, 4), (64, 128, 128, 4), (128, 128, 64, 4)]:
    ir = mma.compile_for(90, mma.MmaConfig("mma", bm, bn, bk, 1, warps, 3)).asm["ttgir"]
    name = re.search(r"ttg\.local_load .*-> tensor<\d+x\d+xi32, #(\w+)>", ir).group(1)
    out[f"{bn},{bk},{warps}"] = re.search(r"#%s = #ttg\.linear<\{(.*)\}>" % name, ir).group(1)
print(json.dumps(out))
"""


def test_word_layout_is_the_triton_kernels_choice() -> None:
    """The layout written out in ``_word_layout`` is the one Triton derives for ``w4a16_mma_kernel``'s words
    (its sm90 TTGIR; compiled in a process without TRITON_INTERPRET), for each tile shape the bench times."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, "-c", _LAYOUT_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for key, theirs in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        bn, bk, warps = map(int, key.split(","))
        ours = glk._word_layout.fn(bn, bk, warps)  # the constexpr function's Python body
        for name, bases in (("register", ours.reg_bases), ("lane", ours.lane_bases), ("warp", ours.warp_bases)):
            assert f"{name} = {bases}".replace(" ", "") in theirs.replace(" ", ""), (key, theirs)


def _weight(k, n, group_size, asym, gen, device="cpu") -> PackedQuantWeight:
    g = k if group_size == -1 else group_size
    codes = torch.randint(0, 16, (k, n), generator=gen)  # [K, N]
    scales = (torch.rand(-(-k // g), n, generator=gen) * 0.02 + 0.002).half()  # [G, N]
    zeros = torch.randint(0, 16, (-(-k // g), n), generator=gen).to(torch.uint8) if asym else None
    return PackedQuantWeight(4, g, pack_codes(codes, 4), scales, zeros).to(device)


def test_unsupported_weights_are_refused_with_the_reason() -> None:
    gen = torch.Generator().manual_seed(0)
    w = mma.prepare(_weight(256, 64, 64, False, gen))  # groups of 64 inside a 128-deep K-tile
    with pytest.raises(ValueError, match="group_size=64"):
        glk.w4a16_wgmma(torch.zeros(64, 256, dtype=torch.float16), w)
    assert not glk.supports(w, torch.float16)
    assert glk.supports(mma.prepare(_weight(256, 64, 128, True, gen)), torch.bfloat16)
    assert not glk.supports(mma.prepare(_weight(256, 64, 128, False, gen)), torch.float32)


def test_fit_clamps_tiles_to_the_problem() -> None:
    assert glk.fit(glk.WgmmaConfig(block_m=256), 100).block_m == 128
    with pytest.raises(ValueError, match="scales_ahead=3"):
        glk.fit(glk.WgmmaConfig(scales_ahead=3), 128)
    assert glk.fit(glk.WgmmaConfig(block_m=128), 1).block_m == 16  # MIN_BLOCK_M: a decode tile
    assert glk.fit(glk.WgmmaConfig(block_m=128), 40).block_m == 64
    assert glk.fit(glk.WgmmaConfig(block_n=64, num_warps=8), 512).num_warps == 4


def test_split_never_leaves_a_share_empty() -> None:
    # 5 K-tiles in 4 shares of cdiv(5, 4) = 2 would leave the last empty: the wrapper takes 3 shares
    assert glk.effective_split(5, 4) == 3
    assert glk.effective_split(40, 2) == 2
    assert glk.effective_split(1, 8) == 1


def test_auto_split_fills_the_program_slots_and_stays_in_the_counters() -> None:
    """``auto_split`` on 132 SMs (two programs each) at Qwen2.5-14B's layers, the H100's best counts of the
    twenty-first session: the narrow layers split at 128 rows, where their tiles leave most slots idle, the
    long-K down at 128-512, gate_up never; no split past 4 row tiles (the weight's counters) or under 8
    K-tiles a share."""
    cfg128, cfg256 = glk.default_config(128, 5120, 5120, 132), glk.default_config(256, 5120, 5120, 132)
    shapes = {"qkv": (5120, 7168), "o": (5120, 5120), "gate_up": (5120, 27648), "down": (13824, 5120)}
    at128 = {name: glk.auto_split(128, k, n, 132, cfg128) for name, (k, n) in shapes.items()}
    at256 = {name: glk.auto_split(256, k, n, 132, cfg256) for name, (k, n) in shapes.items()}
    assert at128 == {"qkv": 2, "o": 3, "gate_up": 1, "down": 3}
    assert at256 == {"qkv": 1, "o": 1, "gate_up": 1, "down": 3}
    assert glk.auto_split(512, 13824, 5120, 132, glk.default_config(512, 13824, 5120, 132)) == 3
    assert glk.auto_split(1024, 5120, 5120, 132, glk.default_config(1024, 5120, 5120, 132)) == 1
    assert glk.auto_split(128, 1024, 256, 132, cfg128) == 1  # 8 K-tiles: a share would hold 4
    assert glk.auto_split(128, 2048, 256, 132, cfg128) == 2
    # the counters a weight holds (quant_kernels.ops) cover every tile of every split a launch can get, the
    # rule's or a forced count's (QSERVE_W4A16_GLUON=1 sends every row count from 65 to the kernel)
    with mock.patch.dict(os.environ, {glk.SPLIT_ENV: "8"}):
        for m in (65, 128, 256, 512, 513, 1024, 4096):
            for k, n in shapes.values():
                cfg = glk.default_config(m, k, n, 132)
                tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
                assert cfg.split_k == (8 if m <= 512 else 1)
                assert tiles <= mma.num_split_counters(n) or cfg.split_k == 1


def test_split_setting_picks_the_shares_and_refuses_anything_else(monkeypatch) -> None:
    """``QSERVE_W4A16_GLUON_SPLIT`` unset or "auto": ``auto_split``; a count: that many (never past 4 row
    tiles; 1 never splits); anything else refused, naming the variable."""
    monkeypatch.delenv(glk.SPLIT_ENV, raising=False)
    assert glk.default_config(128, 5120, 5120, 132).split_k == 3
    assert glk.default_config(256, 5120, 5120, 132).split_k == 1
    monkeypatch.setenv(glk.SPLIT_ENV, "auto")
    assert glk.default_config(128, 5120, 5120, 132).split_k == 3
    monkeypatch.setenv(glk.SPLIT_ENV, "1")
    assert glk.default_config(128, 5120, 5120, 132).split_k == 1
    monkeypatch.setenv(glk.SPLIT_ENV, "2")
    assert glk.default_config(128, 5120, 5120, 132).split_k == 2
    assert glk.default_config(1024, 5120, 5120, 132).split_k == 1
    for bad in ("yes", "0", "9", "-1"):
        monkeypatch.setenv(glk.SPLIT_ENV, bad)
        with pytest.raises(ValueError, match=f"QSERVE_W4A16_GLUON_SPLIT='{bad}'"):
            glk.default_config(128, 5120, 5120, 132)


def test_tile_setting_replaces_the_tiles_past_64_rows_and_refuses_what_cannot_compile(monkeypatch) -> None:
    """``QSERVE_W4A16_GLUON_TILE`` (a measurement switch): past 64 rows its tiles, fitted to M and split by
    ``auto_split``; the narrow launch (33-64 rows) keeps its own; unset: the built-in tiles; a malformed or
    uncompilable value refused, naming the variable."""
    monkeypatch.delenv(glk.SPLIT_ENV, raising=False)
    monkeypatch.delenv(glk.TILE_ENV, raising=False)
    assert glk.default_config(256, 5120, 27648, 132) == glk.WgmmaConfig(split_k=1)
    monkeypatch.setenv(glk.TILE_ENV, "64x128x64x4x4")
    cfg = glk.default_config(256, 5120, 27648, 132)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.num_warps) == (64, 128, 64, 4, 4)
    monkeypatch.delenv(glk.TILE_ENV)
    narrow = glk.default_config(64, 5120, 5120, 132)
    monkeypatch.setenv(glk.TILE_ENV, "128x128x64x3x4")
    assert glk.default_config(80, 5120, 5120, 132).block_m == 128  # fitted: next power of two of 80
    assert glk.default_config(64, 5120, 5120, 132) == narrow  # the narrow launch keeps its tiles
    for bad in ("128x128", "128x128x32x3x4", "128x96x64x3x8", "100x128x64x3x4", "128x128x64x1x4", "axbxcxdxe"):
        monkeypatch.setenv(glk.TILE_ENV, bad)
        with pytest.raises(ValueError, match=f"QSERVE_W4A16_GLUON_TILE='{bad}'"):
            glk.default_config(256, 5120, 5120, 132)


def test_dispatch_takes_the_gluon_kernel_where_it_measured_faster(monkeypatch) -> None:
    """Unset: every layer at 65-512 rows (the K-heavy down too since its split launch, twenty-first session), on
    sm90 only; "1": every row count from 65; "0": never; anything else refused by name."""
    monkeypatch.setattr(mma.kdevice, "triton_serves", lambda device: True)
    cap = {"v": (9, 0)}
    monkeypatch.setattr(mma.kdevice, "capability", lambda device: cap["v"])
    gen = torch.Generator().manual_seed(1)
    wide = mma.prepare(_weight(512, 1024, 128, False, gen))  # K < 2N: gate_up / qkv / o
    k_heavy = mma.prepare(_weight(1024, 256, 128, False, gen))  # K >= 2N: down
    grouped = mma.prepare(_weight(512, 1024, 64, False, gen))  # groups inside a K-tile: not served

    def uses(weight, m):
        return mma.uses_gluon(weight, torch.zeros(m, weight.in_features, dtype=torch.float16), m)

    monkeypatch.delenv(mma.GLUON_ENV, raising=False)
    rows = (64, 65, 128, 129, 256, 512, 513, 1024, 1025, 4096)
    assert [uses(wide, m) for m in rows] == [False] + [True] * 5 + [False] * 4
    assert [uses(k_heavy, m) for m in rows] == [False] + [True] * 5 + [False] * 4
    assert not uses(grouped, 256)
    monkeypatch.setenv(mma.GLUON_ENV, "1")
    assert [uses(wide, m) for m in (64, 65, 4096)] == [False, True, True] and uses(k_heavy, 128)
    monkeypatch.setenv(mma.GLUON_ENV, "0")
    assert not uses(wide, 256)
    monkeypatch.delenv(mma.GLUON_ENV)
    cap["v"] = (8, 9)
    assert not uses(wide, 256)
    monkeypatch.setenv(mma.GLUON_ENV, "yes")
    with pytest.raises(ValueError, match="QSERVE_W4A16_GLUON='yes'"):
        uses(wide, 256)


def test_narrow_launch_serves_33_to_64_rows_where_the_split_fills_the_card(monkeypatch) -> None:
    """The narrow launch: at 33-64 rows the Gluon kernel (64-row x tiles, 4 stages) serves the layers
    ``auto_split`` splits, i.e. whose tiles leave the program slots idle (Qwen2.5-14B's qkv, o, down on 132
    SMs), never gate_up (432 tiles fill the card) nor 32 rows; off with ``QSERVE_W4A16_GLUON_NARROW=0`` or
    ``QSERVE_W4A16_GLUON=0``; another value refused by name."""
    monkeypatch.setattr(mma.kdevice, "triton_serves", lambda device: True)
    monkeypatch.setattr(mma.kdevice, "capability", lambda device: (9, 0))
    monkeypatch.setattr(mma, "_num_sms", lambda device: 132)
    monkeypatch.delenv(mma.GLUON_ENV, raising=False)
    monkeypatch.delenv(mma.GLUON_NARROW_ENV, raising=False)
    shapes = {"qkv": (5120, 7168), "o": (5120, 5120), "gate_up": (5120, 27648), "down": (13824, 5120)}
    assert {name: mma.gluon_narrow(k, n, 64, 132) for name, (k, n) in shapes.items()} == {
        "qkv": True,
        "o": True,
        "gate_up": False,
        "down": True,
    }
    cfg = glk.default_config(64, 5120, 7168, 132)
    assert (cfg.block_m, cfg.stages, cfg.split_k) == (64, glk.NARROW_STAGES, 2)
    assert glk.default_config(48, 5120, 5120, 132).split_k == 3
    assert glk.default_config(128, 5120, 5120, 132).stages == 3  # the 65-512-row launch keeps its 3 stages
    assert not mma.gluon_narrow(5120, 5120, 32, 132) and not mma.gluon_narrow(5120, 5120, 65, 132)
    gen = torch.Generator().manual_seed(3)
    narrow = mma.prepare(_weight(2048, 256, 128, False, gen))  # 4 tiles of 16 K-tiles: split in 2

    def uses(weight, m):
        return mma.uses_gluon(weight, torch.zeros(m, weight.in_features, dtype=torch.float16), m)

    assert [uses(narrow, m) for m in (32, 33, 48, 64, 65)] == [False, True, True, True, True]
    monkeypatch.setenv(mma.GLUON_ENV, "0")
    assert not uses(narrow, 48)
    monkeypatch.delenv(mma.GLUON_ENV)
    monkeypatch.setenv(mma.GLUON_NARROW_ENV, "0")
    assert [uses(narrow, m) for m in (48, 64, 65)] == [False, False, True]
    monkeypatch.setenv(mma.GLUON_NARROW_ENV, "1")
    assert uses(narrow, 48)
    monkeypatch.setenv(mma.GLUON_NARROW_ENV, "on")
    with pytest.raises(ValueError, match="QSERVE_W4A16_GLUON_NARROW='on'"):
        uses(narrow, 48)


def test_a_config_passed_or_pinned_keeps_the_triton_kernel(monkeypatch) -> None:
    """The Gluon kernel replaces the built-in dispatch only: ``w4a16_gemm(config=...)`` and a config pinned
    with ``set_config`` (what bench/kernels.py's sweep times) run the Triton kernel they name."""
    calls = []
    monkeypatch.setattr(mma, "uses_gluon", lambda weight, x, m: True)
    monkeypatch.setattr(
        glk,
        "w4a16_wgmma",
        lambda x, weight, bias=None, config=None, out=None, counters=None: calls.append(config) or out,
    )
    monkeypatch.setattr(mma, "_TUNED", {})
    gen = torch.Generator().manual_seed(2)
    packed = _weight(128, 64, 128, False, gen)
    weight = mma.prepare(packed)
    x = torch.randn(80, 128, generator=gen).half()  # [M, K]
    ref = x.float() @ reference.dequantize(packed, torch.float32)  # [M, N]
    mma.w4a16_gemm(x, weight)
    assert calls == [glk.default_config(80, 128, 64, 1)]
    cfg = mma.MmaConfig("mma", 16, 64, 128, 1, 4, 2)
    for out in (mma.w4a16_gemm(x, weight, config=cfg), None):
        if out is None:
            mma.set_config(weight, x.dtype, 80, cfg)
            out = mma.w4a16_gemm(x, weight)
        assert len(calls) == 1, "a passed or pinned config was handed to the Gluon kernel"
        torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


AHEAD1 = glk.WgmmaConfig(scales_ahead=1)
GPU_CASES = [
    # m, k, n, group, asym, bias, dtype, config
    (64, 256, 128, 128, False, False, torch.float16, glk.WgmmaConfig()),  # two K-tiles: peeled + tail
    (128, 384, 256, 128, False, True, torch.float16, glk.WgmmaConfig()),  # three: peeled + one pair
    (
        160,
        640,
        256,
        128,
        True,
        False,
        torch.float16,
        glk.WgmmaConfig(block_n=128, stages=4, num_warps=8, scales_ahead=1),
    ),
    (300, 640, 192, 128, True, True, torch.float16, glk.WgmmaConfig()),  # five; ragged M and N
    (200, 512, 320, 256, True, False, torch.bfloat16, glk.WgmmaConfig()),  # four; bf16; groups of 256
    (77, 1024, 136, -1, False, True, torch.float16, glk.WgmmaConfig(block_n=64, num_warps=4)),  # per-column
    (1, 512, 256, 128, True, True, torch.float16, glk.WgmmaConfig(block_m=64)),  # one row
    (1024, 1280, 512, 128, False, False, torch.float16, glk.WgmmaConfig(block_m=256, stages=2, scales_ahead=1)),
    (256, 2560, 384, 128, True, True, torch.bfloat16, glk.WgmmaConfig(split_k=2)),
    (129, 1408, 200, 128, False, True, torch.float16, glk.WgmmaConfig(split_k=4, block_n=64, num_warps=4)),
    # the default tiles in 3 shares: ragged M and N, zeros, bias, bf16, per-column groups, uneven shares
    (300, 1664, 200, 128, True, True, torch.float16, glk.WgmmaConfig(split_k=3)),
    (65, 1280, 320, 256, True, False, torch.bfloat16, glk.WgmmaConfig(split_k=3)),
    (128, 1792, 136, -1, False, True, torch.float16, glk.WgmmaConfig(split_k=3, scales_ahead=1)),
    # 16-64-row x tiles (bench candidates; the decode launch built of them lost, RESULTS), 4-6 stages, 2-5 shares
    (1, 2560, 320, 128, True, True, torch.float16, glk.WgmmaConfig(block_m=16, stages=6, split_k=5)),
    (8, 1280, 200, 128, False, False, torch.bfloat16, glk.WgmmaConfig(block_m=16, stages=6, split_k=2)),
    (27, 1536, 136, -1, True, True, torch.float16, glk.WgmmaConfig(block_m=32, stages=6, split_k=3)),
    (64, 2048, 384, 256, False, True, torch.float16, glk.WgmmaConfig(block_m=64, stages=4, split_k=4)),
    # the narrow launch (33-64 rows: 64-row x tiles in 4 stages)
    (48, 2560, 320, 128, True, True, torch.float16, glk.WgmmaConfig(block_m=64, stages=4, split_k=3)),
    (64, 1792, 200, -1, False, True, torch.bfloat16, glk.WgmmaConfig(block_m=64, stages=4, split_k=2)),
    # 128 weight rows a warpgroup in 64-deep K-tiles (QSERVE_W4A16_GLUON_TILE): groups of two K-tiles, split
    (200, 1536, 384, 128, True, True, torch.float16, glk.WgmmaConfig(block_n=128, block_k=64, split_k=3)),
    (96, 1024, 264, 64, False, False, torch.bfloat16, glk.WgmmaConfig(block_m=64, block_n=128, block_k=64, stages=4)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm90 GPU")
@pytest.mark.parametrize("m,k,n,group,asym,bias,dtype,cfg", GPU_CASES)
def test_w4a16_wgmma_gpu_matches_oracle(m, k, n, group, asym, bias, dtype, cfg) -> None:
    gen = torch.Generator().manual_seed(m * 7 + k + n)
    weight = _weight(k, n, group, asym, gen, device="cuda")
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()  # [M, K]
    b = torch.randn(n, generator=gen).to(dtype).cuda() if bias else None  # [N]
    ref = x.float() @ reference.dequantize(weight, torch.float32)  # [M, N]
    if b is not None:
        ref = ref + b.float()
    prepared = mma.prepare(weight)
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")  # [M, N] poisoned
        glk.w4a16_wgmma(x, prepared, b, config=cfg, out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < (3e-3 if dtype == torch.float16 else 2e-2), rel
        atol = (4e-3 if dtype == torch.float16 else 3e-2) * ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=1e-2 if dtype == torch.float16 else 5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm90 GPU")
def test_w4a16_wgmma_gpu_equals_the_triton_kernel_and_replays_in_a_graph() -> None:
    """Same weight, same x: the Gluon kernel against the Triton kernel's own table (at 512 rows: dense weight
    + cuBLAS; a config passed keeps ``w4a16_gemm`` off the Gluon kernel) within fp16 rounding, and the same
    output replayed from a CUDA graph."""
    gen = torch.Generator().manual_seed(5)
    weight = mma.prepare(_weight(5120, 1024, 128, False, gen, device="cuda"))
    x = (torch.randn(512, 5120, generator=gen) * 0.5).half().cuda()  # [M, K]
    theirs = mma.w4a16_gemm(x, weight, config=mma.select_config(weight, x.dtype, 512))
    ours = glk.w4a16_wgmma(x, weight)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2 * theirs.abs().max().item(), rtol=1e-2)
    # an output view TMA cannot address (it starts 2 bytes into a row): written through a fresh tile
    wide = torch.full((512, 1025), float("nan"), dtype=torch.float16, device="cuda")
    glk.w4a16_wgmma(x, weight, out=wide[:, 1:])
    assert torch.equal(wide[:, 1:], ours)
    out = torch.full_like(ours, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        glk.w4a16_wgmma(x, weight, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        glk.w4a16_wgmma(x, weight, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ours)


def _split_problem(seed: int, m: int, k: int, n: int, asym: bool) -> tuple:
    """A split-K case on the GPU: the MMA-layout weight, its zeroed counters (as ``quant_kernels.ops`` holds
    them), x ``[M, K]`` and the fp32 oracle ``[M, N]``."""
    gen = torch.Generator().manual_seed(seed)
    packed = _weight(k, n, 128, asym, gen, device="cuda")
    counters = torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda")
    x = (torch.randn(m, k, generator=gen) * 0.5).half().cuda()  # [M, K]
    return mma.prepare(packed), counters, x, x.float() @ reference.dequantize(packed, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm90 GPU")
def test_split_k_leaves_its_counters_at_zero_and_replays_in_a_graph() -> None:
    """Three shares of every tile through the weight's own counters (``quant_kernels.ops``): the counters are
    zero after each launch (the last share resets its tile's), a replayed graph writes the eager output
    again, and counters too few for the tiles are refused by name."""
    weight, counters, x, ref = _split_problem(9, 256, 3072, 640, True)
    cfg = glk.WgmmaConfig(split_k=3)
    eager = glk.w4a16_wgmma(x, weight, config=cfg, counters=counters)
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0
    torch.testing.assert_close(eager.float(), ref, atol=4e-3 * ref.abs().max().item(), rtol=1e-2)
    out = torch.full_like(eager, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        glk.w4a16_wgmma(x, weight, config=cfg, out=out, counters=counters)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        glk.w4a16_wgmma(x, weight, config=cfg, out=out, counters=counters)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, atol=2e-3 * ref.abs().max().item(), rtol=0)
        assert int(counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="needs int32 counters"):
        glk.w4a16_wgmma(x, weight, config=cfg, counters=counters[:3])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm90 GPU")
def test_narrow_dispatch_matches_the_triton_table(monkeypatch) -> None:
    """The narrow launch through the built-in dispatch at 48 and 64 rows: the Gluon kernel runs
    (its tiles leave the card idle: split), with the weight's counters left at zero, and its output matches
    the Triton table's launch of the same product."""
    weight, counters, x64, ref64 = _split_problem(13, 64, 5120, 1024, True)
    monkeypatch.delenv(mma.GLUON_NARROW_ENV, raising=False)
    monkeypatch.delenv(mma.GLUON_ENV, raising=False)
    ran = []
    real = glk.w4a16_wgmma
    monkeypatch.setattr(glk, "w4a16_wgmma", lambda *a, **kw: ran.append(kw["config"]) or real(*a, **kw))
    for m in (48, 64):
        x, ref = x64[:m].contiguous(), ref64[:m]
        ours = mma.w4a16_gemm(x, weight, counters=counters)
        theirs = mma.w4a16_gemm(x, weight, config=mma.select_config(weight, x.dtype, m), counters=counters)
        torch.cuda.synchronize()
        assert ran and ran[-1].split_k > 1 and ran[-1].block_m == 64, ran
        assert int(counters.abs().sum()) == 0
        torch.testing.assert_close(ours.float(), ref, atol=4e-3 * ref.abs().max().item(), rtol=1e-2)
        torch.testing.assert_close(ours.float(), theirs.float(), atol=4e-3 * ref.abs().max().item(), rtol=1e-2)
    assert len(ran) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm90 GPU")
def test_split_k_gives_the_same_bits_from_run_to_run() -> None:
    """The last share sums the partials in share order, so whichever share arrives last the output is the
    same bit for bit and matches the oracle (adding the others onto the last share's own, the launch before the
    twenty-second session, gave last-bit differences between runs with 3 or more shares: likely what failed
    the PDL chain test when every decode GEMM took 4-5 shares). Where the shares happen to arrive in one order
    every run, an arrival-order sum would pass too: 4 shares of 64 tiles (256 programs, more than one wave) to
    vary the order."""
    weight, counters, x, ref = _split_problem(21, 512, 5120, 1024, False)
    cfg = glk.WgmmaConfig(split_k=4)
    first = glk.w4a16_wgmma(x, weight, config=cfg, counters=counters)
    torch.testing.assert_close(first.float(), ref, atol=4e-3 * ref.abs().max().item(), rtol=1e-2)
    for _ in range(30):
        assert torch.equal(glk.w4a16_wgmma(x, weight, config=cfg, counters=counters), first)
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0


def test_compile_runs_in_a_fresh_process_without_a_gpu() -> None:
    """The module imports and compiles where no CUDA device exists (CI), with the interpreter switched off."""
    env = _fresh_env()
    code = "from quant_kernels import w4a16_wgmma_gluon as g; k = g.compile_for(90, g.WgmmaConfig()); print(k.metadata.shared)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = glk.WgmmaConfig()
    stage = cfg.block_m * cfg.block_k * 2 + cfg.block_n * cfg.block_k // 2  # bytes: fp16 x tile, 4-bit weights
    assert int(proc.stdout.split()[-1]) >= cfg.stages * stage
