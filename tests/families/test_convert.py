""".bin-only checkpoints (ChatGLM, Baichuan mirrors) are refused naming the files, and
``qserve convert DIR OUT`` rewrites them as safetensors with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qserve import LLM, SamplingParams
from qserve.cli import main
from tests.helpers.family_models import glm_oracle, save_chatglm
from tests.integration.test_hf_parity import hf_prompt_logprobs


def _to_bin(src, dst, shards: int = 2):
    """A pickled copy of a safetensors checkpoint, sharded with a pytorch_model.bin.index.json."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save(part, dst / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return tensors


@pytest.mark.slow
def test_bin_only_refused_then_converted(tmp_path):
    model = glm_oracle(seed=8, rope_theta=10000.0)
    src = save_chatglm(model, tmp_path / "st", rope_ratio=1)
    tensors = _to_bin(src, tmp_path / "bin")
    with pytest.raises(ValueError, match=r"pytorch_model-00001-of-00002\.bin.*qserve convert"):
        LLM(str(tmp_path / "bin"), device="cpu", dtype="float32")
    assert main(["convert", str(tmp_path / "bin"), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list(out.glob("*.bin"))
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == tensors.keys() and all(torch.equal(converted[k], tensors[k]) for k in tensors)
    prompt = list(range(10, 30))
    output = LLM(str(out), device="cpu", dtype="float32").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    ours = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
    assert torch.allclose(ours, hf_prompt_logprobs(model, prompt), atol=1e-4, rtol=0)


def test_tied_tensors_are_written_separately(tmp_path):
    src = tmp_path / "tied"
    src.mkdir()
    weight = torch.randn(8, 4)
    torch.save({"model.embed_tokens.weight": weight, "lm_head.weight": weight}, src / "pytorch_model.bin")
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["lm_head.weight"], weight) and torch.equal(out["model.embed_tokens.weight"], weight)


class _Evil:
    def __reduce__(self):
        return (print, ("UNPICKLED-CODE-RAN",))


def test_arbitrary_pickles_are_refused(tmp_path, capsys):
    src = tmp_path / "evil"
    src.mkdir()
    torch.save({"w": torch.zeros(2), "x": _Evil()}, src / "pytorch_model.bin")
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert "weights_only=True" in captured.err and "pytorch_model.bin" in captured.err
    assert "UNPICKLED-CODE-RAN" not in captured.out + captured.err


def test_nothing_to_convert(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "no pickled weights" in capsys.readouterr().err
