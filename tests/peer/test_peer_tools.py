"""Opt-in peer checks: qserve vs the real GPTQModel / AutoAWQ / llm-compressor, both directions.

Knows: which env vars name the tool venvs' pythons (``QSERVE_PEER_GPTQMODEL_PY``,
``QSERVE_PEER_AWQ_PY``, ``QSERVE_PEER_LLMC_PY``; see tests/peer/README.md), how to drive the
scripts in tests/peer/scripts/ through them, and the tolerances. Each test skips when its env var is
absent; CI deselects the ``peer`` marker (pyproject addopts). Run with ``-m peer``.

Tolerances: qserve and the formula oracle (tests/peer/formula.py) both run fp32, so they must agree to
1e-4. A tool's fp32 dequant path (llm-compressor's decompression, AutoAWQ ``dequantize_gemm``) must
agree with qserve to 1e-4 as well. GPTQModel's torch kernel and AutoAWQ's WQLinear_GEMM only run
fp16 (activations and/or dequantized weights rounded to fp16), so against those we allow 2e-2 — a
wrong zero or group index moves logprobs by far more than that (see the sanity check on the fp16
base model, which every quantized checkpoint must differ from by more than 5e-2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.peer.compare import max_diff_logits, max_diff_qserve, qserve_prompt_logprobs
from tests.peer.formula import formula_logits

pytestmark = pytest.mark.peer

SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXACT = 1e-4
FP16_TOOL = 2e-2
GROUP = 32


def _tool_python(var: str) -> str:
    python = os.environ.get(var)
    if not python:
        pytest.skip(f"{var} is not set (path to the tool venv's python; see tests/peer/README.md)")
    if not Path(python).is_file():
        pytest.fail(f"{var}={python!r} does not exist")
    return python


def _run(python: str, script: str, *args: str) -> None:
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        ["nice", "-n", "10", python, str(SCRIPTS / script), *args], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0 or "PEER_RESULT" not in proc.stdout:
        pytest.fail(
            f"{script} {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base_model(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"base-{request.param}") / "model"
    subprocess.run([sys.executable, str(SCRIPTS / "make_tiny.py"), str(out), request.param], check=True)
    return out


def _load_ref(path: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    ref = torch.load(str(path))
    return ref["prompts"], ref["logits"]


def _check_tool_checkpoint(ckpt: Path, base: Path, exact_refs: list[str], fp16_refs: list[str]) -> dict[str, float]:
    """qserve vs formula (1e-4), vs the tool's fp32 references (1e-4) and fp16 ones (2e-2)."""
    prompts, _ = _load_ref(ckpt / (exact_refs + fp16_refs)[0])
    qs = qserve_prompt_logprobs(ckpt, prompts)
    # GPTQ v1 zeros: whole-word reading (GPTQModel's inverse, formats.md §2.4); the per-nibble
    # "+1" reading differs only where a zero of 0 underflowed, which is reported, not asserted.
    formula = formula_logits(ckpt, prompts, "word")
    report = {"qserve_vs_formula": max_diff_qserve(qs, formula)}
    report["formula_word_vs_nibble"] = max_diff_logits(formula, formula_logits(ckpt, prompts, "nibble"))
    for name in exact_refs + fp16_refs:
        report[f"qserve_vs_{name}"] = max_diff_qserve(qs, _load_ref(ckpt / name)[1])
    # Sanity: the quantization must be visible, or the comparison proves nothing.
    base_logits = formula_logits_fp(base, prompts)
    report["qserve_vs_fp16_base"] = max_diff_qserve(qs, base_logits)
    print(json.dumps({str(ckpt): report}))
    assert report["qserve_vs_formula"] < EXACT, report
    for name in exact_refs:
        assert report[f"qserve_vs_{name}"] < EXACT, report
    for name in fp16_refs:
        assert report[f"qserve_vs_{name}"] < FP16_TOOL, report
    assert report["qserve_vs_fp16_base"] > 5e-2, report
    return report


def formula_logits_fp(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in prompts]


# ------------------------------------------------------------------------------------------------
# Tool → qserve
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sym", ["asym", "sym"])
def test_gptqmodel_checkpoint_loads_in_qserve(base_model, tmp_path, sym) -> None:
    python = _tool_python("QSERVE_PEER_GPTQMODEL_PY")
    ckpt = tmp_path / f"gptqmodel-{sym}"
    _run(python, "gptqmodel_tool.py", "quantize", str(base_model), str(ckpt), str(GROUP), sym)
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is True and qc["sym"] is (sym == "sym") and qc["format"] == "gptq"
    # GPTQModel's dequantize_weight runs in fp16, hence its "dequant" reference is fp16-rounded too.
    _check_tool_checkpoint(ckpt, base_model, [], ["ref_logits.pt", "ref_logits_dequant.pt"])


def test_autoawq_checkpoint_loads_in_qserve(base_model, tmp_path) -> None:
    python = _tool_python("QSERVE_PEER_AWQ_PY")
    ckpt = tmp_path / "autoawq"
    _run(python, "awq_tool.py", "quantize", str(base_model), str(ckpt), str(GROUP))
    _run(python, "awq_tool.py", "logits", str(ckpt), str(ckpt / "ref_logits_dequant.pt"), "--dequant")
    _check_tool_checkpoint(ckpt, base_model, ["ref_logits_dequant.pt"], ["ref_logits.pt", "ref_logits_in_memory.pt"])


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "g32-sym", "g32-asym"])
def test_llmcompressor_checkpoint_loads_in_qserve(base_model, tmp_path, scheme) -> None:
    python = _tool_python("QSERVE_PEER_LLMC_PY")
    ckpt = tmp_path / f"llmc-{scheme}"
    _run(python, "llmc_tool.py", "quantize", str(base_model), str(ckpt), scheme)
    _check_tool_checkpoint(ckpt, base_model, ["ref_logits_reload.pt"], [])


# ------------------------------------------------------------------------------------------------
# qserve → tool
# ------------------------------------------------------------------------------------------------


def _qserve_quantize(base: Path, dst: Path, *args: str) -> None:
    qserve = Path(sys.executable).with_name("qserve")
    cmd = [str(qserve), "quantize", str(base), str(dst), "--group-size", str(GROUP), "--calib", str(base / "calib.txt")]
    cmd += ["--num-samples", "8", "--seq-len", "64", "--device", "cpu", *args]
    subprocess.run(["nice", "-n", "10", *cmd], check=True, capture_output=True)


@pytest.mark.parametrize("extra", [("--desc-act",), ("--desc-act", "--asym")], ids=["sym", "asym"])
def test_qserve_gptq_output_loads_in_gptqmodel(base_model, tmp_path, extra) -> None:
    python = _tool_python("QSERVE_PEER_GPTQMODEL_PY")
    ckpt = tmp_path / "qserve-gptq"
    _qserve_quantize(base_model, ckpt, "--method", "gptq", *extra)
    _run(python, "gptqmodel_tool.py", "logits", str(ckpt), str(ckpt / "gptqmodel_logits.pt"))
    _check_tool_checkpoint(ckpt, base_model, [], ["gptqmodel_logits.pt", "gptqmodel_logits_dequant.pt"])


def test_qserve_awq_output_loads_in_autoawq(base_model, tmp_path) -> None:
    python = _tool_python("QSERVE_PEER_AWQ_PY")
    ckpt = tmp_path / "qserve-awq"
    _qserve_quantize(base_model, ckpt, "--method", "awq")
    _run(python, "awq_tool.py", "logits", str(ckpt), str(ckpt / "awq_logits.pt"))
    _run(python, "awq_tool.py", "logits", str(ckpt), str(ckpt / "awq_logits_dequant.pt"), "--dequant")
    _check_tool_checkpoint(ckpt, base_model, ["awq_logits_dequant.pt"], ["awq_logits.pt"])
