"""LoRA adapters with the engine core in its own process (issue 27 item 4, issue 30): a request's
adapter travels to the core with it and gives the in-process engine's greedy output; ``--lora-modules``
adapters are loaded in the core and listed by ``/v1/models``; runtime load / unload are executed by
the core, with the in-process answers (400 naming the field, 404 for an adapter that is not loaded);
``vllm:lora_requests_info`` shows the core's running adapters; and with ``--api-server-count 2`` a
load through one API server is listed and served by the other. Real processes: seconds each."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import zmq

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.engine.core.client import EngineCoreClient
from qserve.engine.core.core import ClientAddresses, ClientChannel, CoreConfig, EngineCore
from qserve.engine.core.core_engine import CoreEngine
from qserve.engine.core.messages import Added, AddRequests, Codec, CoreRequest, LoRAControl, LoRASpec, LoRAState
from qserve.lora.request import LoRARequest
from qserve.server import lora_routes
from qserve.server.app import create_app
from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter
from tests.server.conftest import host_config, serve, wait_for

pytestmark = pytest.mark.slow  # each core process imports torch and loads its model: seconds

SHAPES = projection_shapes(64, 128, 4, 2, 16)  # tests/helpers/tiny_models.py's Llama
CONTEXT = 512
SERVER_HEADER = "x-qserve-api-server"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("sql", "extra")):
        write_peft_adapter(root / name, SHAPES, 2, targets=("q_proj", "v_proj", "down_proj"), rank=8, alpha=16, seed=i)
    write_peft_adapter(root / "wide", SHAPES, 2, targets=("q_proj",), rank=32, alpha=16)  # over --max-lora-rank
    return root


@pytest.fixture(scope="module")
def servers(checkpoints, adapters):
    """(split-mode URL, in-process URL, the split server's client): one model with ``sql`` loaded at
    start-up and the runtime routes on, the same settings in both."""
    config = host_config(enable_lora=True, max_loras=2, max_model_len=CONTEXT)
    sql = LoRARequest("sql", 1, str(adapters / "sql"), "llama")
    engines = build_engines([ModelSpec("llama", checkpoints["llama"])], config)
    engines["llama"].add_lora(sql)
    client = EngineCoreClient.launch([ModelSpec("llama", checkpoints["llama"])], config, lora_modules=[sql])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(lora_routes.RUNTIME_UPDATE_ENV, "true")
        reference_app = create_app(AsyncEngine(engines), log_stats=False, ui=False)
        split_app = create_app(client, log_stats=False, ui=False)
    with serve(reference_app) as url, serve(split_app) as split_url:
        yield split_url, url, client
    assert client.process.returncode == 0


def _completion(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": [5, 9, 33, 2, 71], "max_tokens": 6, "temperature": 0, "logprobs": 1, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers={"Connection": "close"})


def _choices(reply: httpx.Response) -> list:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"]


def _cards(url: str) -> dict[str, dict]:
    """``/v1/models``' cards by id, without ``created`` (the time of the request: two servers asked a
    moment apart can differ by a second, which made the comparison flaky)."""
    cards = httpx.get(f"{url}/v1/models", headers={"Connection": "close"}).json()["data"]
    return {c["id"]: {k: v for k, v in c.items() if k != "created"} for c in cards}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=60, headers={"Connection": "close"})


def test_an_adapter_gives_the_in_process_output_and_is_listed(servers):
    split_url, url, _ = servers
    assert _cards(split_url) == _cards(url)
    assert _cards(split_url)["sql"]["parent"] == "llama"
    sql = _choices(_completion(split_url, "sql"))
    assert sql == _choices(_completion(url, "sql"))
    assert sql != _choices(_completion(split_url, "llama"))  # the adapter changes the model
    assert _completion(split_url, "sql").json()["model"] == "sql"


def test_runtime_load_and_unload_answer_as_in_process(servers, adapters):
    split_url, url, _ = servers
    answers = {}
    for name, where in (("split", split_url), ("in-process", url)):
        load = _post(where, "load_lora_adapter", {"lora_name": "extra", "lora_path": str(adapters / "extra")})
        listed = _cards(where)["extra"]["parent"]
        output = _choices(_completion(where, "extra"))
        again = _post(where, "load_lora_adapter", {"lora_name": "extra", "lora_path": str(adapters / "sql")})
        wide = _post(where, "load_lora_adapter", {"lora_name": "wide", "lora_path": str(adapters / "wide")})
        missing = _post(where, "load_lora_adapter", {"lora_name": "gone", "lora_path": str(adapters / "nowhere")})
        unload = _post(where, "unload_lora_adapter", {"lora_name": "extra"})
        after = _completion(where, "extra")
        twice = _post(where, "unload_lora_adapter", {"lora_name": "extra"})
        answers[name] = [
            (load.status_code, load.text),
            listed,
            output,
            (again.status_code, again.json()["error"]["param"]),
            (wide.status_code, wide.json()["error"]),
            (missing.status_code, missing.json()["error"]["param"]),
            (unload.status_code, unload.text),
            (after.status_code, after.json()["error"]["type"], after.json()["error"]["param"]),
            (twice.status_code, twice.json()["error"]),
            sorted(_cards(where)),
        ]
    assert answers["split"] == answers["in-process"]
    split = answers["split"]
    assert split[0][0] == 200 and split[1] == "llama"
    assert split[3] == (400, "lora_name") and split[4][0] == 400 and split[4][1]["param"] == "lora_path"
    assert "'r'" in split[4][1]["message"]
    assert split[7] == (404, "NotFoundError", "model") and split[8][0] == 404
    assert split[9] == ["llama", "sql"]


def test_lora_requests_info_shows_the_cores_running_adapter(servers):
    split_url, _, _ = servers
    done = threading.Event()

    def long_request() -> None:
        try:
            _completion(split_url, "sql", max_tokens=CONTEXT - 16, ignore_eos=True)
        finally:
            done.set()

    def running() -> str | None:
        for line in httpx.get(f"{split_url}/metrics").text.splitlines():
            if line.startswith("vllm:lora_requests_info{"):
                return line
        return None

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: 'running_lora_adapters="sql"' in (running() or ""), timeout=30), running()
        assert 'max_lora="2"' in running()
    finally:
        thread.join(timeout=120)
    assert done.is_set()
    assert wait_for(lambda: 'running_lora_adapters=""' in (running() or ""), timeout=10), running()


def test_the_core_runs_each_change_once_and_tells_every_front_end(checkpoints, adapters):
    """The core's loop without processes: a load from front end 0 is numbered by the core, answered
    to 0 and announced to 1; 1's request with the adapter runs with it; an unload
    from 1 makes 0's next request with it refused; unloading an unknown adapter is "not_found"."""
    engine = build_engines(
        [ModelSpec("llama", checkpoints["llama"])], host_config(enable_lora=True, max_loras=2), engine_cls=CoreEngine
    )["llama"]
    context = zmq.Context()
    channels, senders, readers = [], [], []
    for i in range(2):
        inbound, sender, reader, outbound = (context.socket(t) for t in (zmq.PULL, zmq.PUSH, zmq.PULL, zmq.PUSH))
        inbound.bind(f"inproc://lora-in{i}")
        sender.connect(f"inproc://lora-in{i}")
        reader.bind(f"inproc://lora-out{i}")
        outbound.connect(f"inproc://lora-out{i}")
        channels.append(ClientChannel(i, inbound, outbound))
        senders.append(sender)
        readers.append(reader)
    addresses = [ClientAddresses(f"inproc://lora-in{i}", f"inproc://lora-out{i}") for i in range(2)]
    loop = EngineCore({"llama": engine}, CoreConfig([], host_config(), addresses), channels)
    codec = Codec()
    path = str(adapters / "extra")

    def exchange(i: int, message) -> tuple[list, list]:
        senders[i].send(codec.encode(message))
        loop._receive(0.2)  # noqa: SLF001
        return [[codec.decode_core(r.recv()) for _ in iter(lambda r=r: r.poll(20), False)] for r in readers]

    params = {"max_tokens": 2, "temperature": 0.0}
    try:
        first, second = exchange(0, LoRAControl(7, "load", "llama", LoRASpec("extra", 99, path)))
        listed = [LoRASpec("extra", 1, path, "llama")]  # the core's id, not the front end's
        assert first == [LoRAState(listed, 7)] and second == [LoRAState(listed)]
        request = CoreRequest("r", [5, 9, 33], sampling=params, lora=listed[0])
        first, second = exchange(1, AddRequests(3, "llama", [request]))
        assert second == [Added(3)] and engine._groups["1/r"].lora_request.lora_name == "extra"  # noqa: SLF001
        first, second = exchange(1, LoRAControl(1, "unload", lora_name="extra"))
        assert first == [LoRAState([])] and second == [LoRAState([], 1)]
        first, _ = exchange(0, AddRequests(4, "llama", [request]))
        assert first[0].submit_id == 4 and first[0].error == "value" and "not loaded" in first[0].message
        _, second = exchange(1, LoRAControl(2, "unload", lora_name="extra"))
        assert second[0].error == "not_found" and "'extra'" in second[0].message
    finally:
        for sock in (*senders, *readers, *(c.inbound for c in channels), *(c.outbound for c in channels)):
            sock.close(linger=0)
        context.term()


# ---------------------------------------------------------------------- two API servers, one core
def test_a_load_through_one_api_server_is_served_by_the_other(tmp_path, adapters):
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint
    from tests.server.test_api_server_count import api_servers

    model = make_tiny_model("LlamaForCausalLM", seed=0, max_position_embeddings=4096)
    path = str(save_tiny_checkpoint(model, tmp_path / "tiny"))
    extra = ["--enable-lora", "--max-loras", "2", "--lora-modules", f"sql={adapters / 'sql'}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(lora_routes.RUNTIME_UPDATE_ENV, "true")  # the API server processes inherit it
        with api_servers(path, tmp_path, *extra) as (_, url):
            assert _cards(url)["sql"]["parent"] == "tiny"  # --lora-modules, loaded in the core
            load = _post(url, "load_lora_adapter", {"lora_name": "extra", "lora_path": str(adapters / "extra")})
            assert load.status_code == 200, load.text
            loaded_by = load.headers[SERVER_HEADER]
            seen: dict[str, list] = {}
            deadline = time.monotonic() + 60
            while set(seen) != {"0", "1"}:  # each connection goes to either process: until both answered
                assert time.monotonic() < deadline, f"only API server(s) {sorted(seen)} answered"
                reply = _completion(url, "extra", max_tokens=4)
                seen.setdefault(reply.headers[SERVER_HEADER], []).append(_choices(reply))
                models = httpx.get(f"{url}/v1/models", headers={"Connection": "close"})
                assert "extra" in {c["id"] for c in models.json()["data"]}, models.headers[SERVER_HEADER]
            assert seen["0"][0] == seen["1"][0]  # one adapter, one core: the same greedy output
            # unloaded through one: refused by both (404, the adapter is no longer served)
            unload = _post(url, "unload_lora_adapter", {"lora_name": "extra"})
            assert unload.status_code == 200, unload.text
            refused: set[str] = set()
            deadline = time.monotonic() + 60
            while refused != {"0", "1"}:
                assert time.monotonic() < deadline, f"only API server(s) {sorted(refused)} answered"
                reply = _completion(url, "extra", max_tokens=4)
                assert reply.status_code == 404, reply.text
                refused.add(reply.headers[SERVER_HEADER])
            again = _post(url, "unload_lora_adapter", {"lora_name": "extra"})
            assert again.status_code == 404
            assert loaded_by in {"0", "1"}
