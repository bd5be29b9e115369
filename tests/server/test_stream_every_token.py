"""Every token step goes out as a stream chunk, even when its text delta is empty (issue 17, item 3).

A byte-level BPE splits multi-byte characters over several tokens; the detokenizer holds their
text back until the character is complete. The token still went to the client in a chunk of
its own before this: TTFT and ITL measured by clients are then the engine's. Random-weight
models with the test tokenizer emit such byte tokens within a few dozen tokens.
"""

from __future__ import annotations

import json
import random

import httpx

MODEL = "llama"
MAX_TOKENS = 48


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(12)]


def _stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_completion_stream_sends_a_chunk_per_token(two_model_server):
    url = two_model_server.url
    empty_seen = 0
    for seed in range(4):
        body = {"model": MODEL, "prompt": _prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        chunks = _stream(url, "/v1/completions", body)
        token_chunks = [c for c in chunks if c["choices"]]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        # One step, one token, one chunk: nothing merged into a later chunk.
        assert len(token_chunks) == MAX_TOKENS
        empty_seen += sum(c["choices"][0]["text"] == "" for c in token_chunks)
        plain = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60).json()
        assert "".join(c["choices"][0]["text"] for c in token_chunks) == plain["choices"][0]["text"]
    assert empty_seen > 0, "no token with an empty text delta was generated: the test exercised nothing"


def test_chat_stream_sends_a_chunk_per_token(two_model_server):
    url = two_model_server.url
    empty_seen = 0
    for seed in range(4):
        content = "".join(chr(0x4E00 + t) for t in _prompt(seed))  # CJK: multi-byte characters
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        chunks = _stream(url, "/v1/chat/completions", body)
        role, *rest = [c for c in chunks if c["choices"]]
        assert role["choices"][0]["delta"].get("role") == "assistant"
        assert len(rest) == chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        empty_seen += sum(not c["choices"][0]["delta"].get("content") for c in rest)
    assert empty_seen > 0, "no token with an empty text delta was generated: the test exercised nothing"
