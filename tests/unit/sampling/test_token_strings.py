"""``TokenStrings``: the detokenizer's per-tokenizer cache must be exactly the tokenizer's own calls."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from qserve.engine.detokenizer import IncrementalDetokenizer, TokenStrings

TEXT = "Hello world 😀 中文 café <|im_end|> naïve 模型 ❤️ The cat sat.<|endoftext|>!"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_lookup_equals_convert_ids_to_tokens(tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool) -> None:
    strings = TokenStrings(tokenizer)
    for token_id in [*range(len(tokenizer)), -1, len(tokenizer), len(tokenizer) + 5]:
        expected = (
            tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=skip_special_tokens)
            if 0 <= token_id < len(tokenizer)
            else []
        )
        assert list(strings.lookup(token_id, skip_special_tokens)) == expected
        assert list(strings.lookup(token_id, skip_special_tokens)) == expected  # cached


def test_to_string_equals_convert_tokens_to_string(tokenizer: PreTrainedTokenizerFast) -> None:
    strings = TokenStrings(tokenizer)
    rng = random.Random(0)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    for _ in range(200):
        window = [rng.choice(vocab) for _ in range(rng.randint(0, 8))]
        assert strings.to_string(window) == tokenizer.convert_tokens_to_string(window)


class _SlowStandIn:
    """A tokenizer without a backend decoder: the detokenizer must use convert_tokens_to_string."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.calls = 0

    def __len__(self) -> int:
        return len(self.inner)

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return self.inner.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        self.calls += 1
        return self.inner.convert_tokens_to_string(tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_shared_cache_and_generic_tokenizer_give_same_deltas(
    tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(TEXT)
    prompt = tokenizer.encode("Prompt: 中文")
    shared = TokenStrings(tokenizer)
    generic = _SlowStandIn(tokenizer)
    runs = [
        IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens),
        IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens, token_strings=shared),
        IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens, token_strings=shared),
        IncrementalDetokenizer(generic, prompt, skip_special_tokens),
    ]
    deltas = [[detok.add_token(i) for i in ids] for detok in runs]
    assert all(d == deltas[0] for d in deltas)
    assert "".join(deltas[0]) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert generic.calls > 0


def test_cache_of_another_tokenizer_is_refused(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="another tokenizer"):
        IncrementalDetokenizer(_SlowStandIn(tokenizer), [], token_strings=TokenStrings(tokenizer))
