"""A tiny, deterministic byte-level BPE tokenizer for tests (no downloads).

Knows: how to train a ~400-token byte-level BPE on a fixed built-in text (English plus
multi-byte text: accents, CJK, emoji, so that multi-byte characters are split across
tokens) and wrap it as a ``transformers.PreTrainedTokenizerFast`` with ChatML special
tokens and a chat template. Must not know: models, checkpoints or the engine.

Usage::

    tok = make_tokenizer()                 # in memory
    tok = make_tokenizer("/tmp/ckpt")      # also saved there (tokenizer.json, tokenizer_config.json, ...)

Special tokens: ``<|endoftext|>`` (eos, also used as pad), ``<|im_start|>``, ``<|im_end|>``.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
VOCAB_SIZE = 400  # 3 special + 256 byte symbols + ~141 merges

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token.
Quantization stores the weights in four bits, and the server streams tokens to the client.
Hello world! This is a small test of the tokenizer. The cat sat on the mat, and the dog
ran in the park. We serve many requests at once with continuous batching and paged memory.
Once upon a time there was a little model that wanted to answer every question quickly.
It is the end of the story, and then there were numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
"""

_MULTIBYTE = """\
Café crème brûlée, naïve façade, résumé, über Straße, Grüße aus München, schön.
中文测试：你好，世界。我们喜欢模型。
Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🤖 — “quotes” and ‘single’ … ellipsis.
"""

_CORPUS = [_ENGLISH, _MULTIBYTE] * 4


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train once per process; training is deterministic for a fixed corpus and settings."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok.to_str()


def make_tokenizer(save_dir: str | None = None) -> PreTrainedTokenizerFast:
    """Return a fresh tiny tokenizer; if ``save_dir`` is given, also ``save_pretrained`` it there."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer
