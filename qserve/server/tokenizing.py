"""Prompt tokenization and chat templating off the event loop, with a length bound checked first.

Knows: one model's front-end tokenizer, how to run ``encode`` / ``apply_chat_template`` in a
worker thread, and the most characters a prompt can have and still fit the context. Must not
know: HTTP, OpenAI shapes, engines.

Why: tokenizing a 10 MB prompt on the event loop froze every route (``/health`` included) for
most of a minute. Now (1) a prompt longer in characters than ``max_model_len`` tokens could
ever cover is refused before it is tokenized, and (2) what is tokenized runs in this model's
own worker thread, with its own tokenizer copy (a Hugging Face fast tokenizer must not be used
from two threads at once; the loop thread keeps its copy for decoding logprob tokens).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
from typing import Any

# Normalizers may drop characters (control characters, accents), so a text can have a few more
# characters than its tokens' strings; this factor keeps the bound from refusing such a prompt.
CHAR_BOUND_MARGIN = 2


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token's string has (added/special tokens included)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no character bound
        return 0
    return max((len(token) for token in vocab), default=0)


class PromptTokenizer:
    """Tokenizes one model's prompts in a single worker thread."""

    def __init__(self, tokenizer: Any, max_model_len: int, name: str) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)  # worker thread only
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-{name}")
        per_token = max_token_chars(tokenizer)
        # 0 means unknown: no bound (the token-count check after tokenizing still applies).
        self.max_prompt_chars = max_model_len * per_token * CHAR_BOUND_MARGIN if per_token else 0

    def too_long(self, num_chars: int) -> bool:
        """Could a text of ``num_chars`` characters never fit the context?"""
        return bool(self.max_prompt_chars) and num_chars > self.max_prompt_chars

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, **kwargs: Any) -> list[int]:
        return await self._run(self._tokenizer.encode, text, **kwargs)

    async def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return await self._run(self._tokenizer.decode, token_ids, **kwargs)

    async def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return await self._run(self._tokenizer.apply_chat_template, messages, **kwargs)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
