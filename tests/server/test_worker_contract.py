"""The contract routers read from a vLLM-compatible worker: /metrics (scraped with
prometheus_client's parser; routers read the FIRST series of a metric), /health, /version,
/ping, /v1/models/{id}, /tokenize, /detokenize, X-Request-Id, and the request log line."""

from __future__ import annotations

import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qserve import __version__

CONTRACT_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)


def scrape(url: str) -> dict[str, list]:
    """metric family name -> its samples, in exposition order."""
    reply = httpx.get(f"{url}/metrics")
    assert reply.status_code == 200
    return {family.name: list(family.samples) for family in text_string_to_metric_families(reply.text)}


def first(samples: list, name: str):
    """The first sample called ``name``: what the endpoint picker reads."""
    return next(s for s in samples if s.name == name)


def test_first_series_is_the_process_total(two_model_server):
    # Hold pages on one model so the totals are not all zero.
    url = two_model_server.url
    body = {"model": "llama", "prompt": "a b c d e f", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        metrics = scrape(url)
    for name in CONTRACT_GAUGES:
        samples = metrics[name]
        assert [s.labels["model_name"] for s in samples] == ["", "llama", "qwen"], name
        head = first(samples, name)
        assert head.value == pytest.approx(sum(s.value for s in samples[1:])), name
    pages = first(metrics["qserve:pool_pages_used"], "qserve:pool_pages_used").value
    total = first(metrics["qserve:pool_pages_total"], "qserve:pool_pages_total").value
    assert first(metrics["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc").value == pytest.approx(pages / total)
    assert metrics["vllm:gpu_cache_usage_perc"] == [
        s._replace(name="vllm:gpu_cache_usage_perc") for s in metrics["vllm:kv_cache_usage_perc"]
    ]
    (cache,) = metrics["vllm:cache_config_info"]
    assert cache.labels["block_size"] == "16" and cache.labels["num_gpu_blocks"] == str(int(total))
    assert cache.labels["model_name"] == "" and cache.value == 1
    (lora,) = metrics["vllm:lora_requests_info"]
    # No adapters: base models are not reported as adapters (as vLLM).
    assert lora.labels["running_lora_adapters"] == "" and lora.labels["waiting_lora_adapters"] == ""
    preemptions = {s.labels["model_name"]: s.value for s in metrics["vllm:num_preemptions"]}
    engines = {name: hosted.engine for name, hosted in two_model_server.host.models.items()}
    assert preemptions == {
        "": sum(e.num_preemptions for e in engines.values()),
        **{name: e.num_preemptions for name, e in engines.items()},
    }


def test_request_histograms_count_what_was_served(two_model_server):
    url = two_model_server.url
    before = scrape(url)
    body = {"model": "qwen", "prompt": [5, 6, 7, 8, 9], "max_tokens": 7, "ignore_eos": True, "n": 2}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    after = scrape(url)

    def value(metrics, family, name):
        return next(
            (s.value for s in metrics.get(family, []) if s.name == name and s.labels.get("model_name") == "qwen"), 0.0
        )

    def delta(family, suffix):
        return value(after, family, family + suffix) - value(before, family, family + suffix)

    assert delta("vllm:request_prompt_tokens", "_count") == 1
    assert delta("vllm:request_prompt_tokens", "_sum") == usage["prompt_tokens"] == 5
    assert delta("vllm:request_generation_tokens", "_sum") == usage["completion_tokens"] == 14
    assert delta("vllm:request_queue_time_seconds", "_count") == 1
    assert delta("vllm:time_per_output_token_seconds", "_count") > 0


def test_version_ping_and_one_model(two_model_server):
    url = two_model_server.url
    assert httpx.get(f"{url}/version").json() == {"version": __version__}
    assert httpx.get(f"{url}/ping").status_code == 200
    assert httpx.post(f"{url}/ping").status_code == 200
    card = httpx.get(f"{url}/v1/models/qwen").json()
    assert card["id"] == "qwen" and card["object"] == "model" and card["max_model_len"] == 256
    missing = httpx.get(f"{url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"


def test_tokenize_and_detokenize_round_trip(two_model_server):
    url = two_model_server.url
    engine_tokenizer = two_model_server.host.models["llama"].engine.tokenizer
    reply = httpx.post(f"{url}/tokenize", json={"model": "llama", "prompt": "hello world", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["tokens"] == engine_tokenizer.encode("hello world")
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == 256
    assert data["token_strs"] == engine_tokenizer.convert_ids_to_tokens(data["tokens"])
    back = httpx.post(f"{url}/detokenize", json={"model": "llama", "tokens": data["tokens"]})
    assert back.json() == {"prompt": engine_tokenizer.decode(data["tokens"])}
    # Errors name the field.
    no_model = httpx.post(f"{url}/tokenize", json={"prompt": "x"})  # two models: model is required
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    both = httpx.post(f"{url}/tokenize", json={"model": "llama"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    oov = httpx.post(f"{url}/detokenize", json={"model": "llama", "tokens": [10**6]})
    assert oov.status_code == 400 and oov.json()["error"]["param"] == "tokens"


def test_tokenize_chat_uses_the_chat_template(two_model_server):
    url = two_model_server.url
    tokenizer = two_model_server.host.models["llama"].engine.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        pytest.skip("the tiny tokenizer has no chat template")
    messages = [{"role": "user", "content": "hi there"}]
    reply = httpx.post(f"{url}/tokenize", json={"model": "llama", "messages": messages})
    assert reply.status_code == 200, reply.text
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_new_routes_take_the_api_key(guarded_server):
    url = guarded_server.url
    assert httpx.get(f"{url}/version").status_code == 200  # open, like /health
    assert httpx.get(f"{url}/ping").status_code == 200
    for method, path, body in [
        ("GET", "/v1/models/llama", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]:
        assert httpx.request(method, f"{url}{path}", json=body).status_code == 401, path
        ok = httpx.request(method, f"{url}{path}", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200, (path, ok.text)


def test_request_id_is_echoed_and_logged(two_model_server, caplog):
    url = two_model_server.url
    body = {"model": "llama", "prompt": "hi", "max_tokens": 3}
    with caplog.at_level(logging.INFO, logger="qserve.server.request_log"):
        reply = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}, timeout=30)
    assert reply.headers["x-request-id"] == "trace-42"
    lines = [r.getMessage() for r in caplog.records if "trace-42" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    usage = reply.json()["usage"]
    assert "model=llama" in lines[0]
    assert f"prompt_tokens={usage['prompt_tokens']} output_tokens={usage['completion_tokens']}" in lines[0]
    assert "ttft=0." in lines[0] and "finish_reason=" in lines[0]
    # No usable id (a space, or too long): a fresh one is made up and echoed.
    for bad in ("has space", "x" * 200):
        made = httpx.get(f"{url}/v1/models", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert made != bad and len(made) == 32
    assert httpx.get(f"{url}/health").headers["x-request-id"]


def test_generation_config_defaults_reach_requests(two_model_server):
    hosted = two_model_server.host.models["llama"]
    hosted.sampling_defaults = {"max_tokens": 2}
    try:
        body = {"model": "llama", "prompt": "a b", "ignore_eos": True}
        reply = httpx.post(f"{two_model_server.url}/v1/completions", json=body, timeout=30)
        assert reply.json()["usage"]["completion_tokens"] == 2
        body["max_tokens"] = 4  # the client's value wins
        reply = httpx.post(f"{two_model_server.url}/v1/completions", json=body, timeout=30)
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        hosted.sampling_defaults = {}


def test_engine_counts_preemptions_and_queue_time(checkpoints):
    """What vllm:num_preemptions_total and vllm:request_queue_time_seconds are fed from."""
    from qserve import LLM, SamplingParams

    # 4 pages of 16 tokens; two 60-token sequences cannot both stay: one is preempted.
    llm = LLM(
        checkpoints["llama"],
        device="cpu",
        dtype="float32",
        num_kv_blocks=4,
        enable_prefix_caching=False,
        max_model_len=64,
    )
    # No admission watermark: both are admitted, so one must be preempted as they grow.
    llm.engine.scheduler.watermark, llm.engine.scheduler.watermark_per_running = 0.0, 0
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(30, 50))}]
    outputs = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    for output in outputs:
        assert (
            output.metrics["time_in_queue"] == output.metrics["first_scheduled_time"] - output.metrics["arrival_time"]
        )
        assert output.metrics["time_in_queue"] >= 0
