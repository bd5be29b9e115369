"""A tokenizer whose ``auto_map`` names code in the model directory (issue 31): transformers asked
"run the custom code? [y/N]" on a terminal and ``y`` ran it. qserve never runs it and never asks."""

from __future__ import annotations

import builtins
import json

import pytest

from qserve.model.checkpoint_check import check_tokenizer
from qserve.tokenization import RemoteCodeError, load_tokenizer
from tests.helpers.tokenizer import make_tokenizer


@pytest.fixture
def custom_code_dir(tmp_path):
    make_tokenizer(str(tmp_path))
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "EvilTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config_path.write_text(json.dumps(config))
    marker = tmp_path / "code_ran"
    (tmp_path / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return tmp_path


def test_custom_tokenizer_code_is_refused_without_a_prompt(custom_code_dir, monkeypatch):
    asked = []

    def answer_yes(prompt=""):
        asked.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", answer_yes)
    for load in (load_tokenizer, check_tokenizer):
        with pytest.raises(RemoteCodeError) as info:
            load(custom_code_dir)
        message = str(info.value)
        assert "--trust-remote-code" in message and "auto_map" in message and "\n" not in message
    assert asked == [], "transformers prompted to run the directory's code"
    assert not (custom_code_dir / "code_ran").exists()


def test_auto_map_next_to_a_built_in_class_loads_without_the_code(custom_code_dir):
    """A config that names a built-in class too (as many checkpoints do) loads with that class."""
    config_path = custom_code_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))
    tokenizer = load_tokenizer(custom_code_dir)
    assert tokenizer.encode("hello")
    assert not (custom_code_dir / "code_ran").exists()
