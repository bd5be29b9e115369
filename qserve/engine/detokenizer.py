"""Incremental detokenization: token ids in, new text deltas out, one token at a time.

Knows: a Hugging Face tokenizer's ``convert_ids_to_tokens`` / ``convert_tokens_to_string``
and vLLM's prefix/read-offset scheme. Must not know: sampling, stopping, the scheduler or
torch.

Why offsets: decoding a token alone is wrong (byte-level BPE splits one UTF-8 character
over several tokens; SentencePiece drops or adds leading spaces depending on context), and
decoding the whole sequence each step is O(total). Instead we decode a short window:
``tokens[prefix_offset:read_offset]`` is text already emitted (context only) and
``tokens[prefix_offset:]`` is that plus the new tokens; the delta is the difference. While
the window's text ends with U+FFFD (an incomplete character) the delta is held back.

Per-token cost: token strings are looked up once per (tokenizer, id) in a ``TokenStrings``
cache that an engine shares between all its sequences, and the window is turned into text by
the tokenizer's backend decoder directly when the tokenizer is a standard fast one (the same
call ``convert_tokens_to_string`` makes, without its wrapper).

Streaming with stop strings: text that might be the start of a stop string must not be sent
before we know; ``stop_buffer_len`` (max stop length - 1) chars are held back by
``get_next_output_text`` until the sequence finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Prompt tokens used as decode context for the first generated token (vLLM's value).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"

# Modules whose ``convert_tokens_to_string`` is just the backend decoder (transformers 5 / 4).
_FAST_TOKENIZER_MODULES = ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")


def _tokens_to_string_fn(tokenizer: Any) -> Callable[[list[str]], str]:
    """``tokenizer.convert_tokens_to_string``, or the backend decoder it would call anyway."""
    method = getattr(type(tokenizer), "convert_tokens_to_string", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(method, "__module__", None) in _FAST_TOKENIZER_MODULES:
        decoder = backend.decoder
        if decoder is not None:
            return decoder.decode
    return tokenizer.convert_tokens_to_string


class TokenStrings:
    """Token id -> token strings, cached per tokenizer (shared by the detokenizers of one engine).

    ``lookup(id, skip_special_tokens)`` is exactly ``tokenizer.convert_ids_to_tokens([id],
    skip_special_tokens=...)`` (empty for a skipped special token or an out-of-vocab id), but
    computed once per id. The tokenizer must not change its vocabulary afterwards.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_len = len(tokenizer)
        self.to_string = _tokens_to_string_fn(tokenizer)
        self._cache: tuple[dict[int, tuple[str, ...]], dict[int, tuple[str, ...]]] = ({}, {})

    def lookup(self, token_id: int, skip_special_tokens: bool) -> tuple[str, ...]:
        cache = self._cache[skip_special_tokens]
        tokens = cache.get(token_id)
        if tokens is None:
            tokens = cache[token_id] = tuple(self.convert([token_id], skip_special_tokens))
        return tokens

    def convert(self, token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        """``convert_ids_to_tokens`` over the in-vocabulary ids (uncached)."""
        ids = [t for t in token_ids if 0 <= t < self.vocab_len]
        tokens = self.tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)
        return [tokens] if isinstance(tokens, str) else list(tokens)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        stop_buffer_len: int = 0,
        token_strings: TokenStrings | None = None,
    ) -> None:
        if token_strings is None:
            token_strings = TokenStrings(tokenizer)
        elif token_strings.tokenizer is not tokenizer:
            raise ValueError("token_strings was built for another tokenizer")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_buffer_len = stop_buffer_len
        self._token_strings = token_strings
        self._to_string = token_strings.to_string
        # Context: the last few prompt tokens (as token strings), never emitted.
        tail = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET - 1 :])
        self.tokens: list[str] = token_strings.convert(tail, skip_special_tokens)
        self.prefix_offset = max(len(self.tokens) - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.read_offset = len(self.tokens)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._num_sent_chars = 0  # for get_next_output_text

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly readable text (possibly empty)."""
        self.output_token_ids.append(token_id)
        tokens = self.tokens
        tokens.extend(self._token_strings.lookup(token_id, self.skip_special_tokens))
        prefix_offset, read_offset = self.prefix_offset, self.read_offset
        if len(tokens) == read_offset:
            return ""  # nothing new (skipped special token or out-of-vocab id)
        to_string = self._to_string
        prefix_text = to_string(tokens[prefix_offset:read_offset]) if read_offset > prefix_offset else ""
        new_text = to_string(tokens[prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # An incomplete UTF-8 character (or nothing visible yet): wait for more tokens.
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = read_offset
        self.read_offset = len(tokens)
        self.output_text += delta
        return delta

    def truncate(self, num_chars: int) -> None:
        """Cut ``output_text`` to its first ``num_chars`` characters (a stop string was found)."""
        self.output_text = self.output_text[:num_chars]
        self._num_sent_chars = min(self._num_sent_chars, num_chars)

    def get_next_output_text(self, finished: bool, delta: bool = True) -> str:
        """Text to stream now: the new part (``delta``) or all of it, minus the stop-string buffer."""
        length = len(self.output_text) if finished else max(len(self.output_text) - self.stop_buffer_len, 0)
        if not delta:
            return self.output_text[:length]
        if length <= self._num_sent_chars:
            return ""
        text = self.output_text[self._num_sent_chars : length]
        self._num_sent_chars = length
        return text


class TokenIdsOnly:
    """The detokenizer of an engine started without a tokenizer (``skip_tokenizer_init``):
    it keeps the generated ids and produces no text, as vLLM does then."""

    def __init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.output_text = ""

    def add_token(self, token_id: int) -> str:
        self.output_token_ids.append(token_id)
        return ""

    def truncate(self, num_chars: int) -> None:
        self.output_text = self.output_text[:num_chars]

    def get_next_output_text(self, finished: bool, delta: bool = True) -> str:
        return ""
