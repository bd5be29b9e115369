"""Speculative decoding behind the OpenAI server (``--speculative-config``'s path: HostConfig ->
build_engines): a greedy completion, plain and streamed, has the offline engine's text without
speculation, and /metrics carries vllm:spec_decode_* with drafts accepted."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qserve import LLM, SamplingParams
from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.server.conftest import host_config, serve

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


@pytest.mark.slow
def test_speculating_server_answers_as_without_speculation(checkpoints):
    want = (
        LLM(checkpoints["llama"], device="cpu", dtype="float32")
        .generate(
            {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    engines = build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(speculative_config=NGRAM))
    host = AsyncEngine(engines)
    with serve(create_app(host)) as url:
        body = {"model": "llama", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == want and reply["usage"]["completion_tokens"] == 24
        text = ""
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert text == want
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name.startswith("vllm:spec_decode") and "position" not in s.labels
    }
    assert (
        samples["vllm:spec_decode_num_draft_tokens_total"] >= samples["vllm:spec_decode_num_accepted_tokens_total"] > 0
    )
    assert samples["vllm:spec_decode_num_drafts_total"] > 0


def test_draft_model_in_the_shared_pool_of_a_served_model(checkpoints):
    """``build_engines`` (the server's pool: strided per-model views of one byte buffer): the draft's
    KV aliases those views, and the output is that of no speculation."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = LLM(checkpoints["llama"], device="cpu", dtype="float32").generate(
        {"prompt_token_ids": PROMPT}, params, use_tqdm=False
    )[0]
    draft = {"method": "draft_model", "model": checkpoints["llama"], "num_speculative_tokens": 3}
    engine = build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(speculative_config=draft))["llama"]
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.outputs[0].token_ids == want.outputs[0].token_ids
    assert engine.spec_stats.num_accepted_tokens > 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.slow  # the core process imports torch and loads its model: seconds
def test_engine_core_process_speculates_with_the_same_answers(checkpoints):
    """QSERVE_ENABLE_MULTIPROCESSING's engine core: the host config (speculative_config included)
    is pickled to the core; several tokens per step reach the front end's output processor (stop
    strings are found there), and the counters come back with the core's live numbers."""
    from qserve.engine.core.client import EngineCoreClient

    llm = LLM(checkpoints["llama"], device="cpu", dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = llm.generate({"prompt_token_ids": PROMPT}, greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    client = EngineCoreClient.launch([ModelSpec("llama", checkpoints["llama"])], host_config(speculative_config=NGRAM))
    with serve(create_app(client, log_stats=False)) as url:
        body = {"model": "llama", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == text
        choice = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (cut.text, "stop")
        for _ in range(100):  # the live numbers arrive with outputs and when the core idles
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            if "vllm:spec_decode_num_accepted_tokens_total" in metrics:
                break
            time.sleep(0.1)
    accepted = [
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "vllm:spec_decode_num_accepted_tokens_total"
    ]
    assert accepted and accepted[0] > 0
