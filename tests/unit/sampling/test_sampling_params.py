from __future__ import annotations

import dataclasses

import pytest

from qserve.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"n": 1.5}, "n"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_unknown_field_is_named_with_supported_list() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter 'foo'") as info:
        SamplingParams(foo=1)
    assert "temperature" in str(info.value) and "max_tokens" in str(info.value)


def test_valid_edges() -> None:
    assert SamplingParams(top_k=-1).top_k == 0  # -1 and 0 both mean "off"
    assert SamplingParams(top_k=1).top_k == 1
    assert SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=2, frequency_penalty=-2).min_p == 1.0
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(logprobs=0, prompt_logprobs=0).logprobs == 0


def test_stop_normalized_to_list() -> None:
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop=["a", "xyz"]).max_stop_str_len == 3


def test_greedy_turns_off_truncation() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy


def test_immutable_and_clone() -> None:
    p = SamplingParams(seed=1, temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seed = 2  # type: ignore[misc]
    q = p.clone(seed=2)
    assert (q.seed, q.temperature, p.seed) == (2, 0.7, 1)
    with pytest.raises(ValueError, match="^top_p"):
        p.clone(top_p=0)
