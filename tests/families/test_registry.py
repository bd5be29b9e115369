"""The registry: every architecture it serves is in the README table and is refused nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from qserve.config import ModelConfig
from qserve.model.registry import architecture_table, supported_architectures

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_architecture():
    text = README.read_text()
    missing = [name for name in supported_architectures() if f"`{name}`" not in text]
    assert not missing, f"README's architecture table lacks {missing}"
    assert {row[0] for row in architecture_table()} == set(supported_architectures())


def test_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="FooForCausalLM.*QWenLMHeadModel.*BaichuanForCausalLM"):
        ModelConfig.from_hf({"architectures": ["FooForCausalLM"], "hidden_size": 8})


def test_quantize_refuses_other_families(tmp_path):
    from qserve.quantize.pipeline import _check_source
    from tests.helpers.family_models import qwen2_oracle, save_qwen_v1

    path = save_qwen_v1(qwen2_oracle(), tmp_path / "qwen")
    with pytest.raises(ValueError, match="QWenLMHeadModel"):
        _check_source(path)
