"""The built-in demo model: quantized once into the cache with qserve's own GPTQ, then reused."""

from __future__ import annotations

import json

import pytest

from qserve import LLM, SamplingParams
from qserve.quantize import demo

pytestmark = pytest.mark.skipif(
    not (demo.DEMO_MODEL / "model.safetensors").is_file(), reason="recipes/demo/model is not trained yet"
)


def test_demo_files_are_small_and_complete() -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (demo.DEMO_MODEL / name).is_file(), name
    assert (demo.DEMO_MODEL / "model.safetensors").stat().st_size <= 16 * 1024**2
    config = json.loads((demo.DEMO_MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["intermediate_size"] % 128 == 0
    assert demo.DEMO_HELDOUT.stat().st_size < 512 * 1024 and demo.DEMO_CALIB.is_file()


def test_ensure_demo_model_quantizes_once_and_serves(tmp_path, monkeypatch) -> None:
    path = demo.ensure_demo_model(str(tmp_path))
    assert path == str(tmp_path / "demo-gptq")
    qc = json.loads((tmp_path / "demo-gptq" / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"]) == ("gptq", 4, 128)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dirs cleaned up

    def must_not_run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the cached demo model should have been reused")

    monkeypatch.setattr(demo, "quantize_checkpoint", must_not_run)
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path))
    assert demo.ensure_demo_model() == path

    out = LLM(path, device="cpu", dtype="float32").generate(["def main("], SamplingParams(temperature=0, max_tokens=12))
    assert len(out[0].outputs[0].token_ids) > 0


def test_stale_cache_is_replaced(tmp_path) -> None:
    target = tmp_path / "demo-gptq"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / demo.STAMP).write_text(json.dumps({"source_sha256": "old"}))
    path = demo.ensure_demo_model(str(tmp_path))
    assert json.loads((target / demo.STAMP).read_text())["source_sha256"] != "old"
    assert "quantization_config" in json.loads((target / "config.json").read_text())
    assert path == str(target)
