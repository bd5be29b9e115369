"""``qserve quantize`` on tiny random models, then load the result with ``LLM`` and generate."""

from __future__ import annotations

import json

import pytest
import torch

from qserve import LLM, SamplingParams
from tests.quantize.conftest import run_command, tiny_checkpoint


@pytest.mark.parametrize(
    ("arch", "method", "extra"),
    [
        ("LlamaForCausalLM", "gptq", ["--desc-act"]),
        ("Qwen2ForCausalLM", "gptq", ["--asym"]),
        ("Qwen3ForCausalLM", "gptq", ["--bits", "8"]),
        ("LlamaForCausalLM", "awq", []),
        ("Qwen2ForCausalLM", "awq", []),
        ("MistralForCausalLM", "awq", []),
        ("LlamaForCausalLM", "rtn", []),
    ],
)
def test_quantize_then_generate(tiny_root, tmp_path, calib_file, capsys, arch, method, extra) -> None:
    src = tiny_checkpoint(tiny_root, arch)
    dst = tmp_path / method
    argv = [str(src), str(dst), "--method", method, "--group-size", "32", "--device", "cpu", *extra]
    if method != "rtn":
        argv += ["--calib", str(calib_file), "--num-samples", "4", "--seq-len", "64"]
    assert run_command("quantize", argv) == 0
    assert "wrote" in capsys.readouterr().out

    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == ("awq" if method == "awq" else "gptq")

    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0)
    quantized = LLM(str(dst), device="cpu", dtype="float32").generate(["Hello world, the"], params)[0]
    reference = LLM(str(src), device="cpu", dtype="float32").generate(["Hello world, the"], params)[0]
    assert len(quantized.outputs[0].token_ids) == 6
    # The 4-bit model stays close to the fp16 one on the prompt's log-probabilities.
    ids = quantized.prompt_token_ids
    lp_q = torch.tensor([quantized.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    lp_r = torch.tensor([reference.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    assert float((lp_q - lp_r).abs().mean()) < 0.5


def test_quantize_refuses_unsupported_settings(tmp_path, llama_ckpt, calib_file, capsys) -> None:
    base = [str(llama_ckpt), str(tmp_path / "x"), "--calib", str(calib_file)]
    with pytest.raises(ValueError, match=r"--bits 3 is not supported by gptq; supported: 4, 8"):
        run_command("quantize", [*base, "--bits", "3"])
    with pytest.raises(ValueError, match=r"--bits 8 is not supported by awq; supported: 4"):
        run_command("quantize", [*base, "--method", "awq", "--bits", "8"])
    with pytest.raises(ValueError, match=r"--method 'hqq' is not supported; supported: gptq, awq, rtn"):
        run_command("quantize", [*base, "--method", "hqq"])
    with pytest.raises(ValueError, match=r"--sym is not available for awq"):
        run_command("quantize", [*base, "--method", "awq", "--sym"])


def test_quantize_refuses_a_quantized_source_and_a_full_destination(tmp_path, llama_ckpt) -> None:
    out = tmp_path / "rtn"
    assert run_command("quantize", [str(llama_ckpt), str(out), "--method", "rtn", "--group-size", "32"]) == 0
    with pytest.raises(ValueError, match=r"already quantized"):
        run_command("quantize", [str(out), str(tmp_path / "again"), "--method", "rtn"])
    with pytest.raises(ValueError, match=r"is not empty"):
        run_command("quantize", [str(llama_ckpt), str(out), "--method", "rtn", "--group-size", "32"])
