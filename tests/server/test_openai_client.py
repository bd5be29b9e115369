"""The official ``openai`` client, sync and async, streaming and not, against a real server."""

from __future__ import annotations

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(two_model_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=two_model_server.base_url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return AutoTokenizer.from_pretrained(checkpoints["llama"])


def test_models_list(client, checkpoints):
    models = client.models.list()
    assert [m.id for m in models.data] == ["llama", "qwen"]
    assert all(m.object == "model" for m in models.data)


def test_completion_usage_and_stream_match(client, tokenizer):
    prompt = "The quick brown fox"
    full = client.completions.create(model="llama", prompt=prompt, max_tokens=7, **GREEDY)
    assert full.object == "text_completion"
    assert len(full.choices) == 1 and full.choices[0].finish_reason == "length"
    num_prompt = len(tokenizer.encode(prompt))
    assert full.usage.prompt_tokens == num_prompt
    assert full.usage.completion_tokens == 7
    assert full.usage.total_tokens == num_prompt + 7

    chunks = list(
        client.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == num_prompt


def test_completion_batch_n_token_ids_and_seed(client):
    result = client.completions.create(
        model="qwen",
        prompt=[[5, 6, 7], [8, 9]],
        n=2,
        max_tokens=4,
        temperature=0.8,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 16
    again = client.completions.create(
        model="qwen",
        prompt=[[5, 6, 7], [8, 9]],
        n=2,
        max_tokens=4,
        temperature=0.8,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in result.choices]


def test_completion_logprobs_and_echo(client, tokenizer):
    prompt = "Hello world"
    num_prompt = len(tokenizer.encode(prompt))
    result = client.completions.create(model="llama", prompt=prompt, max_tokens=3, logprobs=2, echo=True, **GREEDY)
    choice = result.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Greedy: the generated token is the top-1 alternative.
    for token, top in zip(lp.tokens[num_prompt:], lp.top_logprobs[num_prompt:]):
        assert max(top.values()) == pytest.approx(top[token])

    streamed = client.completions.create(model="llama", prompt=prompt, max_tokens=3, logprobs=1, stream=True, **GREEDY)
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 3


def test_chat_sync_and_stream(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Tell me a story"},
    ]
    full = client.chat.completions.create(model="qwen", messages=messages, max_completion_tokens=6, **GREEDY)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 6
    assert full.usage.total_tokens == full.usage.prompt_tokens + 6

    chunks = list(
        client.chat.completions.create(
            model="qwen",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_logprobs(client):
    result = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy


def test_async_client_concurrent(two_model_server):
    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=two_model_server.base_url, api_key="unused", max_retries=0, timeout=30)
        async with client:
            full = await client.completions.create(model="llama", prompt="Once upon", max_tokens=5, **GREEDY)

            async def streamed() -> str:
                stream = await client.chat.completions.create(
                    model="qwen", messages=[{"role": "user", "content": "Once"}], max_tokens=5, stream=True, **GREEDY
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            async def plain() -> str:
                r = await client.completions.create(model="llama", prompt="Once upon", max_tokens=5, **GREEDY)
                return r.choices[0].text

            results = await asyncio.gather(streamed(), plain(), plain(), streamed())
            assert results[1] == results[2] == full.choices[0].text
            assert results[0] == results[3]
            chat = await client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": "Once"}], max_tokens=5, **GREEDY
            )
            assert chat.choices[0].message.content == results[0]

    asyncio.run(main())
