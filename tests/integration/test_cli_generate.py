"""``qserve generate`` streams the same text the offline API produces."""

from __future__ import annotations

from qserve import SamplingParams
from qserve.cli import main


def test_generate_prints_the_greedy_text(tiny_checkpoints, llama_llm, capsys):
    path = tiny_checkpoints["LlamaForCausalLM"][1]
    expected = llama_llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert main(["generate", path, "--prompt", "Hello world", "--max-tokens", "12", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_generate_reports_a_missing_model_clearly(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x", "--device", "cpu"]) == 2
    assert "config.json" in capsys.readouterr().err
