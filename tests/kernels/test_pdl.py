"""Programmatic dependent launch (quant_kernels.pdl): when a launch opts in, and what the PDL
builds of the decode step's kernels do before their wait.

On CPU: the switch's logic, and the sm90 PTX of the W4A16 GEMM and two elementwise kernels
compiled with ``USE_PDL`` (``triton.compile`` with a ``GPUTarget``, in a subprocess without
TRITON_INTERPRET, as tests/kernels/test_w4a16_ptx.py does): ``griddepcontrol.wait`` comes before
every load of data an earlier kernel may write and before every store, and only the GEMM's L2
prefetch of its (read-only) weight tiles comes before it. On an sm90 GPU: a decode-layer chain
captured in a CUDA graph with PDL gives the same bits as plain launches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant_kernels import pdl

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_pdl_is_off_unless_asked_and_only_on_sm90(monkeypatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert not pdl.use_pdl(cuda)  # off by default
    assert pdl.launch_options(cuda) == {}
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.use_pdl(cuda)
    assert pdl.launch_options(cuda) == {"USE_PDL": True, "launch_pdl": True}
    assert not pdl.use_pdl(cuda, enabled=False)  # an explicit choice wins over the environment
    assert not pdl.use_pdl(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # Ada: no PDL
    assert not pdl.use_pdl(cuda)
    assert not pdl.use_pdl(cuda, enabled=True)
    monkeypatch.setenv(pdl.ENV, "sure")  # a typo is an error naming the variable, not a silent off
    with pytest.raises(ValueError, match=pdl.ENV):
        pdl.use_pdl(cuda)
    monkeypatch.setenv(pdl.ENV, "off")
    assert not pdl.use_pdl(cuda)
    monkeypatch.setattr(pdl, "_INTERPRET", True)  # the interpreter runs no PTX
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not pdl.use_pdl(cuda, enabled=True)


def test_moe_models_get_pdl_unless_the_user_chose(monkeypatch) -> None:
    """``prefer_for_moe``: a MoE model on sm90 turns the switch on where it is unset; a dense model, a
    device without PDL, or a user's own value (even "0") leave it alone."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_INTERPRET", False)
    monkeypatch.setattr(pdl.kdevice, "triton_serves", lambda device: device.type == "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    env: dict[str, str] = {}
    assert not pdl.prefer_for_moe(False, cuda, env) and env == {}
    assert pdl.prefer_for_moe(True, cuda, env) and env == {pdl.ENV: "1"}
    env = {pdl.ENV: "0"}
    assert not pdl.prefer_for_moe(True, cuda, env) and env == {pdl.ENV: "0"}
    env = {}
    assert not pdl.prefer_for_moe(True, torch.device("cpu"), env) and env == {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert not pdl.prefer_for_moe(True, cuda, env) and env == {}


_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quant_kernels import elementwise_triton as ew
from quant_kernels import w4a16_mma_triton as mma

def marks(kernel):
    lines = kernel.asm["ptx"].splitlines()
    def where(pattern):
        return [i for i, line in enumerate(lines) if re.search(pattern, line)]
    return {
        "wait": where(r"griddepcontrol\.wait"),
        "launch": where(r"griddepcontrol\.launch_dependents"),
        "prefetch": where(r"cp\.async\.bulk\.prefetch\.L2"),
        # any global load (ld.global, ld.relaxed.gpu.global, ...), cp.async and TMA; any global store or atomic
        "loads": where(r"\b(ld(\.\w+)*\.global|cp\.async\.(ca|cg)|cp\.async\.bulk\.tensor)"),
        "stores": where(r"\b((st|atom|red)(\.\w+)*\.global)"),
        "launch_pdl": bool(getattr(kernel.metadata, "launch_pdl", False)),
    }

def compile_plain(fn, signature, constants):
    return triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, launch_pdl=True))

out = {}
for name, cfg in [("gemm-decode", mma.MmaConfig(block_m=16, block_n=64, block_k=128, split_k=2, num_warps=4,
                                                 num_stages=4, max_regs=72)),
                  ("gemm-m64", mma.MmaConfig(block_m=64, block_n=128, block_k=128, split_k=2, num_warps=4, num_stages=3)),
                  ("gemm-stream-k", mma.MmaConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4,
                                                  stream_k=6))]:
    out[name] = marks(mma.compile_for(90, cfg, pdl=True))
    out[name + "-off"] = marks(mma.compile_for(90, cfg, pdl=False))
out["silu"] = marks(compile_plain(ew.silu_and_mul_kernel,
    {"GU": "*fp16", "OUT": "*fp16", "n_cols": "i32", "stride_row": "i32", "BLOCK": "constexpr", "USE_PDL": "constexpr"},
    {"BLOCK": 1024, "USE_PDL": True}))
sig = {"X": "*fp16", "R": "*fp16", "W": "*fp16", "OUT": "*fp16", "RES_OUT": "*fp16", "n1": "i32", "n_cols": "i32",
       "stride_x0": "i32", "stride_x1": "i32", "stride_r0": "i32", "stride_r1": "i32", "eps": "fp32",
       "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr", "USE_PDL": "constexpr"}
out["add_rms_norm"] = marks(compile_plain(ew.rms_norm_kernel, sig, {"HAS_RESIDUAL": True, "BLOCK": 8192, "USE_PDL": True}))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_marks() -> dict:
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["gemm-decode", "gemm-m64", "gemm-stream-k", "silu", "add_rms_norm"])
def test_pdl_build_waits_before_it_touches_the_stream(ptx_marks, name) -> None:
    m = ptx_marks[name]
    assert m["launch_pdl"], "the compiled kernel must carry launch_pdl (Triton sets the launch attribute from it)"
    assert len(m["wait"]) == 1 and len(m["launch"]) == 1, m
    wait = m["wait"][0]
    assert m["stores"] and min(m["stores"]) > wait, "a store before the wait may hit a buffer an earlier kernel reads"
    # x, the scales and everything else are read after the wait; before it only the GEMM's L2
    # prefetch of its weight tiles (read-only for the whole stream)
    assert m["loads"] and min(m["loads"]) > wait, m
    if name.startswith("gemm"):
        assert m["prefetch"] and max(m["prefetch"]) < wait, m
    else:
        assert not m["prefetch"]


@pytest.mark.parametrize("name", ["gemm-decode-off", "gemm-m64-off", "gemm-stream-k-off"])
def test_plain_build_has_no_pdl(ptx_marks, name) -> None:
    m = ptx_marks[name]
    assert not m["wait"] and not m["launch"] and not m["prefetch"] and not m["launch_pdl"]


SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (PDL)")
@pytest.mark.parametrize("m", [1, 16, 64, 200])
def test_pdl_decode_chain_in_a_cuda_graph_matches_plain_launches(monkeypatch, m) -> None:
    """add+norm -> gate_up GEMM -> SiLU*mul -> down GEMM -> add+norm, captured with every launch
    PDL-enabled and replayed three times, against the same chain launched plainly: the same
    bits (split-K included: the Triton kernel's last program sums the slots in order, and so does the Gluon
    kernel's last share, since the twenty-second session; at 64 rows the narrow launch and at 200 rows the
    down GEMM take the Gluon kernel's split)."""
    from quant_kernels import elementwise_triton as ew
    from quant_kernels import w4a16_mma_triton as mma
    from quant_kernels.layout import PackedQuantWeight, pack_codes

    gen = torch.Generator().manual_seed(m)

    def make_weight(k: int, n: int) -> PackedQuantWeight:
        codes = torch.randint(0, 16, (k, n), generator=gen)  # [K, N]
        scales = (torch.rand(k // 128, n, generator=gen) * 0.02 + 0.002).half()  # [G, N]
        return PackedQuantWeight(4, 128, pack_codes(codes, 4), scales, None, None).to("cuda")

    hidden, inter = 1024, 2816
    w_gu = mma.prepare(make_weight(hidden, 2 * inter))
    w_down = mma.prepare(make_weight(inter, hidden))
    counters = [
        torch.zeros(mma.num_split_counters(w.out_features), dtype=torch.int32, device="cuda") for w in (w_gu, w_down)
    ]
    norm_w = torch.rand(hidden, generator=gen).half().cuda()
    x = torch.randn(m, hidden, generator=gen).half().cuda()
    residual = torch.randn(m, hidden, generator=gen).half().cuda()

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        normed, res = ew.fused_add_rms_norm(x, residual, norm_w, 1e-6)
        act = ew.silu_and_mul(mma.w4a16_gemm(normed, w_gu, None, None, counters[0]))
        down = mma.w4a16_gemm(act, w_down, None, None, counters[1])
        return ew.fused_add_rms_norm(down, res, norm_w, 1e-6)

    monkeypatch.delenv(pdl.ENV, raising=False)
    want = chain()
    monkeypatch.setenv(pdl.ENV, "1")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # compile the PDL variants outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(3):
        got[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    eager = chain()  # PDL launches outside a graph too
    assert torch.equal(eager[0], want[0])
