"""Tenants (issue 17, item 7): the config file, admission limits, 429 with Retry-After, per-tenant
metrics, and fair seat sharing: while one tenant floods the server, another's p99 TTFT stays
within 2x of its idle value (and without tenants it does not: the test can fail)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

from qserve.bench.metrics import percentile
from qserve.engine.async_engine import AsyncEngine, ModelSpec, RequestItem, build_engines
from qserve.sampling_params import SamplingParams
from qserve.server.app import create_app
from qserve.tenants import TenantLimitError, Tenants, load_tenants, parse_tenants
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint
from tests.server.conftest import host_config, serve

TENANTS = {
    "tenants": {
        "alice": {"api_keys": ["key-alice"], "weight": 1},
        "bob": {"api_keys": ["key-bob", "key-bob-2"], "weight": 1, "max_concurrent": 1, "max_queued": 0},
        "small": {"api_keys": ["key-small"], "tokens_per_minute": 120},
    }
}


# ---------------------------------------------------------------------- config and admission
def test_config_errors_name_the_tenant_and_field(tmp_path):
    with pytest.raises(ValueError, match="tenant 'x' has unknown field"):
        parse_tenants({"tenants": {"x": {"api_keys": ["k"], "wieght": 2}}})
    with pytest.raises(ValueError, match="tenant 'x': weight must be positive"):
        parse_tenants({"tenants": {"x": {"api_keys": ["k"], "weight": 0}}})
    # json reads Infinity and NaN; a key with a space can never arrive in a Bearer header.
    for text, match in [
        ('{"tenants": {"x": {"api_keys": ["k"], "weight": Infinity}}}', "tenant 'x': weight must be a finite"),
        ('{"tenants": {"x": {"api_keys": ["k"], "weight": NaN}}}', "tenant 'x': weight must be a finite"),
        ('{"tenants": {"x": {"api_keys": ["k"], "weight": -1}}}', "tenant 'x': weight must be positive"),
        ('{"tenants": {"x": {"api_keys": ["k"], "max_queued": Infinity}}}', "tenant 'x': max_queued must be"),
        ('{"tenants": {"x": {"api_keys": ["sk alice"]}}}', "tenant 'x' has an API key with whitespace"),
        ('{"tenants": {"x": {"api_keys": ["sk\\talice"]}}}', "tenant 'x' has an API key with whitespace"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_tenants(json.loads(text))
    with pytest.raises(ValueError, match="tenant 'x' needs api_keys"):
        parse_tenants({"tenants": {"x": {"api_keys": []}}})
    with pytest.raises(ValueError, match="also tenant 'x'"):
        parse_tenants({"tenants": {"x": {"api_keys": ["k"]}, "y": {"api_keys": ["k"]}}})
    path = tmp_path / "t.json"
    path.write_text("{nope")
    with pytest.raises(ValueError, match="t.json: not JSON"):
        load_tenants(path)
    path.write_text(json.dumps(TENANTS))
    assert load_tenants(path)["bob"].max_in_flight == 1


def test_token_bucket_refills_and_refunds():
    now = [0.0]
    tenants = Tenants(parse_tenants(TENANTS), clock=lambda: now[0])
    assert tenants.tenant_for_key("key-bob-2").name == "bob" and tenants.tenant_for_key("nope") is None
    first = tenants.admit("small", 10, 50)  # 60 of 120
    tenants.admit("small", 10, 50)  # 120 of 120
    with pytest.raises(TenantLimitError) as err:
        tenants.admit("small", 10, 20)
    assert err.value.reason == "tokens" and err.value.retry_after_s == 15  # 30 tokens at 2/s
    tenants.release(first, generated_tokens=10)  # 40 of its 50 unused come back
    tenants.release(first, generated_tokens=10)  # idempotent
    tenants.admit("small", 10, 20)
    with pytest.raises(TenantLimitError, match="more than tenant 'small'") as err:
        tenants.admit("small", 100, 100)
    assert err.value.reason == "too_large"
    now[0] += 60.0  # a minute later the bucket is full again
    tenants.admit("small", 10, 100)
    bob = tenants.admit("bob", 1, 1)
    with pytest.raises(TenantLimitError) as err:
        tenants.admit("bob", 1, 1)
    assert err.value.reason == "queue"
    tenants.release(bob, 1)
    tenants.admit("bob", 1, 1)
    assert tenants.stats()["small"]["rejected"] == {"tokens": 1, "too_large": 1}


def test_limits_count_sequences_not_requests():
    """Issue 31: a tenant limited to 3 in flight queued 1,024 sequences with one request."""
    tenants = Tenants(parse_tenants({"tenants": {"t": {"api_keys": ["k"], "max_concurrent": 1, "max_queued": 2}}}))
    with pytest.raises(TenantLimitError, match="asks for 1024 sequences") as err:
        tenants.admit("t", 8, 8, sequences=1024)
    assert err.value.reason == "too_large"
    two = tenants.admit("t", 1, 1, sequences=2)
    with pytest.raises(TenantLimitError, match="2 sequences in flight") as err:
        tenants.admit("t", 1, 1, sequences=2)
    assert err.value.reason == "queue"
    one = tenants.admit("t", 1, 1)
    assert tenants.stats()["t"]["sequences_in_flight"] == 3 and tenants.stats()["t"]["in_flight"] == 2
    tenants.release(two, 0)
    tenants.release(one, 0)
    tenants.admit("t", 1, 1, sequences=3)


# ---------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def tenant_server(checkpoints):
    host = AsyncEngine(build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(max_num_seqs=4)))
    app = create_app(host, tenants=Tenants(parse_tenants(TENANTS)), api_key="admin-key")
    with serve(app) as url:
        yield url


def _post(url: str, key: str | None, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": "llama", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=60)


def test_keys_map_to_tenants_and_limits_answer_429(tenant_server):
    url = tenant_server
    assert _post(url, None).status_code == 401
    assert _post(url, "key-nobody").status_code == 401
    assert _post(url, "key-alice").status_code == 200
    too_large = _post(url, "key-small", max_tokens=200)
    assert too_large.status_code == 429 and too_large.json()["error"]["type"] == "RateLimitError"
    assert "tokens_per_minute" in too_large.json()["error"]["message"]
    assert _post(url, "key-small", max_tokens=100, ignore_eos=True).status_code == 200  # 103 of 120 used
    over = _post(url, "key-small", max_tokens=100, ignore_eos=True)
    assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
    # n counts: bob may have 1 sequence in flight, so n=2 can never be admitted.
    fan_out = _post(url, "key-bob", n=2)
    assert fan_out.status_code == 429 and "asks for 2 sequences" in fan_out.json()["error"]["message"]
    # With tenants every route but the probes needs a key; the server's key reads all of /metrics.
    assert httpx.get(f"{url}/metrics").status_code == 401
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer admin-key"}).text
    assert 'qserve:tenant_requests_rejected_total{reason="tokens",tenant="small"} 1.0' in metrics
    assert 'qserve:tenant_requests_in_flight{tenant="small"} 0.0' in metrics  # released at the end
    assert 'qserve:tenant_time_to_first_token_seconds_count{tenant="alice"}' in metrics
    assert "vllm:" in metrics
    # A tenant's key reads its own series only (issue 31: alice read small's and the server's).
    own = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer key-alice"}).text
    assert 'qserve:tenant_time_to_first_token_seconds_count{tenant="alice"}' in own
    assert "# TYPE qserve:tenant_requests_in_flight gauge" in own
    assert 'tenant="small"' not in own and 'tenant="bob"' not in own and "vllm:" not in own


# ---------------------------------------------------------------------- fairness under a flood
FLOOD = 24
PROBES = 12


async def _ttfts(host: AsyncEngine, flood: bool, tag: str, fair: bool = True) -> list[tuple[float, int]]:
    """Bob's TTFTs for PROBES sequential requests, while alice floods the 4 seats (or not): seconds,
    and engine steps from submission to the first token. Alice's streams are not read (their
    outputs queue up), so the event loop only serves bob."""

    def item(request_id: str, tenant: str, prompt: list[int], max_tokens: int) -> list[RequestItem]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [RequestItem(request_id, {"prompt_token_ids": prompt}, params, tenant)]

    async def probe(request_id: str) -> tuple[float, int]:
        prompt = [(7 * len(request_id) + j) % 300 + 3 for j in range(200)]  # prefill dominates its TTFT
        start, steps = time.monotonic(), host.num_steps
        stream = await host.submit("llama", item(request_id, "bob", prompt, 2))
        first = None
        async for _, output in stream:
            if first is None and output.outputs[0].token_ids:
                first = (time.monotonic() - start, host.num_steps - steps)
        return first

    flooding = []
    if flood:
        for i in range(FLOOD):
            flooding.append(await host.submit("llama", item(f"{tag}-a{i}", "alice", [3 + i % 50] * 20, 100)))
        await asyncio.sleep(0.2)  # alice holds every seat
    else:
        await probe(f"{tag}-warm-up")  # not counted
    ttfts = []
    for i in range(PROBES):
        ttfts.append(await probe(f"{tag}-b{i}"))
        await asyncio.sleep(0.01)
    if flood:
        # (Without fair shares the probes wait for the flood to drain: then it may be over.)
        still_running = host.stats()["llama"]["num_running"] > 0
        assert not fair or still_running, "the flood ended before the probes: make it longer"
        for stream in flooding:
            stream.abort()
    return ttfts


@pytest.fixture(scope="module")
def wider_llama(tmp_path_factory) -> str:
    """Wide enough that a 200-token prefill costs several decode steps, as on real models (on the
    smallest test model every step is Python overhead, and one step more doubles any TTFT)."""
    model = make_tiny_model("LlamaForCausalLM", seed=5, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    return str(save_tiny_checkpoint(model, tmp_path_factory.mktemp("wider-llama")))


@pytest.mark.parametrize("with_tenants", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_flooding_tenant_does_not_push_another_past_twice_its_idle_ttft(wider_llama, with_tenants):
    engines = build_engines([ModelSpec("llama", wider_llama)], host_config(max_num_seqs=4))
    if with_tenants:
        engines["llama"].scheduler.set_tenants({"alice": 1.0, "bob": 1.0})
    host = AsyncEngine(engines)

    async def main() -> tuple[list[float], list[float]]:
        host.start()
        try:
            idle = await _ttfts(host, False, "idle")
            flooded = await _ttfts(host, True, "flood", fair=with_tenants)
            return idle, flooded
        finally:
            await asyncio.to_thread(host.shutdown)

    idle, flooded = asyncio.run(main())
    # TTFT counted in engine steps is exact. Wall time is printed, not checked: on a CPU shared with
    # other jobs a thread that computes without pause (the flood keeps the step thread busy) gets a
    # smaller share of the cores than one that mostly sleeps (the idle run), which alone moved the
    # median 1-5x between runs here; `qserve bench` measures wall-clock TTFT on a real machine.
    idle_steps, flood_steps = percentile([n for _, n in idle], 99), percentile([n for _, n in flooded], 99)
    idle_s, flood_s = [t for t, _ in idle], [t for t, _ in flooded]
    print(
        f"bob's TTFT p99: idle {idle_steps:.0f} steps / {percentile(idle_s, 99) * 1e3:.0f} ms, alice flooding "
        f"{flood_steps:.0f} steps / {percentile(flood_s, 99) * 1e3:.0f} ms; medians {statistics.median(idle_s) * 1e3:.0f} "
        f"/ {statistics.median(flood_s) * 1e3:.0f} ms"
    )
    if with_tenants:
        assert flood_steps <= 2 * idle_steps, (idle, flooded)
    else:  # FCFS: bob waits for alice's requests to finish
        assert flood_steps > 2 * idle_steps, (idle, flooded)


def test_a_bad_tenants_file_is_refused_before_the_models_load(tmp_path, monkeypatch):
    """NaN used to be refused only by the scheduler, after the models had loaded."""
    from qserve.cli import build_parser
    from qserve.commands import serve as serve_command

    path = tmp_path / "tenants.json"
    path.write_text('{"tenants": {"x": {"api_keys": ["k"], "weight": NaN}}}')
    monkeypatch.setattr(serve_command, "build_host_factory", lambda args: pytest.fail("the models started loading"))
    argv = ["serve", "--tenants", str(path)]
    with pytest.raises(ValueError, match="tenants.json: tenant 'x': weight must be a finite"):
        serve_command.run(build_parser(argv).parse_args(argv))
