"""Where the bench gets token ids and text for its prompts: a local tokenizer, or the server's own.

Knows: two sources behind one small async interface (``encode``, ``decode``, ``pool``): a Hugging
Face tokenizer loaded locally (``--tokenizer``, or the model's ``root`` in ``/v1/models`` when that
is a local directory, as vLLM reports it), or the served model's tokenizer over HTTP through
vLLM's ``/tokenize`` and ``/detokenize`` routes (qserve and vLLM both have them), so the bench
runs with no flags. ``pool`` is a list of valid token ids to draw random prompts from: the
vocabulary range for a local tokenizer or ``--vocab-size``, else the ids the server's tokenizer
gives for a stretch of ordinary text. Must not know: workloads, timing, results.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import httpx

FIRST_TOKEN_ID = 3  # the lowest ids are special tokens in most vocabularies
POOL_TEXT_CHARS = 12_000  # text tokenized for the server-side pool (a few thousand distinct ids)
POOL_CHUNK_CHARS = 3_000


def pool_text() -> str:
    """Ordinary text and code to collect token ids from: the source of a standard-library module
    (present wherever Python is), with a fixed fallback."""
    try:
        return Path(textwrap.__file__).read_text(encoding="utf-8")[:POOL_TEXT_CHARS]
    except OSError:
        return "The quick brown fox jumps over the lazy dog. def main(argv):\n    return 0\n" * 40


class LocalTokenizer:
    """A Hugging Face tokenizer on this machine."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name

    async def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    async def pool(self) -> list[int]:
        return list(range(FIRST_TOKEN_ID, len(self.tokenizer)))


class ServerTokenizer:
    """The served model's tokenizer, through ``POST /tokenize`` and ``POST /detokenize``."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.client, self.base_url, self.model, self.headers = client, base_url, model, headers
        self.name = model

    async def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(f"{self.base_url}{route}", json=body, headers=self.headers)
        if response.status_code == 404 and "does not exist" not in response.text:
            raise ValueError(
                f"{self.base_url} has no {route} route to build prompts with: give --tokenizer (the model's "
                "directory or Hub id) or --vocab-size"
            )
        if response.status_code != 200:
            raise ValueError(f"POST {self.base_url}{route} answered {response.status_code}: {response.text[:200]}")
        return response.json()

    async def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return list((await self._post("/tokenize", body))["tokens"])

    async def decode(self, ids: list[int]) -> str:
        return str((await self._post("/detokenize", {"model": self.model, "tokens": ids}))["prompt"])

    async def pool(self) -> list[int]:
        text = pool_text()
        chunks = [text[i : i + POOL_CHUNK_CHARS] for i in range(0, len(text), POOL_CHUNK_CHARS)]
        ids: set[int] = set()
        for tokens in await asyncio.gather(*(self.encode(chunk) for chunk in chunks)):
            ids.update(tokens)
        return sorted(ids)


class VocabRange:
    """``--vocab-size N`` with no tokenizer: ids only (token-id prompts, completions endpoints)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.name = None

    async def encode(self, text: str) -> list[int]:
        raise ValueError("--vocab-size alone gives no tokenizer for text prompts: give --tokenizer")

    async def decode(self, ids: list[int]) -> str:
        raise ValueError("--vocab-size alone gives no tokenizer to turn token ids into text: give --tokenizer")

    async def pool(self) -> list[int]:
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab size {self.vocab_size} leaves no token ids to draw prompts from")
        return list(range(FIRST_TOKEN_ID, self.vocab_size))


def local_tokenizer_dir(root: Any) -> str | None:
    """The model's ``root`` from ``/v1/models`` when it is a local directory with tokenizer files."""
    if not isinstance(root, str) or not root:
        return None
    path = Path(root)
    try:
        if path.is_dir() and any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            return str(path)
    except OSError:
        return None
    return None
