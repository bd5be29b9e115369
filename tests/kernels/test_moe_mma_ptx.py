"""The MMA-operand MoE kernel keeps the dequantized weight tile out of shared memory (no GPU needed).

As tests/kernels/test_w4a16_ptx.py does for the dense kernel: ``moe_mma_kernel`` (gate_up with its
SiLU-and-mul epilogue, down with the routing weight; the split-K cases: ``moe_mma_split_kernel``) is
compiled for sm90 (wgmma) and a consumer card (mma.sync, with the k-width ``repack.mma_kwidth`` picks
for it under the installed Triton), and the bytes each thread stores to shared memory are counted
(``st.shared`` and ``stmatrix``). The gathered activation tile (the B operand) and the epilogue may
go through shared memory; a ``[BLOCK_N, BLOCK_K]`` dequantized weight tile on its way into the A
operand would add ``BLOCK_N * BLOCK_K * 2 / threads`` bytes, over that budget. The dense test's
control (a wrong k-width layout that the sm86 compiler round-trips), built here for the gate_up
kernel too, shows that the count catches it.

The compiles run in a subprocess without TRITON_INTERPRET (the conftest sets it on CPU machines).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.result_scripts import run_result_script

pytest.importorskip("triton")


# (arch, name, (block_m, block_n, block_k, warps, stages[, split_k]), silu_mul, asym, dtype, group_size)
CASES = [
    (arch, name, cfg, silu, asym, dtype, group)
    for arch in (90, 86)
    for name, cfg, silu, asym, dtype, group in [
        ("decode-gate-up", (16, 64, 128, 4, 3), True, False, "fp16", 128),
        ("decode-down-asym-bf16", (16, 64, 128, 4, 3), False, True, "bf16", 128),
        ("prefill-gate-up-asym", (64, 128, 128, 4, 3), True, True, "fp16", 128),
        ("prefill-down-g32-bf16", (64, 128, 128, 4, 3), False, False, "bf16", 32),
        # split-K (the sixth field): the same K loop, partials to the workspace / atomics after it.
        # Symmetric only: with zeros at this decode tile the count is 160 B/thread on sm90 and sm86 for
        # the split down launch, and for the gate_up launch split or not (unsplit gate_up asym at
        # 16 x 64 is not among the cases above either); whether the weight tile really round-trips
        # there is for the SASS / a GPU profile to say.
        ("decode-gate-up-split4", (16, 64, 128, 4, 3, 4), True, False, "fp16", 128),
        ("decode-down-split4-bf16", (16, 64, 128, 4, 3, 4), False, False, "bf16", 128),
    ]
]

_SCRIPT = r"""
import json, re, sys
from quant_kernels import moe_mma_triton as moe_mma
from quant_kernels.repack import mma_kwidth
from tests.helpers.result_scripts import shared_store_bytes

out = []
for arch, name, (bm, bn, bk, w, st, *sk), silu, asym, dtype, group in json.loads(sys.argv[1]):
    cfg = moe_mma.MoEMmaConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st, split_k=sk[0] if sk else 1)
    kwidth = mma_kwidth((arch // 10, arch % 10))
    ptx = moe_mma.compile_for(arch, cfg, silu, dtype, asym, kwidth, group).asm["ptx"]
    # control: the layout of the other k-width, which the sm86 compiler round-trips through shared memory
    control = moe_mma.compile_for(arch, cfg, silu, dtype, asym, 6 - kwidth, group).asm["ptx"] if (arch, name) == (86, "decode-gate-up") else ""
    out.append(dict(arch=arch, name=name, ours=shared_store_bytes(ptx), control=shared_store_bytes(control),
                    st_shared=len(re.findall(r"\bst\.shared", ptx)),
                    tensor_core=("wgmma.mma_async" in ptx) if arch == 90 else ("mma.sync" in ptx)))
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_stats() -> dict:
    return {(r["arch"], r["name"]): r for r in run_result_script(_SCRIPT, json.dumps(CASES), timeout=900)}


def allowed_bytes(bm: int, bn: int, bk: int, warps: int) -> int:
    """The activation tile (B operand), the epilogue tile and a few scalars, per thread."""
    return (bm * bk * 2 + bm * bn * 2) // (32 * warps) + 32


@pytest.mark.parametrize("case", CASES, ids=[f"sm{c[0]}-{c[1]}" for c in CASES])
def test_dequantized_tile_not_in_shared_memory(case, ptx_stats) -> None:
    arch, name, (bm, bn, bk, warps, *_), *_ = case
    r = ptx_stats[(arch, name)]
    assert r["tensor_core"], f"sm{arch} {name}: no {'wgmma' if arch == 90 else 'mma.sync'} in the PTX"
    tile_bytes = bn * bk * 2 // (32 * warps)
    allowed = allowed_bytes(bm, bn, bk, warps)
    print(
        f"sm{arch} {name}: {r['st_shared']} st.shared, {r['ours']} B/thread (allowed {allowed}, one tile {tile_bytes})"
    )
    assert r["ours"] <= allowed, (
        f"sm{arch} {name}: {r['ours']} B/thread stored to shared memory, more than the activation tile and the "
        f"epilogue ({allowed}): the dequantized weight tile ({tile_bytes} B/thread) goes through shared memory"
    )


def test_the_check_sees_a_round_trip(ptx_stats) -> None:
    """The decode gate_up kernel built for a layout of the wrong k-width makes sm86's compiler move the
    weight tile through shared memory, and the count above catches it (so that check can fail)."""
    r = ptx_stats[(86, "decode-gate-up")]
    assert r["control"] > allowed_bytes(16, 64, 128, 4), (
        f"the wrong-layout control stored only {r['control']} B/thread: this Triton no longer round-trips it "
        "through shared memory, so re-check what the test above can detect"
    )


_CAST_PDL_SCRIPT = r"""
import json, re, sys
from quant_kernels import moe_mma_triton as moe_mma
from quant_kernels.repack import mma_kwidth

out = []
for arch, silu, cast, pdl in json.loads(sys.argv[1]):
    cfg = moe_mma.MoEMmaConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=4)
    ptx = moe_mma.compile_for(arch, cfg, silu, "bf16", False, mma_kwidth((arch // 10, arch % 10)), 128,
                              cast=cast, pdl=pdl).asm["ptx"]
    out.append(dict(arch=arch, silu=silu, cast=cast, pdl=pdl, wait="griddepcontrol.wait" in ptx,
                    trigger="griddepcontrol.launch_dependents" in ptx, prefetch="cp.async.bulk.prefetch.L2" in ptx,
                    cvt_bf16=len(re.findall(r"cvt\.rn\.bf16", ptx)), atoms=len(re.findall(r"\batom\.", ptx))))
print("RESULT" + json.dumps(out))
"""


def test_fused_cast_and_pdl_launches_compile() -> None:
    """The split-K launches with QSERVE_MOE_FUSED_CAST=1 (down: the column tile's last program casts, one
    more counter atomic) and QSERVE_ENABLE_PDL=1 (sm90: the wait and the trigger in both launches, the
    expert-tile prefetch in down's only, gate_up's experts come from the launch right before it) compile
    for sm90 and sm86 (cast only: no PDL below sm90), with the instructions that make them what they are."""
    cases = [
        (90, False, True, True), (90, True, False, True), (90, False, False, False), (86, False, True, False),
        (86, False, False, False),
    ]  # fmt: skip
    got = {
        (r["arch"], r["silu"], r["cast"], r["pdl"]): r
        for r in run_result_script(_CAST_PDL_SCRIPT, json.dumps(cases), timeout=600)
    }
    down_cast_pdl, gate_up_pdl, down_plain, down_cast_86, down_plain_86 = (got[tuple(c)] for c in cases)
    assert down_cast_pdl["wait"] and down_cast_pdl["trigger"] and down_cast_pdl["prefetch"]
    assert gate_up_pdl["wait"] and gate_up_pdl["trigger"] and not gate_up_pdl["prefetch"]
    assert not (down_plain["wait"] or down_plain["prefetch"])
    # the cast's own atomics (the counter's add and reset) and its bf16 stores come on top of the plain launch's
    for cast, plain in ((down_cast_pdl, down_plain), (down_cast_86, down_plain_86)):
        assert cast["atoms"] >= plain["atoms"] + 2, (cast, plain)
        assert cast["cvt_bf16"] > plain["cvt_bf16"], (cast, plain)
