from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from qserve.engine.detokenizer import INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, IncrementalDetokenizer

TEXTS = [
    "Hello world 😀 中文 café",
    "😀🚀🎉 👍🏽 über Straße 你好，世界。",
    "The cat sat.<|im_end|> 🤖 crème brûlée<|endoftext|>!",
    "naïve 模型 ❤️",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_multibyte_deltas_concatenate_to_decode(
    tokenizer: PreTrainedTokenizerFast, text: str, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text)
    # The test is meaningful: some character really is split over several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    prompt = tokenizer.encode("Prompt: tell me 中文")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_token(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_token_ids == ids


def test_held_back_until_character_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add_token(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_special_tokens_skipped_or_shown(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert detok.add_token(eos) == ""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert detok.add_token(eos) == "<|endoftext|>"


def test_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(" ".join(TEXTS) * 5)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("a long prompt " * 20))
    assert detok.read_offset - detok.prefix_offset <= INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
    for i in ids:
        detok.add_token(i)
        # Decoded window = context since prefix_offset; bounded by the longest held-back run.
        assert len(detok.tokens) - detok.prefix_offset <= 8
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_prompt_context_does_not_leak(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.encode("The quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    ids = tokenizer.encode(" jumps over")
    assert "".join(detok.add_token(i) for i in ids) == " jumps over"


def test_stream_holds_back_stop_buffer(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop_buffer_len=3)
    streamed = []
    for i in tokenizer.encode("Hello world"):
        detok.add_token(i)
        streamed.append(detok.get_next_output_text(finished=False))
    assert "".join(streamed) == "Hello wo"
    detok.truncate(len("Hello w"))
    assert detok.get_next_output_text(finished=True) == ""
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello w"
