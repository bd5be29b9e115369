"""The W4A16 MMA kernel keeps the dequantized weight tile out of shared memory (no GPU needed).

Compiles ``w4a16_mma_kernel`` for sm90 (wgmma) and sm86 (mma.sync) with ``triton.compile`` and a
``GPUTarget`` and counts the bytes each thread stores to shared memory (``st.shared`` and
``stmatrix`` in the PTX; pointers and strides specialized as the JIT does for aligned shapes).
The x tile (the B operand) and the epilogue may use shared memory; a dequantized ``[BLOCK_N,
BLOCK_K]`` weight tile on its way into the A operand would add ``BLOCK_N*BLOCK_K*2/threads``
bytes, over the budget of the x tile plus the epilogue. Each arch is compiled with the k-width
``quant_kernels.repack.mma_kwidth`` picks for it under the installed Triton (sm86: 4 before Triton
3.8, 2 from 3.8 on). A control (the decode kernel built for the other k-width, which sm86's
compiler round-trips through shared memory) shows that the count catches it.

A second check reads the compiled kernel's shared-memory size against the same kernel built with
one stage: the packed weight tiles must stay software-pipelined (cp.async into buffers).

The compiles run in one subprocess without TRITON_INTERPRET (the kernel tests' conftest sets it
on CPU machines, and interpreted functions cannot be compiled).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.result_scripts import run_result_script, script_env

pytest.importorskip("triton")


# (arch, id, (block_m, block_n, block_k, warps, stages[, scale_w[, stream_k]]), group_tile, asym, act_order, dtype, bits)
CASES = [
    (arch, name, cfg, ng, asym, perm, dtype, bits)
    for arch in (90, 86)
    for name, cfg, ng, asym, perm, dtype, bits in [
        ("decode-sym", (16, 128, 128, 4, 3), 1, False, False, "fp16", 4),
        ("decode-asym-actorder-bf16", (16, 128, 128, 4, 3), 1, True, True, "bf16", 4),
        ("decode-g64-asym", (16, 128, 128, 4, 3), 2, True, False, "fp16", 4),
        ("batch-g32-actorder-bf16", (64, 128, 64, 4, 3), 2, False, True, "bf16", 4),
        ("batch-8bit-scale-on-weights", (64, 128, 64, 4, 3, True), 1, False, False, "fp16", 8),
        ("decode-stream-k", (16, 64, 128, 4, 4, False, 6), 1, False, False, "fp16", 4),
        ("batch-stream-k-g64-asym", (64, 128, 128, 4, 3, False, 2), 2, True, False, "fp16", 4),
    ]
]

_SCRIPT = r"""
import dataclasses, json, re, sys
from quant_kernels import w4a16_mma_triton as mma
from quant_kernels.repack import mma_kwidth
from tests.helpers.result_scripts import shared_store_bytes

out = []
for arch, name, (bm, bn, bk, w, st, *opt), ng, asym, perm, dtype, bits in json.loads(sys.argv[1]):
    sw, sk = (opt + [False, 0])[:2]
    cfg = mma.MmaConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st, scale_w=bool(sw), stream_k=sk)
    kw = dict(group_tile=ng, asym=asym, act_order=perm, dtype=dtype, bits=bits)
    kwidth = mma_kwidth((arch // 10, arch % 10))  # what a device of this arch gets at load time
    compiled = mma.compile_for(arch, cfg, kwidth=kwidth, **kw)
    ptx = compiled.asm["ptx"]
    # control: the other k-width, which this Triton round-trips through shared memory on sm86
    control = mma.compile_ptx(arch, cfg, kwidth=6 - kwidth, **kw) if (arch, name) == (86, "decode-sym") else ""
    # control for the buffering check: the same kernel without software pipelining
    unbuffered = mma.compile_for(arch, dataclasses.replace(cfg, num_stages=1), kwidth=kwidth, **kw).metadata.shared
    out.append(dict(arch=arch, name=name, ours=shared_store_bytes(ptx), control=shared_store_bytes(control),
                    shared=compiled.metadata.shared, cp_async=len(re.findall(r"\bcp\.async\.cg", ptx)),
                    unbuffered=unbuffered,
                    st_shared=len(re.findall(r"\bst\.shared", ptx)),
                    tensor_core=("wgmma.mma_async" in ptx) if arch == 90 else ("mma.sync" in ptx)))
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_stats() -> dict:
    return {(r["arch"], r["name"]): r for r in run_result_script(_SCRIPT, json.dumps(CASES))}


def allowed_bytes(bm: int, bn: int, bk: int, warps: int, epilogues: int = 1) -> int:
    """What may go through shared memory per thread: the x tile (B operand; act-order gathers it
    with plain loads), the fp16 epilogue tile (twice in the stream-K kernel: its direct write and
    its workspace write are both in the code), and a few scalars."""
    threads = 32 * warps
    return (bm * bk * 2 + epilogues * bm * bn * 2) // threads + 32


@pytest.mark.parametrize("case", CASES, ids=[f"sm{c[0]}-{c[1]}" for c in CASES])
def test_dequantized_tile_not_in_shared_memory(case, ptx_stats) -> None:
    arch, name, (bm, bn, bk, warps, _, *opt), *_ = case
    r = ptx_stats[(arch, name)]
    assert r["tensor_core"], f"sm{arch} {name}: no {'wgmma' if arch == 90 else 'mma.sync'} in the PTX"
    tile_bytes = bn * bk * 2 // (32 * warps)
    allowed = allowed_bytes(bm, bn, bk, warps, epilogues=2 if (opt + [False, 0])[1] else 1)
    print(
        f"sm{arch} {name}: {r['st_shared']} st.shared, {r['ours']} B/thread (allowed {allowed}, one tile {tile_bytes})"
    )
    assert r["ours"] <= allowed, (
        f"sm{arch} {name}: {r['ours']} B/thread stored to shared memory, more than the x tile and the epilogue "
        f"({allowed}): the dequantized weight tile ({tile_bytes} B/thread) goes through shared memory"
    )


def test_the_check_sees_a_round_trip(ptx_stats) -> None:
    """The same decode kernel built for a layout of the wrong k-width makes sm86's compiler move the
    tile through shared memory, and the byte count above catches it (so the check can fail)."""
    r = ptx_stats[(86, "decode-sym")]
    bm, bn, bk, warps = 16, 128, 128, 4
    assert r["control"] > allowed_bytes(bm, bn, bk, warps), (
        f"the wrong-layout control stored only {r['control']} B/thread: this Triton no longer round-trips it "
        "through shared memory, so re-check what the test above can detect"
    )


@pytest.mark.parametrize("case", CASES, ids=[f"sm{c[0]}-{c[1]}" for c in CASES])
def test_weight_tiles_are_multi_buffered(case, ptx_stats) -> None:
    """The packed weight tiles (raw bytes, not the dequantized tile) reach shared memory through the
    pipeliner's cp.async buffers: the kernel holds at least one weight tile more in shared memory
    than the same kernel compiled with one stage (no pipelining; shared memory is otherwise reused
    across phases, so the difference, not the total, is what the buffers add). Loading the group
    parameters two K-tiles ahead once made Triton 3.6 drop the buffering (decode kernel: 4 KB of
    shared memory, the same as with one stage), which this catches."""
    arch, name, (bm, bn, bk, warps, stages, *_), ng, asym, perm, dtype, bits = case
    r = ptx_stats[(arch, name)]
    tile_bytes = bn * bk * bits // 8  # the packed weight tile of one stage
    assert r["cp_async"] > 0, f"sm{arch} {name}: no cp.async in the PTX: the tiles are not pipelined"
    assert r["shared"] - r["unbuffered"] >= tile_bytes, (
        f"sm{arch} {name}: {r['shared']} B of shared memory against {r['unbuffered']} B with one stage: "
        f"not one buffered weight tile ({tile_bytes} B) more; the weight loads are no longer pipelined"
    )


_PROXY_SCRIPT = r"""
import json
from quant_kernels import w4a16_mma_triton as mma
from quant_kernels.repack import mma_kwidth

def body(ptx):  # the code, without the target and PTX version lines
    return [ln for ln in ptx.splitlines() if not ln.startswith((".target", ".version"))]

cfg = mma.MmaConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
kw = dict(kwidth=mma_kwidth((8, 6)), group_tile=1, asym=True, act_order=False, dtype="fp16", bits=4)
sm90 = mma.compile_for(90, cfg, **kw).asm["ptx"]
sm86 = mma.compile_for(86, cfg, **kw).asm["ptx"]
print("RESULT" + json.dumps(dict(same=body(sm90) == body(sm86), wgmma="wgmma.mma_async" in sm90,
                                 mma_sync="mma.sync" in sm90, lines=len(body(sm90)))))
"""


def test_ampere_proxy_compiles_the_sm86_code_for_sm90() -> None:
    """``bench/kernels.py --ampere-proxy`` times the users' (sm86 / sm89) code path on the H200: with
    Triton's ``DISABLE_MMA_V3=1`` an sm90 compile of the kernel, given the Ampere operand layout,
    must be the sm86 compile's PTX line for line (mma.sync, no wgmma). Seen with Triton 3.6 and 3.8;
    if a Triton upgrade drops the variable or changes the code, the proxy no longer says anything."""
    r = run_result_script(_PROXY_SCRIPT, env=script_env() | {"DISABLE_MMA_V3": "1"})
    assert r["mma_sync"] and not r["wgmma"], f"the proxy's sm90 compile is not the mma.sync code: {r}"
    assert r["same"], f"the proxy's sm90 PTX differs from the sm86 compile's ({r['lines']} lines)"


_AMPERE_TABLE_SCRIPT = r"""
import json
from quant_kernels import w4a16_mma_triton as mma
from quant_kernels.repack import mma_kwidth

out = []
for m in (40, 100):  # the table's two MMA rules (33-64 and 65-128 rows)
    for arch, asym, dtype in ((86, False, "fp16"), (86, True, "fp16"), (89, True, "bf16")):
        cfg = mma.fit_shared(mma.ampere_config(m, 5120, 7168, 128), 99 * 1024, asym)
        compiled = mma.compile_for(arch, cfg, kwidth=mma_kwidth((8, arch % 10)), asym=asym, dtype=dtype)
        out.append(dict(m=m, arch=arch, asym=asym, cfg=cfg.short(), shared=compiled.metadata.shared,
                        mma_sync="mma.sync" in compiled.asm["ptx"]))
print("RESULT" + json.dumps(out))
"""


def test_ampere_table_launches_compile_within_sm86_shared_memory() -> None:
    """The opt-in Ampere table's stream-K launches (QSERVE_W4A16_AMPERE_TABLE=1), fitted as the
    launcher fits them, compile for sm86 and sm89 with mma.sync inside a block's 99 KB."""
    rows = run_result_script(_AMPERE_TABLE_SCRIPT)
    assert {r["cfg"].split()[3] for r in rows} == {"sk2", "sk1"}, rows  # the stream-K grids were compiled
    for r in rows:
        assert r["mma_sync"] and r["shared"] <= 99 * 1024, r
