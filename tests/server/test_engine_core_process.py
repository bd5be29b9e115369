"""The engine core in its own process (``QSERVE_ENABLE_MULTIPROCESSING=1``, issue 27): the same
answers as the in-process engine (completions, chat, streamed or not, logprobs, n, stop strings,
two models on one pool), one ``/metrics`` view, a client that leaves aborts its request in the
core (pages freed), a drain ends the core's streams with 'abort', and a core that dies turns
into 503s (for requests in flight too), a failing ``/health``, an error event in open streams and
a non-zero exit of ``qserve serve``; a server process killed outright takes its core along. Each test module-shares one core process; spawning one costs seconds."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest
import zmq

from qserve.engine.async_engine import EngineDeadError, ModelSpec
from qserve.engine.core.client import EngineCoreClient
from qserve.engine.kv_events import KVEventsConfig
from qserve.server.app import create_app, drain_app
from tests.server.conftest import host_config, serve, wait_for
from tests.server.sse_client import start_streams

pytestmark = pytest.mark.slow  # each core process imports torch and loads its models: seconds
LONG = 480  # tokens of a stream that outlives the test's actions (the cores of those tests allow 512)


@pytest.fixture(scope="module")
def servers(checkpoints, two_model_server):
    """(split-mode URL, in-process URL, the split server's client): the same two models on one
    pool each, the same settings (the in-process one is the session's ``two_model_server``)."""
    specs = [ModelSpec("llama", checkpoints["llama"]), ModelSpec("qwen", checkpoints["qwen"])]
    client = EngineCoreClient.launch(specs, host_config())
    client.output_chunk_size = 1  # every output its own chunk: the answers below come through the loop's yields
    with serve(create_app(client, log_stats=False)) as split_url:
        yield split_url, two_model_server.url, client
    assert client.process.returncode == 0  # the app's shutdown stopped the core cleanly


def _post(url: str, path: str, body: dict) -> dict:
    reply = httpx.post(f"{url}/v1/{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    data.pop("id", None), data.pop("created", None)
    return data


def _stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/{path}", json={**body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                chunk.pop("id"), chunk.pop("created")
                chunks.append(chunk)
    return chunks


COMPLETIONS = [
    {"model": "llama", "prompt": "a b c d", "max_tokens": 24, "temperature": 0},
    {"model": "qwen", "prompt": "hello there", "max_tokens": 24, "temperature": 0, "logprobs": 2, "echo": True},
    {"model": "llama", "prompt": ["x y", "z"], "max_tokens": 16, "temperature": 0.9, "seed": 7, "n": 2},
    {"model": "qwen", "prompt": "one two", "max_tokens": 20, "temperature": 0, "stop": ["e", "a"]},
]


def test_completions_equal_the_in_process_engine(servers):
    split_url, url, _ = servers
    for body in COMPLETIONS:
        assert _post(split_url, "completions", body) == _post(url, "completions", body), body
    # a stop string the core cannot see: found in the front end, the output cut there as in-process
    text = _post(url, "completions", COMPLETIONS[0])["choices"][0]["text"]
    body = {**COMPLETIONS[0], "stop": [text[6:9]], "include_stop_str_in_output": False}
    split = _post(split_url, "completions", body)
    assert split == _post(url, "completions", body)
    assert split["choices"][0]["finish_reason"] == "stop" and split["usage"]["completion_tokens"] < 24
    embed = {"model": "qwen", "input": ["a b", "c"]}
    assert _post(split_url, "embeddings", embed) == _post(url, "embeddings", embed)


def test_streams_equal_the_in_process_engine(servers):
    split_url, url, _ = servers
    chat = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
    assert _post(split_url, "chat/completions", chat) == _post(url, "chat/completions", chat)
    stop = {**COMPLETIONS[0], "stop": [" "], "logprobs": 1, "stream_options": {"include_usage": True}}
    for path, body in (("chat/completions", chat), ("completions", COMPLETIONS[2]), ("completions", stop)):
        split = _stream(split_url, path, body)
        assert split == _stream(url, path, body), body
        assert len(split) > 2  # streamed token by token


def test_metrics_are_one_view_of_core_and_front_end(servers):
    split_url, _, client = servers
    _post(split_url, "completions", COMPLETIONS[0])
    assert wait_for(lambda: client.stats()["llama"]["num_running"] == 0, timeout=5)
    text = httpx.get(f"{split_url}/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert samples['vllm:generation_tokens_total{model_name="llama"}'] >= 24  # front end: per request
    assert samples['vllm:iteration_tokens_total_count{model_name="llama"}'] >= 24  # core: per step
    assert samples['qserve:pool_pages_total{model_name=""}'] == 96  # core: the shared pool, both models
    assert samples['vllm:num_requests_running{model_name="llama"}'] == 0
    assert samples['vllm:prefix_cache_queries_total{model_name="llama"}'] > 0
    assert httpx.get(f"{split_url}/health").status_code == 200


def test_a_client_that_leaves_aborts_its_request_in_the_core(servers):
    split_url, _, client = servers
    body = {"model": "llama", "prompt": "a", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{split_url}/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        for _ in range(3):
            next(lines)
        assert wait_for(lambda: client.stats()["llama"]["pool_pages_used"] > 0, timeout=5)
    # the core stopped it and gave its pages back (its numbers come when it goes idle)
    assert wait_for(lambda: client.stats()["llama"]["pool_pages_used"] == 0, timeout=10), client.stats()
    assert client.stats()["llama"]["num_running"] == 0
    metrics = httpx.get(f"{split_url}/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="llama"}' in metrics


def test_unknown_requests_are_refused_as_in_process(servers):
    split_url, url, _ = servers
    for body in (
        {"model": "llama", "prompt": [1, 2, 10**6], "max_tokens": 4},  # token id outside the vocabulary
        {"model": "nope", "prompt": "a", "max_tokens": 4},
    ):
        split = httpx.post(f"{split_url}/v1/completions", json=body)
        local = httpx.post(f"{url}/v1/completions", json=body)
        assert (split.status_code, split.json()) == (local.status_code, local.json())


def test_a_drain_ends_the_cores_streams_with_abort_and_the_core_publishes_kv_events(checkpoints):
    port = _free_port()
    events = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}")
    model = [ModelSpec("llama", checkpoints["llama"])]
    client = EngineCoreClient.launch(model, host_config(max_model_len=LONG + 32), kv_events=events, port=8000)
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.connect(events.endpoint)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    app = create_app(client, log_stats=False)
    try:
        with serve(app) as url:
            time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher first
            (stream,) = start_streams(url, LONG)
            # the core published the prompt's pages, under the model's topic (vLLM's format)
            assert subscriber.poll(5000), "no KV event from the core"
            topic, _, payload = subscriber.recv_multipart()
            assert topic.decode().endswith(":8000@llama") and b"BlockStored" in payload
            started = time.monotonic()
            drained = asyncio.run_coroutine_threadsafe(drain_app(app, 0.2, flush_s=5.0), client._loop)  # noqa: SLF001
            assert drained.result(timeout=15) is False
            stream.join(timeout=10)
            assert stream.finish_reason() == "abort"
            assert time.monotonic() - started < 0.2 + 5.0 + 1.5  # the wait, the flush, the last chunk
            assert client.process.wait(timeout=5) == 0
            assert httpx.get(f"{url}/health").status_code == 503
    finally:
        subscriber.close()
        context.term()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_dead_core_means_503_and_a_failing_health(checkpoints):
    client = EngineCoreClient.launch([ModelSpec("llama", checkpoints["llama"])], host_config(max_model_len=LONG + 32))
    died: list[str] = []
    client.on_dead.append(died.append)
    app = create_app(client, log_stats=False)
    with serve(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        (stream,) = start_streams(url, LONG)
        whole = {"model": "llama", "prompt": "a", "max_tokens": LONG, "ignore_eos": True}  # not streamed
        waiting = pool.submit(httpx.post, f"{url}/v1/completions", json=whole, timeout=30)
        assert wait_for(lambda: client.stats()["llama"]["num_running"] == 2, timeout=10), client.stats()
        client.process.kill()
        stream.join(timeout=10)
        # the request in flight that was not streamed: a 503 answer, in OpenAI's shape
        reply = waiting.result(timeout=10)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["type"] == "ServiceUnavailableError"
        assert "engine core process died" in reply.json()["error"]["message"]
        error = json.loads(stream.events[-2])["error"]  # then [DONE]
        assert stream.events[-1] == "[DONE]"
        assert error["code"] == 503 and "engine core process died" in error["message"], error
        assert wait_for(lambda: bool(died), timeout=5)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "engine core process died" in health.json()["error"]["message"]
        for body in ({"model": "llama", "prompt": "a", "max_tokens": 2}, {**COMPLETIONS[0], "stream": True}):
            reply = httpx.post(f"{url}/v1/completions", json=body)
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["type"] == "ServiceUnavailableError"
            assert "engine core process died" in reply.json()["error"]["message"]
        # asking the dead core for its LoRA adapters (an unknown model name) falls back to what this
        # front end knows, instead of raising out of the request
        serving = app.state.qserve.serving
        with pytest.raises(EngineDeadError):
            asyncio.run(client.refresh_loras())
        asyncio.run(serving.refresh_lora_models("nope"))
        assert list(serving.models) == ["llama"] and serving.lora_models == {}


def test_qserve_serve_exits_non_zero_when_its_core_dies(checkpoints, monkeypatch):
    from qserve.cli import main

    monkeypatch.setenv("QSERVE_ENABLE_MULTIPROCESSING", "1")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    before = {p.pid for p in psutil.Process().children()}
    seen: dict[str, object] = {}

    def kill_the_core_mid_stream() -> None:
        try:
            assert wait_for(lambda: _healthy(url), timeout=60, interval=0.2)
            (stream,) = start_streams(url, LONG, model="tiny")
            cores = [
                p for p in psutil.Process().children() if p.pid not in before and "engine.core" in " ".join(p.cmdline())
            ]
            assert len(cores) == 1, cores
            cores[0].kill()
            stream.join(timeout=10)
            seen["last_events"] = stream.events[-2:]
        except BaseException as err:  # noqa: BLE001 - reported below
            seen["error"] = err
            os.kill(os.getpid(), signal.SIGINT)  # stop the server the test runs in this thread

    helper = threading.Thread(target=kill_the_core_mid_stream, daemon=True)
    helper.start()
    argv = ["serve", f"tiny={checkpoints['llama']}", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    argv += ["--max-model-len", str(LONG + 32), "--num-kv-blocks", "96", "--disable-log-stats", "--no-ui"]
    assert main(argv) == 1  # at once, for the supervisor to restart it
    helper.join(timeout=10)
    assert "error" not in seen, seen.get("error")
    error_event, done = seen["last_events"]  # the stream in flight was answered before the exit
    assert done == "[DONE]" and json.loads(error_event)["error"]["code"] == 503


def test_the_core_exits_with_its_killed_server_process(checkpoints, tmp_path):
    """One front end (``QSERVE_ENABLE_MULTIPROCESSING=1``): a server process killed mid-stream (no
    drain, no message to the core) takes the core, and with it every page, along within seconds."""
    import subprocess
    import sys

    from tests.server.test_serve_command import REPO, wait_until_healthy

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "qserve.cli", "serve", f"tiny={checkpoints['llama']}", "--port", str(port)]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(LONG + 32), "--num-kv-blocks", "96"]
    env = {**os.environ, "QSERVE_ENABLE_MULTIPROCESSING": "1", "TMPDIR": str(tmp_path)}  # the sockets' directory
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cores: list[psutil.Process] = []
    try:
        wait_until_healthy(proc, url, timeout_s=60)
        cores = psutil.Process(proc.pid).children()
        assert len(cores) == 1, cores
        (stream,) = start_streams(url, LONG, model="tiny")
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(cores, timeout=5)
        assert not alive, alive
        stream.join(timeout=10)
        assert stream.error is not None  # its connection died with the server
    finally:
        for core in cores:
            if core.is_running():
                core.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_the_core_process_on_the_gpu_gives_the_in_process_outputs(checkpoints):
    """On CUDA (graphs captured in the core process, async scheduling): a batch of greedy and
    seeded requests, submitted together, gives the same token ids and text as one process."""
    from qserve.engine.async_engine import AsyncEngine, RequestItem, build_engines
    from qserve.sampling_params import SamplingParams

    specs = [ModelSpec("llama", checkpoints["llama"])]
    config = host_config(device="cuda", dtype="float16", num_kv_blocks=512, max_num_seqs=16)
    params = [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)] * 8 + [
        SamplingParams(max_tokens=64, temperature=0.8, seed=i, ignore_eos=True) for i in range(8)
    ]

    async def run(host) -> list:
        host.start()
        items = [
            RequestItem(f"r{i}", {"prompt_token_ids": [5 + i, 9, 30 + i], "prompt": None}, p)
            for i, p in enumerate(params)
        ]
        final = {}
        async for request_id, output in await host.submit("llama", items):
            if output.finished:
                final[request_id] = output
        host.shutdown()
        return [final[item.request_id] for item in items]

    client = EngineCoreClient.launch(specs, config)
    split = asyncio.run(run(client))
    assert asyncio.run(run(AsyncEngine(build_engines(specs, config)))) == split
    assert client.process.returncode == 0
