"""The registry: every architecture it serves is in the README table and is refused nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from qserve.model.registry import architecture_table, model_config, supported_architectures

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_architecture():
    text = README.read_text()
    missing = [name for name in supported_architectures() if f"`{name}`" not in text]
    assert not missing, f"README's architecture table lacks {missing}"
    assert {row[0] for row in architecture_table()} == set(supported_architectures())


def test_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="FooForCausalLM.*QWenLMHeadModel.*BaichuanForCausalLM"):
        model_config({"architectures": ["FooForCausalLM"], "hidden_size": 8})


def test_quantize_refuses_other_families(tmp_path):
    import json

    from qserve.quantize.pipeline import _check_source

    config = {"architectures": ["QWenLMHeadModel"], "hidden_size": 64, "num_attention_heads": 4}
    config.update(num_hidden_layers=2, intermediate_size=256, vocab_size=400, seq_length=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="QWenLMHeadModel"):
        _check_source(tmp_path)
