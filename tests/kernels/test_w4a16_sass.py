"""No register of an in-flight wgmma's A operand is overwritten in the W4A16 MMA kernel's sm90 SASS.

The kernel feeds the dequantized weight tile to wgmma from registers. A wgmma reads those
registers while it runs, until the ``WARPGROUP.DEPBAR`` that retires its group. When Triton chained
the MMAs on one accumulator (``tl.dot(a, b, acc)`` in the scales-on-weights path), its pipeliner
left the last groups of an iteration in flight across the loop's back edge, and ptxas reused their
A registers for the next tile's addresses and dequant: the race behind the wrong outputs the H200
showed at M 65-256 (bench/RESULTS.md). This test compiles the kernel for sm90 (no GPU: Triton's
own ptxas and nvdisasm), follows every loop body twice (pending groups carry over the back edge)
and fails on any write to a register an unretired HGMMA reads as A.

Configs: the built-in dispatch for Qwen2.5-14B's four layer shapes at every M bucket the fused
kernel serves, for group sizes 128, 64, 32 and per-column, the stream-K sweep candidates, plus
asymmetric + act-order and bf16 samples. The checker itself is tested on a hand-written SASS fragment (a hazard it must find, and
the same fragment with the wait in place).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.sass_hazards import a_operand_hazards

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_FRAGMENT = """
.L_x_1:
        /*0100*/                   LOP3.LUT R40, R4, 0xf000f, R7, 0xea, !PT ;
        /*0110*/                   WARPGROUP.ARRIVE ;
        /*0120*/                   HGMMA.64x128x16.F32 R88, R40, gdesc[UR16], R88 ;
        /*0130*/                   HGMMA.64x128x16.F32 R24, R44, gdesc[UR16], R24, gsb0 ;
        /*0140*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0150*/               @P0 BRA `(.L_x_1) ;
"""


def test_checker_finds_a_register_rewritten_under_an_inflight_wgmma() -> None:
    seen, found = a_operand_hazards(_FRAGMENT)
    assert seen == 2 and len(found) == 1 and "R40" in found[0]  # the LOP3 of the next lap
    seen, found = a_operand_hazards(_FRAGMENT.replace("0x1 ;", "0x0 ;"))  # retired before the back edge
    assert seen == 2 and found == []


_SCRIPT = r"""
import dataclasses, json, os, subprocess, sys, tempfile
import triton
from quant_kernels import w4a16_mma_triton as mma

nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
shapes = {"qkv": (5120, 7168), "o": (5120, 5120), "gate_up": (5120, 27648), "down": (13824, 5120)}
cases = {}
for name, (k, n) in shapes.items():
    for m in (1, 2, 32, 64, 128, 256):
        for g in (128, 64, 32, -1):
            group = k if g == -1 else g
            cfg = mma.default_config(m, k, n, group)
            if cfg.kind != "mma":
                continue
            ng = 1 if (group % cfg.block_k == 0 or group >= k) else cfg.block_k // group
            cases.setdefault((cfg, ng, False, False, "fp16"), f"{name} M={m} g{g}")
for m in (1, 64, 128):  # the stream-K grid (sweep candidates, not in the dispatch yet)
    for cfg in mma.candidate_configs(m, 5120, 5120, 64):
        if cfg.stream_k:
            cases.setdefault((cfg, cfg.block_k // 64, False, False, "fp16"), f"stream-K M={m} g64")
for (cfg, ng, *_), label in list(cases.items())[:4]:
    cases.setdefault((cfg, ng, True, True, "bf16"), label + " asym act-order bf16")
out = []
with tempfile.TemporaryDirectory() as tmp:
    for (cfg, ng, asym, perm, dtype), label in cases.items():
        if asym or perm:
            cfg = dataclasses.replace(cfg, max_regs=0)  # what select_config does for them
        kernel = mma.compile_for(90, cfg, group_tile=ng, asym=asym, act_order=perm, dtype=dtype)
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        out.append({"label": label, "cfg": cfg.short(), "ng": ng, "sass": sass})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        pytest.skip("this Triton ships no nvdisasm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))  # the same Triton as here
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dispatched_configs_never_rewrite_inflight_wgmma_operands(compiled) -> None:
    assert len(compiled) >= 10
    bad = []
    for case in compiled:
        seen, found = a_operand_hazards(case["sass"])
        assert seen > 0, f"{case['label']}: no register-A HGMMA in a loop: the SASS parse is stale"
        if found:
            bad.append(f"{case['label']} [{case['cfg']}, {case['ng']} groups/tile]: {len(found)}, first {found[0]}")
    assert not bad, "\n".join(bad)
