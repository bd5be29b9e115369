"""A model directory without (or with a broken) tokenizer gets an error naming the directory and
the files; ``skip_tokenizer_init=True`` serves token ids without any tokenizer, as vLLM does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qserve import LLM, SamplingParams
from qserve.tokenization.files import TokenizerFilesError, find_tokenizer_files

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 3]}


def _copy_without_tokenizer(source: str, target: Path) -> Path:
    shutil.copytree(source, target)
    for name in find_tokenizer_files(target) + ["tokenizer_config.json", "special_tokens_map.json"]:
        (target / name).unlink(missing_ok=True)
    return target


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoints) -> str:
    return tiny_checkpoints["LlamaForCausalLM"][1]


def test_the_tiny_checkpoint_has_tokenizer_files(llama_path):
    assert find_tokenizer_files(Path(llama_path))  # else the next tests prove nothing


def test_missing_tokenizer_names_directory_and_files(llama_path, tmp_path):
    bare = _copy_without_tokenizer(llama_path, tmp_path / "no-tokenizer")
    with pytest.raises(TokenizerFilesError) as info:
        LLM(str(bare), device="cpu", dtype="float32")
    message = str(info.value)
    assert str(bare) in message
    assert "tokenizer.json" in message and "tokenizer.model" in message
    assert "skip_tokenizer_init" in message


def test_corrupt_tokenizer_names_directory_and_file(llama_path, tmp_path):
    broken = _copy_without_tokenizer(llama_path, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{ this is not json")
    with pytest.raises(TokenizerFilesError) as info:
        LLM(str(broken), device="cpu", dtype="float32")
    assert str(broken) in str(info.value) and "tokenizer.json" in str(info.value)


def test_skip_tokenizer_init_generates_token_ids(llama_path, tmp_path):
    bare = _copy_without_tokenizer(llama_path, tmp_path / "ids-only")
    with_tokenizer = LLM(llama_path, device="cpu", dtype="float32")
    without = LLM(str(bare), device="cpu", dtype="float32", skip_tokenizer_init=True)
    assert without.get_tokenizer() is None
    expected = with_tokenizer.generate([PROMPT], GREEDY)[0].outputs[0]
    got = without.generate(
        [PROMPT, [7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    )
    assert got[0].outputs[0].token_ids == expected.token_ids
    assert len(expected.token_ids) == 6
    assert got[0].outputs[0].text == ""
    assert got[1].outputs[0].logprobs is not None and len(got[1].outputs[0].logprobs) == 6


def test_skip_tokenizer_init_refuses_text(llama_path):
    llm = LLM(llama_path, device="cpu", dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["some text"], GREEDY)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, stop=["x"]))
    # nothing was queued by the refused calls: a valid request still runs alone
    assert len(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids) == 6
