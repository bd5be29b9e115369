"""bench/spec_decode.py's EAGLE heads built from a GPTQ target (issue 29's GPU measurement, where no
trained head can be had): the dequantization equals the loaders' own reading of the checkpoint, the
head is a checkpoint qserve's EAGLE reader accepts, bad constructions and method names are refused
naming what was wrong, and the script's --small mode runs end to end on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.e2e import SMALL, write_random_gptq
from bench.spec_decode import gptq_v1_dense, main, write_eagle_head
from loaders.weights import iter_weights
from qserve.model.registry import read_model_config
from qserve.spec_decode.eagle_config import read_eagle_config
from quant_kernels.reference import dequantize_input_order

LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec-bench") / "target"
    write_random_gptq(path, SMALL)
    return path


def test_gptq_v1_dense_equals_the_loaders_reading(target: Path) -> None:
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = load_file(str(target / index["model.layers.0.mlp.down_proj.qweight"]))
    wanted = {f"model.layers.0.{name}" for name in LINEARS}
    loaded = dict(iter_weights(target, keep=lambda name: name in wanted))
    assert set(loaded) == wanted
    for module, packed in loaded.items():
        reference = dequantize_input_order(packed, torch.float32)  # [K, N]
        ours = gptq_v1_dense(tensors, module).float()  # [N, K]
        torch.testing.assert_close(ours, reference.t(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("construction", ["layers1", "layers2", "random"])
def test_the_heads_are_checkpoints_qserve_reads(target: Path, tmp_path: Path, construction: str) -> None:
    head = tmp_path / construction
    write_eagle_head(target, head, construction)
    config = read_eagle_config(head, "eagle", read_model_config(target))
    assert config.method == "eagle"
    assert config.model.num_layers == (2 if construction == "layers2" else 1)
    tensors = load_file(str(head / "model.safetensors"))
    assert "layers.0.input_layernorm.weight" not in tensors, "an EAGLE head's first layer has no input norm"
    fc = tensors["fc.weight"].float()  # [H, 2H]: the embedding passes through, the target's feature does not
    hidden = SMALL["hidden"]
    if construction != "random":
        torch.testing.assert_close(fc, torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))


@pytest.mark.parametrize(
    ("construction", "message"),
    [("layers0", "N must be 1..2"), ("layers3", "N must be 1..2"), ("trained", "layersN or random")],
)
def test_a_bad_construction_is_refused(target: Path, tmp_path: Path, construction: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_eagle_head(target, tmp_path / "head", construction)


def test_small_run_with_eagle_heads(target: Path, tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "spec.md"
    argv = ["spec_decode.py", "--small", "--checkpoint", str(tmp_path / "ck"), "--batches", "1", "--max-tokens", "8",
            "--eagle", "layers1,random", "--eagle-decode-graphs", "both", "--eagle-head-graphs", "on",
            "--eagle-catch-up-graphs", "on", "--eagle-draft-lm-head", "both", "--adaptive",
            "--profile-modes", "ngram", "--profile-dir", str(tmp_path / "prof"), "--profile-steps", "1",
            "--adaptive-modes",
            "eagle-random-hg-cg", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    from qserve.engine import engine

    for name in (  # main() sets them per mode: monkeypatch gives the later tests their own values back
        engine.SPEC_GRAPHS_ENV,
        engine.EAGLE_DECODE_GRAPHS_ENV,
        engine.EAGLE_HEAD_GRAPHS_ENV,
        engine.EAGLE_CATCH_UP_GRAPHS_ENV,
        engine.EAGLE_DEVICE_DRAFTS_ENV,
    ):
        monkeypatch.setenv(name, "0")
    main()
    rows = [line.split("|")[1].strip() for line in out.read_text().splitlines() if line.startswith("| ")]
    for mode in (
        "ngram",
        "eagle-layers1-hg-cg",
        "eagle-layers1-dg-hg-cg",
        "eagle-random-hg-cg",
        "eagle-random-dg-hg-cg",
        "eagle-random-hg-cg-adaptive",
        "eagle-random-dg-hg-cg-q4",
        "eagle-layers1-hg-cg-q4",
    ):
        assert mode in rows, rows
    profile = (tmp_path / "prof" / "profile_ngram.md").read_text()
    assert profile.startswith("## ngram, batch 1, repeat prompt: ") and "tokens per step" in profile
    assert "wall " in profile and "Host Python" in profile
    monkeypatch.setattr(sys, "argv", [*argv[:-4], "--adaptive-modes", "eagle-bogus", "--out", str(out)])
    with pytest.raises(SystemExit):
        main()
    assert "--adaptive-modes eagle-bogus: not among the methods" in capsys.readouterr().err
    bogus = [*argv[:-4], "--profile-modes", "eagle-bogus", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", bogus)
    with pytest.raises(SystemExit):
        main()
    assert "--profile-modes eagle-bogus: not among the modes" in capsys.readouterr().err
