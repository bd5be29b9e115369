"""What the bench sends: prompts with their prompt and output lengths.

Knows: the seeded ShareGPT-like synthetic workload (prompt and output lengths drawn from
log-normal distributions with given means, capped; random token ids as prompts — from a
vocabulary range or from a pool of ids the tokenizer produced — fresh per load point so a prefix
cache cannot reuse an earlier point's prompts), the JSONL format of user prompts (one object a
line: ``prompt`` (text or token ids), optional ``output_len``; vLLM's ``custom``) and the ShareGPT
JSON format (``[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]``)
with vLLM's length filter. Must not know: HTTP, timing, the server.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request to send. ``prompt`` is text, or token ids (sent as an OpenAI token-array prompt)."""

    prompt: str | list[int]
    prompt_len: int  # tokens (exact for token ids, from the tokenizer for text; 0 if unknown)
    output_len: int  # max_tokens


def lognormal_lengths(n: int, mean: float, cap: int, sigma: float, rng: random.Random) -> list[int]:
    """``n`` lengths from a log-normal with the given mean (before capping), each in [1, cap]."""
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2) = mean
    return [max(1, min(cap, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def synthetic_requests(
    num_prompts: int,
    *,
    input_len: int,
    output_len: int,
    max_len: int,
    sigma: float,
    vocab_size: int | None = None,
    seed: int,
    run: int = 0,
    max_model_len: int | None = None,
    first_token_id: int = 3,
    token_pool: Sequence[int] | None = None,
) -> list[SampleRequest]:
    """The ShareGPT-like synthetic workload: lengths depend only on ``seed``; token ids on
    ``seed`` and ``run`` (so each load point gets new prompts of the same lengths).

    Ids are drawn from ``[first_token_id, vocab_size)`` (``first_token_id`` keeps the lowest ids,
    special tokens of most tokenizers, out of prompts) or, given ``token_pool``, from it (ids the
    tokenizer produced for ordinary text: valid whatever the vocabulary's size).
    With ``max_model_len``, output lengths are cut so prompt + output fits the context.
    """
    if token_pool is not None:
        if not token_pool:
            raise ValueError("the token pool is empty: no token ids to draw prompts from")
    elif vocab_size is None or vocab_size <= first_token_id:
        raise ValueError(f"vocab size {vocab_size} leaves no token ids to draw prompts from")
    lengths = random.Random(seed)
    in_lens = lognormal_lengths(num_prompts, input_len, max_len, sigma, lengths)
    out_lens = lognormal_lengths(num_prompts, output_len, max_len, sigma, lengths)
    ids = random.Random(seed * 1_000_003 + 17 + run)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        if max_model_len is not None:
            n_in = min(n_in, max_model_len - 1)
            n_out = max(1, min(n_out, max_model_len - n_in))
        if token_pool is not None:
            prompt = [token_pool[ids.randrange(len(token_pool))] for _ in range(n_in)]
        else:
            prompt = [ids.randrange(first_token_id, vocab_size) for _ in range(n_in)]
        requests.append(SampleRequest(prompt, n_in, n_out))
    return requests


def load_jsonl(path: str | Path, *, default_output_len: int, tokenizer: Any | None = None) -> list[SampleRequest]:
    """Prompts from a JSONL file: ``{"prompt": "text" | [ids], "output_len": 128}`` per line
    (``output_len`` optional). Bad lines are refused with their line number."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            prompt = item.get("prompt") if isinstance(item, dict) else None
            is_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not is_ids:
                raise ValueError(f"{path}:{number}: needs a non-empty 'prompt' (text or a list of token ids)")
            output_len = item.get("output_len", default_output_len)
            if not isinstance(output_len, int) or output_len < 1:
                raise ValueError(f"{path}:{number}: 'output_len' must be a positive integer, got {output_len!r}")
            if is_ids:
                prompt_len = len(prompt)
            else:
                prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else 0
            requests.append(SampleRequest(prompt, prompt_len, output_len))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests


def sharegpt_conversations(path: str | Path, seed: int) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) of every ShareGPT conversation with two turns or more,
    in a seeded random order (vLLM's ``--dataset-name sharegpt`` input)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg}); ShareGPT data is one JSON list of conversations") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: ShareGPT data is a JSON list of {{'conversations': [...]}} objects")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(prompt, str) and isinstance(reply, str) and prompt and reply:
            pairs.append((prompt, reply))
    if not pairs:
        raise ValueError(f"{path}: no conversation with a prompt and a reply (ShareGPT's 'conversations' list)")
    random.Random(seed).shuffle(pairs)
    return pairs


def sharegpt_keeps(prompt_len: int, output_len: int, *, fixed_output_len: int | None = None) -> bool:
    """vLLM's ShareGPT filter: both sides at least 4 tokens (unless the output length is fixed),
    the prompt at most 1024 and prompt + output at most 2048."""
    if prompt_len < 4 or (fixed_output_len is None and output_len < 4):
        return False
    return prompt_len <= 1024 and prompt_len + output_len <= 2048
