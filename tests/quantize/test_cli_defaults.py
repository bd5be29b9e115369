"""``qserve quantize`` and ``qserve recipe`` without ``--calib``: the packaged demo text is the
default calibration data, and ``--dry-run`` prints commands that run as printed."""

from __future__ import annotations

import shlex

from qserve.quantize.recipes import DEMO_CALIB
from tests.quantize.conftest import run_command


def test_quantize_without_calib_uses_the_demo_text(tmp_path, llama_ckpt, capsys) -> None:
    out = tmp_path / "q"
    argv = [str(llama_ckpt), str(out), "--method", "gptq", "--num-samples", "2", "--seq-len", "32"]
    assert run_command("quantize", argv) == 0
    assert (out / "config.json").is_file()
    assert str(DEMO_CALIB) in capsys.readouterr().err


def test_recipe_dry_run_expands_calib(capsys) -> None:
    argv = ["qwen2.5-7b-instruct-gptq-rtx4090", "--model-path", "/models/q7", "--dry-run"]
    assert run_command("recipe", argv) == 0
    quantize, serve = capsys.readouterr().out.strip().splitlines()
    assert "{" not in quantize + serve
    words = shlex.split(quantize)
    assert words[words.index("--calib") + 1] == str(DEMO_CALIB) and DEMO_CALIB.is_file()
