"""Qwen v1's tokenizer (``qwen.tiktoken``) as a ``transformers`` fast tokenizer, no remote code.

Knows (families.md (a), Qwen's tokenization_qwen.py): the file is ``base64(bytes) rank`` lines
read with ``tiktoken.load.load_tiktoken_bpe``; the pre-tokenizer regex is Qwen's own (single
digits ``\\p{N}``, unlike the default ``\\p{N}{1,3}``); input is NFC-normalized; the special
tokens follow the ranks in a fixed order (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
``<|extra_0|>`` .. ``<|extra_204|>``: ids 151643.. on the real file); the chat format is ChatML
with Qwen's default system prompt. The conversion itself is transformers' ``TikTokenConverter``.
Must not know: models or the engine.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PAT_STR = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END] + [f"<|extra_{i}|>" for i in range(205)]
DEFAULT_SYSTEM = "You are a helpful assistant."

# ChatML as Qwen's make_context builds it: a system turn first (the default one if none is given).
CHAT_TEMPLATE = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def read_ranks(vocab_file: str | Path) -> dict[bytes, int]:
    """The mergeable ranks, read by tiktoken. tiktoken caches files by path; passing the content
    hash makes it re-read a file that changed since it was cached."""
    from tiktoken.load import load_tiktoken_bpe

    digest = hashlib.sha256(Path(vocab_file).read_bytes()).hexdigest()
    return load_tiktoken_bpe(str(vocab_file), expected_hash=digest)


def load(root: str | Path):  # noqa: ANN201 - transformers.PreTrainedTokenizerFast
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return read_ranks(tiktoken_url)

    vocab_file = Path(root) / "qwen.tiktoken"
    backend = _Converter(str(vocab_file), pattern=PAT_STR, extra_special_tokens=SPECIAL_TOKENS).converted()
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )
    num_ranks = backend.get_vocab_size(with_added_tokens=False)
    if tokenizer.convert_tokens_to_ids(ENDOFTEXT) != num_ranks:
        raise ValueError(f"{vocab_file}: ranks are not contiguous from 0; special tokens would get wrong ids")
    tokenizer.qserve_stop_token_ids = tuple(tokenizer.convert_tokens_to_ids([IM_END, IM_START]))
    return tokenizer
