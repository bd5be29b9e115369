"""``qserve serve --api-server-count 2`` (issue 27): two API server processes share one listening
port and one engine-core process. Both serve (``X-Qserve-Api-Server`` names which) and take a
fair share of new connections (each its own SO_REUSEPORT socket on Linux), greedy
answers equal one process's, ``/metrics`` sums both processes' counters (and counts each engine
step once), a stored response is found through either process, a killed API server's requests are
aborted in the core (their pages freed) and, as in vLLM, the run then stops (the other drains; exit
1) without leaving the run's directory, SIGINT drains both and the core (exit 0), and a dead core
turns into 503s everywhere and exit status 1. Real processes: each server costs seconds to start."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint
from tests.server.conftest import host_config, serve, wait_for
from tests.server.sse_client import Stream
from tests.server.test_serve_command import REPO, _free_port, wait_until_healthy

pytestmark = pytest.mark.slow

CONTEXT = 4096  # long streams outlive the test's actions
PAGES = 700
SERVER_HEADER = "x-qserve-api-server"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    model = make_tiny_model("LlamaForCausalLM", seed=0, max_position_embeddings=CONTEXT)
    return str(save_tiny_checkpoint(model, tmp_path_factory.mktemp("tiny")))


@contextlib.contextmanager
def api_servers(checkpoint: str, run_dir: Path, *extra: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``qserve serve --api-server-count 2``; its temporary files go under ``run_dir`` (TMPDIR)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "qserve.cli", "serve", f"tiny={checkpoint}", "--port", str(port)]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(CONTEXT), "--num-kv-blocks", str(PAGES)]
    cmd += ["--max-num-seqs", "8", "--api-server-count", "2", "--no-ui", "--disable-log-requests", *extra]
    env = {
        k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "QSERVE_ENABLE_MULTIPROCESSING")
    }
    env["TMPDIR"] = str(run_dir)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, timeout_s=120)
        ready = set()  # each process becomes ready on its own (it loads its tokenizers)
        deadline = time.monotonic() + 60
        while ready != {"0", "1"}:
            assert time.monotonic() < deadline, f"only API server(s) {sorted(ready)} became ready"
            reply = httpx.get(f"{url}/health", headers={"Connection": "close"})
            if reply.status_code == 200:
                ready.add(reply.headers[SERVER_HEADER])
        yield proc, url
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children():
                child.kill()
            proc.kill()
            proc.wait()


def processes(proc: subprocess.Popen) -> dict[str, psutil.Process]:
    """The server's children: ``core`` and ``api0`` / ``api1`` (by their command lines)."""
    found = {}
    for child in psutil.Process(proc.pid).children():
        cmdline = child.cmdline()
        if "qserve.engine.core.core" in cmdline:
            found["core"] = child
        elif "qserve.commands.api_server_worker" in cmdline:
            found[f"api{cmdline[-1]}"] = child
    return found


class ServedStream(Stream):
    """A streamed completion that also records which API server answered it (and, through its
    logprobs, how many tokens it received)."""

    server: str | None = None

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(url, max_tokens, model="tiny")
        self.body["logprobs"] = 0
        self.stopped = False

    def stop(self) -> None:
        """Hang up (the server aborts the request) and wait for the thread to end."""
        self.stopped = True
        self.join(timeout=10)

    def num_tokens(self) -> int:
        chunks = [json.loads(e) for e in list(self.events) if e != "[DONE]"]
        return sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if "choices" in c)

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as reply:
                assert reply.status_code == 200
                self.server = reply.headers[SERVER_HEADER]
                for line in reply.iter_lines():
                    if self.stopped:
                        return
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except BaseException as err:  # noqa: BLE001 - read by the test
            self.error = err


def streams_on_each_server(url: str, max_tokens: int, tries: int = 10) -> dict[str, list[ServedStream]]:
    """Long streams, at least one on each API server; the streams of each. The kernel gives each
    connection to a process that accepts it, and a process busy streaming tends to win the next
    one: so start a few at once while both are idle, and hang up and retry if one took them all."""
    for _ in range(tries):
        streams = [ServedStream(url, max_tokens) for _ in range(3)]
        for stream in streams:
            stream.start()
        assert wait_for(lambda group=streams: all(s.events or s.error is not None for s in group), timeout=30)
        assert all(s.error is None for s in streams), [s.error for s in streams]
        by_server: dict[str, list[ServedStream]] = {}
        for stream in streams:
            by_server.setdefault(stream.server, []).append(stream)  # type: ignore[arg-type]
        if len(by_server) == 2:
            return by_server
        for stream in streams:
            stream.stop()
        assert wait_for(lambda: samples(url)['vllm:num_requests_running{model_name="tiny"}'] == 0, timeout=10)
    raise AssertionError(f"{tries} times, every stream went to one API server")


def _exited(process: psutil.Process) -> bool:
    """Gone, or a zombie (exited, its sockets closed, its parent not yet told)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def _samples_after_one_reset(url: str) -> dict[str, float]:
    try:
        return samples(url)
    except httpx.ReadError:
        return samples(url)


def _completion(url: str, body: dict) -> tuple[str, dict]:
    # A connection of its own each time, so the kernel hands each one to either process.
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers={"Connection": "close"})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    data.pop("id"), data.pop("created")
    return reply.headers.get(SERVER_HEADER), data  # None: a server of one process


# ---------------------------------------------------------------------- two front ends, one core
@pytest.fixture(scope="module")
def two(checkpoint, tmp_path_factory) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """(the server, its URL, one process's URL with the same model and settings)."""
    engines = build_engines([ModelSpec("tiny", checkpoint)], host_config(max_model_len=CONTEXT, num_kv_blocks=PAGES))
    with serve(create_app(AsyncEngine(engines), log_stats=False, ui=False)) as reference:
        with api_servers(checkpoint, tmp_path_factory.mktemp("run")) as (proc, url):
            yield proc, url, reference


def test_both_api_servers_serve_and_answer_as_one_process(two):
    _, url, reference = two
    # (no logprobs here: a batch of other requests moves them in the last bits, in one process too)
    bodies = [
        {"model": "tiny", "prompt": f"{w} b c", "max_tokens": 16, "temperature": 0}
        for w in ("a", "x", "hello", "z y", "one two", "b", "c d e", "q")
    ] * 4
    servers = set()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for body, (server, data) in zip(bodies, pool.map(lambda b: _completion(url, b), bodies)):
            servers.add(server)
            assert data == _completion(reference, body)[1], body
    for _ in range(40):  # each process took some (the kernel decides: retry until both did)
        if len(servers) == 2:
            break
        servers.add(_completion(url, bodies[0])[0])
    assert servers == {"0", "1"}
    # streamed, with a stop string found in the front end: the chunks equal one process's
    text = _completion(reference, bodies[2])[1]["choices"][0]["text"]
    assert len(text) > 8, text
    body = {**bodies[2], "stop": [text[4:7]], "stream": True, "logprobs": 1}
    assert _sse(url, body) == _sse(reference, body)


def _sse(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                chunk.pop("id"), chunk.pop("created")
                chunks.append(chunk)
    assert len(chunks) > 2
    return chunks


def test_metrics_are_summed_over_both_api_servers(two):
    _, url, reference = two
    success = 'vllm:request_success_total{finished_reason="length",model_name="tiny"}'
    step_sum = 'vllm:iteration_tokens_total_sum{model_name="tiny"}'
    assert wait_for(lambda: samples(url).get('vllm:num_requests_running{model_name="tiny"}') == 0, timeout=10)
    before, reference_before = samples(url), samples(reference)
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 8, "temperature": 0}
    servers = [_completion(url, body)[0] for _ in range(12)]
    while set(servers) != {"0", "1"}:  # the counts below come from both processes
        assert len(servers) < 80, servers
        servers.append(_completion(url, body)[0])
    n = len(servers)
    for _ in range(n):
        _completion(reference, body)
    assert wait_for(lambda: samples(url).get('vllm:num_requests_running{model_name="tiny"}') == 0, timeout=10)
    for _ in range(4):  # whichever process answers the scrape, the same sums
        after = samples(url)
        assert after[success] - before.get(success, 0) == n
        generated = after['vllm:generation_tokens_total{model_name="tiny"}']
        assert generated - before.get('vllm:generation_tokens_total{model_name="tiny"}', 0) == n * 8
        assert after['vllm:e2e_request_latency_seconds_count{model_name="tiny"}'] >= n
    # Each engine step is counted by one process: the tokens the steps ran, as in one process (within
    # a token a request: how a request's last step meets the next one's first varies; twice as many
    # would be counted if every process counted every step).
    steps = after[step_sum] - before.get(step_sum, 0)
    one_process = samples(reference)[step_sum] - reference_before.get(step_sum, 0)
    assert one_process - n <= steps <= one_process + n and one_process > 4 * n, (steps, one_process)
    assert after['qserve:pool_pages_total{model_name="tiny"}'] == PAGES  # the core's live numbers


def test_a_stored_response_is_found_through_either_api_server(two):
    _, url, _ = two
    ids = []
    for i in range(6):
        body = {"model": "tiny", "input": f"hi {i}", "max_output_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{url}/v1/responses", json=body, headers={"Connection": "close"}, timeout=60)
        assert reply.status_code == 200, reply.text
        ids.append((reply.headers[SERVER_HEADER], reply.json()["id"]))
    seen = set()
    for stored_by, response_id in ids:
        for _ in range(6):  # fresh connections: some land on the other process
            reply = httpx.get(f"{url}/v1/responses/{response_id}", headers={"Connection": "close"})
            assert reply.status_code == 200, (stored_by, reply.text)
            seen.add((stored_by, reply.headers[SERVER_HEADER]))
    assert any(a != b for a, b in seen), seen  # read through the process that did not store it
    follow = {"model": "tiny", "input": "and?", "previous_response_id": ids[0][1], "max_output_tokens": 4}
    for _ in range(4):
        reply = httpx.post(f"{url}/v1/responses", json=follow, headers={"Connection": "close"}, timeout=60)
        assert reply.status_code == 200, reply.text


SPREAD_CONNECTIONS = 300


def connection_spread(url: str, concurrency: int, completion: bool) -> collections.Counter[str]:
    """Which API server took each of ``SPREAD_CONNECTIONS`` new connections, ``concurrency`` at a
    time: a one-token completion on each (``completion``), or ``/health``."""
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 1, "temperature": 0}

    def one(_: int) -> str:
        if completion:
            reply = httpx.post(f"{url}/v1/completions", json=body, headers={"Connection": "close"}, timeout=60)
        else:
            reply = httpx.get(f"{url}/health", headers={"Connection": "close"}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.headers[SERVER_HEADER]

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return collections.Counter(pool.map(one, range(SPREAD_CONNECTIONS)))


def test_new_connections_spread_evenly_over_both_api_servers(two):
    """With one listening socket shared by both processes, whichever wakes first accepts: one took
    65-83% of 200 sequential one-token completions (336 of 400 in this test). Each API server's own
    SO_REUSEPORT socket lets the kernel hash connections over them (measured 48-52%). Each must take
    35% of 300 here: the hash does not depend on the machine's load, and a fair coin falls below 35%
    of 300 about once in 10^7 runs. (16 concurrent /health probes spread evenly with the shared
    socket too: no case of its own.)"""
    _, url, _ = two
    spread = connection_spread(url, 1, completion=True)
    assert min(spread.get("0", 0), spread.get("1", 0)) >= 0.35 * SPREAD_CONNECTIONS, spread


# ---------------------------------------------------------------------- failures and shutdown
def test_a_killed_api_server_frees_its_pages_then_the_run_stops_with_exit_1(checkpoint, tmp_path):
    """As vLLM's launcher: one API server's death stops the run (exit 1, for the supervisor to
    restart every process) instead of serving on with fewer; its requests' pages come back in the
    core at once, and the other API server drains as on SIGTERM."""
    with api_servers(checkpoint, tmp_path, "--shutdown-timeout", "8") as (proc, url):
        streams = streams_on_each_server(url, CONTEXT - 100)
        running = 'vllm:num_requests_running{model_name="tiny"}'
        total = sum(len(s) for s in streams.values())
        assert wait_for(lambda: samples(url)[running] == total, timeout=10)
        (run_dir,) = tmp_path.glob("qserve-run-*")
        names = {p.name.split("_")[0] for p in (run_dir / "metrics").glob("*.db")}
        assert names >= {"histogram", "counter"}  # prometheus_client's multiprocess files, in the run's directory
        assert wait_for(lambda: min(s.num_tokens() for s in streams["0"]) >= 160, timeout=60)  # 10+ pages each
        api0 = processes(proc)["api0"]
        api0.kill()
        killed = time.monotonic()
        # Gone before the probes: the two API servers share the port, and a connection the kernel handed
        # to the dying one's socket was reset (httpx.ReadError in a CI run, 2026-12-05)
        assert wait_for(lambda: _exited(api0), timeout=10)
        # The core aborted its requests (API server 1, draining now, still answers the probes). A probe
        # connection was reset here twice in local full runs even after the wait above (2026-12-05 and -06;
        # cause not found): one reset probe is retried, a server that stops answering still fails.
        assert wait_for(lambda: _samples_after_one_reset(url)[running] == len(streams["1"]), timeout=5), samples(url)
        # Their pages came back: what is held is what API server 1's streams need (a prompt page,
        # a page per 16 tokens, one ahead), far less than the killed streams' 10 or more each.
        used = samples(url)['qserve:pool_pages_used{model_name="tiny"}']
        assert used <= sum((s.num_tokens() + 2) // 16 + 2 for s in streams["1"]), used
        # API server 1 drains: no new work, /health fails (the balancer stops sending it any).
        assert httpx.get(f"{url}/health").status_code == 503
        short = {"model": "tiny", "prompt": "a b", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=short).status_code == 503
        for stream in streams["0"]:
            stream.join(timeout=10)
            assert stream.error is not None  # its connection died with its process
        # The run stops within --shutdown-timeout, exit 1; API server 1's streams ended cleanly
        # (cut with 'abort' at its drain deadline, unless they finished first).
        assert proc.wait(timeout=20) == 1, proc.stdout.read()
        assert time.monotonic() - killed <= 8 + 1.0
        for stream in streams["1"]:
            stream.join(timeout=10)
            assert stream.finish_reason() in ("abort", "length")
        output = proc.stdout.read()
        assert "API server 0" in output and "every process stopped" in output, output
        assert "Traceback" not in output, output
        assert not list(tmp_path.glob("qserve-run-*"))  # sockets, metrics files, store: gone


def test_a_dead_core_means_503_from_every_api_server_and_exit_1(checkpoint, tmp_path):
    with api_servers(checkpoint, tmp_path) as (proc, url):
        streams = streams_on_each_server(url, CONTEXT - 100)
        processes(proc)["core"].kill()
        for server, stream in ((server, s) for server, group in streams.items() for s in group):
            stream.join(timeout=15)
            assert stream.events[-1] == "[DONE]", (server, stream.events[-3:])
            error = json.loads(stream.events[-2])["error"]
            assert error["code"] == 503 and "engine core process died" in error["message"], (server, error)
        try:
            assert httpx.get(f"{url}/health").status_code == 503
        except httpx.TransportError:
            pass  # or already gone
        assert proc.wait(timeout=30) == 1
        output = proc.stdout.read()
        assert "engine core process died" in output, output
        assert not list(tmp_path.glob("qserve-run-*"))


def test_sigterm_drains_every_api_server_within_the_timeout_and_exits_0(checkpoint, tmp_path):
    """SIGTERM to the parent (what Kubernetes sends) reaches every API server; each drains (503 to
    new work, its streams end with 'abort' at the deadline), the core exits after them, and the
    parent exits 0 within --shutdown-timeout, leaving no files."""
    with api_servers(checkpoint, tmp_path, "--shutdown-timeout", "6") as (proc, url):
        streams = streams_on_each_server(url, CONTEXT - 100)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        short = {"model": "tiny", "prompt": "a b", "max_tokens": 4, "temperature": 0}
        assert wait_for(lambda: httpx.post(f"{url}/v1/completions", json=short).status_code == 503, timeout=5)
        assert proc.wait(timeout=20) == 0, proc.stdout.read()
        # the streams had their wait, and the exit followed the deadline: 3 s of slack for three processes'
        # teardown on a CI machine whose cores the niced launch compiles share (7.6 s once with 1 s of it)
        assert 6 * 0.5 <= time.monotonic() - signalled <= 6 + 3.0
        for stream in (s for group in streams.values() for s in group):
            stream.join(timeout=10)
            assert stream.finish_reason() == "abort"
        output = proc.stdout.read()
        assert "Traceback" not in output, output
        assert not list(tmp_path.glob("qserve-run-*"))


def test_ctrl_c_reaches_the_api_servers_through_the_parent(checkpoint, tmp_path):
    """A terminal's Ctrl-C reaches only the parent (the API servers run in sessions of their own,
    so none gets it twice); passed on, it drains without waiting, as one server does; exit 0."""
    with api_servers(checkpoint, tmp_path) as (proc, url):
        api = [p for name, p in processes(proc).items() if name.startswith("api")]
        assert all(os.getsid(p.pid) != os.getsid(proc.pid) for p in api)
        streams = streams_on_each_server(url, CONTEXT - 100)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0, proc.stdout.read()
        assert time.monotonic() - started < 10  # no drain wait (the default --shutdown-timeout is 25 s)
        for stream in (s for group in streams.values() for s in group):
            stream.join(timeout=10)
            assert stream.finish_reason() == "abort"
