"""The W4A16 MMA kernel keeps the dequantized weight tile out of shared memory (no GPU needed).

Compiles ``w4a16_mma_kernel`` for sm90 (wgmma) and sm86 (mma.sync) with ``triton.compile`` and a
``GPUTarget`` and counts the bytes each thread stores to shared memory (``st.shared`` in the PTX).
The x tile (the B operand) and the epilogue may use shared memory; a dequantized ``[BLOCK_N,
BLOCK_K]`` weight tile on its way into the A operand would add ``BLOCK_N*BLOCK_K*2/threads``
bytes. As a control, the same kernel built for a layout of the wrong k-width (so that the
compiler has to move the tile) must store at least half a tile more: a Triton upgrade that makes
both round-trip fails here, as does one where the control stops round-tripping (look again then).

The compiles run in one subprocess without TRITON_INTERPRET (the kernel tests' conftest sets it
on CPU machines, and interpreted functions cannot be compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# (id, arch, (block_m, block_n, block_k, warps, stages), group_tile, asym, act_order, dtype, bits)
CASES = [
    (arch, name, cfg, ng, asym, perm, dtype, bits)
    for arch in (90, 86)
    for name, cfg, ng, asym, perm, dtype, bits in [
        ("decode-sym", (16, 128, 128, 4, 3), 1, False, False, "fp16", 4),
        ("decode-asym-actorder-bf16", (16, 128, 128, 4, 3), 1, True, True, "bf16", 4),
        ("decode-g64-asym", (16, 128, 128, 4, 3), 2, True, False, "fp16", 4),
        ("batch-g32-actorder-bf16", (64, 128, 64, 4, 3), 2, False, True, "bf16", 4),
        ("batch-8bit", (64, 128, 64, 4, 3), 1, False, False, "fp16", 8),
    ]
]

_SCRIPT = r"""
import json, re, sys
from quant_kernels import w4a16_mma_triton as mma

def shared_store_bytes(ptx):
    return sum(int(m.group(1) or 1) * int(m.group(2)) // 8
               for m in re.finditer(r"\bst\.shared(?:::cta)?(?:\.v(\d))?\.b(\d+)", ptx))

out = []
for arch, name, (bm, bn, bk, w, st), ng, asym, perm, dtype, bits in json.loads(sys.argv[1]):
    cfg = mma.MmaConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
    kw = dict(group_tile=ng, asym=asym, act_order=perm, dtype=dtype, bits=bits)
    ptx = mma.compile_ptx(arch, cfg, **kw)
    control = mma.compile_ptx(arch, cfg, kwidth=4, **kw)
    out.append(dict(arch=arch, name=name, ours=shared_store_bytes(ptx), control=shared_store_bytes(control),
                    st_shared=len(re.findall(r"\bst\.shared", ptx)),
                    tensor_core=("wgmma.mma_async" in ptx) if arch == 90 else ("mma.sync" in ptx)))
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_stats() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        if "backend" in proc.stderr.lower() and "nvidia" in proc.stderr.lower():
            pytest.skip("this triton has no NVIDIA backend")
        raise AssertionError(f"PTX compile failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return {(r["arch"], r["name"]): r for r in json.loads(line[len("RESULT") :])}


@pytest.mark.parametrize("case", CASES, ids=[f"sm{c[0]}-{c[1]}" for c in CASES])
def test_dequantized_tile_not_in_shared_memory(case, ptx_stats) -> None:
    arch, name, (bm, bn, bk, warps, _), *_ = case
    r = ptx_stats[(arch, name)]
    assert r["tensor_core"], f"sm{arch} {name}: no {'wgmma' if arch == 90 else 'mma.sync'} in the PTX"
    tile_bytes = bn * bk * 2 // (32 * warps)
    print(
        f"sm{arch} {name}: {r['st_shared']} st.shared, {r['ours']} B/thread; control {r['control']}, tile {tile_bytes}"
    )
    assert r["ours"] + tile_bytes // 2 <= r["control"], (
        f"sm{arch} {name}: {r['ours']} B/thread stored to shared memory vs {r['control']} for a layout known to "
        f"round-trip (one tile = {tile_bytes} B): the dequantized tile goes through shared memory"
    )
    if bm == 16:  # decode: x tile and epilogue are small, so a tile would dominate
        assert r["ours"] < tile_bytes, f"sm{arch} {name}: {r['ours']} B/thread to shared memory >= one tile"
