"""LoRA adapters over HTTP: served under their own names (``/v1/models`` lists them with ``parent``),
vLLM's runtime load / unload routes behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, OpenAI-shaped 404s
naming an unknown adapter, ``vllm:lora_requests_info``, and the ``--lora-modules`` flag forms."""

from __future__ import annotations

import argparse
import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from qserve.commands.lora_flags import check_lora_flags, parse_lora_modules, register_lora_flags
from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.lora.request import LoRARequest
from qserve.server import lora_routes
from qserve.server.app import create_app
from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter
from tests.server.conftest import host_config

SHAPES = projection_shapes(64, 128, 4, 2, 16)  # tests/helpers/tiny_models.py's Llama


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("sql", "extra")):
        write_peft_adapter(root / name, SHAPES, 2, targets=("q_proj", "v_proj", "down_proj"), rank=8, alpha=16, seed=i)
    write_peft_adapter(root / "wide", SHAPES, 2, targets=("q_proj",), rank=32, alpha=16)
    engines = build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(enable_lora=True, max_loras=2))
    engines["llama"].add_lora(LoRARequest("sql", 1, str(root / "sql")))
    host = AsyncEngine(engines)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(lora_routes.RUNTIME_UPDATE_ENV, "true")
        app = create_app(host, log_stats=False, ui=False)
    with TestClient(app) as client:
        yield client, root


def _completion(client, model: str) -> dict:
    body = {"model": model, "prompt": [5, 9, 33, 2, 71], "max_tokens": 3, "temperature": 0, "logprobs": 1}
    return client.post("/v1/completions", json=body)


def _first_logprob(response) -> float:
    return response.json()["choices"][0]["logprobs"]["token_logprobs"][0]


def test_adapters_are_models(served) -> None:
    client, _ = served
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "llama" and cards["sql"]["root"] == "sql"
    assert cards["llama"]["parent"] is None
    sql, base = _completion(client, "sql"), _completion(client, "llama")
    assert sql.status_code == 200 and sql.json()["model"] == "sql"
    assert abs(_first_logprob(sql) - _first_logprob(base)) > 1e-4  # the adapter changes the model
    assert _first_logprob(_completion(client, "sql")) == _first_logprob(sql)
    missing = _completion(client, "nope")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["param"] == "model" and "`nope`" in error["message"] and "sql" in error["message"]


def test_runtime_load_and_unload(served) -> None:
    client, root = served
    load = client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(root / "extra")})
    assert load.status_code == 200 and "extra" in load.text
    assert "extra" in {c["id"] for c in client.get("/v1/models").json()["data"]}
    assert _completion(client, "extra").status_code == 200
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(root / "extra")})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    wide = client.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(root / "wide")})
    assert wide.status_code == 400 and "'r'" in wide.json()["error"]["message"]
    assert wide.json()["error"]["param"] == "lora_path"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert _completion(client, "extra").status_code == 404
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert gone.status_code == 404 and "extra" in gone.json()["error"]["message"]


def test_lora_metrics(served, caplog) -> None:
    client, _ = served
    with caplog.at_level("INFO", logger="qserve.server.request_log"):
        assert _completion(client, "sql").status_code == 200
    assert any("model=llama lora=sql prompt_tokens=5" in r.getMessage() for r in caplog.records)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    (sample,) = families["vllm:lora_requests_info"].samples
    assert sample.labels["max_lora"] == "2"
    assert sample.labels["running_lora_adapters"] == "" and sample.labels["waiting_lora_adapters"] == ""
    counts = {s.labels["lora_name"]: s.value for s in families["qserve:lora_requests"].samples}
    assert counts.get("sql", 0) >= 1 and "llama" not in counts  # per adapter; the base model is not one


def test_runtime_routes_need_the_switch(served, monkeypatch) -> None:
    monkeypatch.delenv(lora_routes.RUNTIME_UPDATE_ENV, raising=False)
    host = served[0].app.state.qserve.host
    paths = {getattr(r, "path", None) for r in create_app(host, log_stats=False, ui=False).routes}
    assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths


def test_lora_module_flags(tmp_path) -> None:
    write_peft_adapter(tmp_path / "a", SHAPES, 2, targets=("q_proj",), rank=8, alpha=16)
    write_peft_adapter(tmp_path / "big", SHAPES, 2, targets=("q_proj",), rank=64, alpha=16)
    json_form = json.dumps({"name": "b", "path": str(tmp_path / "a"), "base_model_name": "m"})
    modules = parse_lora_modules([f"a={tmp_path / 'a'}", json_form])
    assert [(m.name, m.base_model_name) for m in modules] == [("a", None), ("b", "m")]
    parser = argparse.ArgumentParser()
    register_lora_flags(parser)

    def check(*argv: str) -> list:
        return check_lora_flags(parser.parse_args(list(argv)), ["m"])

    assert len(check("--enable-lora", "--lora-modules", f"a={tmp_path / 'a'}", json_form)) == 2
    with pytest.raises(ValueError, match="needs --enable-lora"):
        check("--lora-modules", f"a={tmp_path / 'a'}")
    with pytest.raises(ValueError, match="field 'r' is 64.*--max-lora-rank"):
        check("--enable-lora", "--lora-modules", f"big={tmp_path / 'big'}")
    with pytest.raises(ValueError, match="base_model_name 'x' is not served"):
        check(
            "--enable-lora",
            "--lora-modules",
            json.dumps({"name": "c", "path": str(tmp_path / "a"), "base_model_name": "x"}),
        )
    with pytest.raises(ValueError, match="unknown field"):
        parse_lora_modules(['{"name": "c", "path": "p", "rank": 4}'])
    with pytest.raises(ValueError, match="--max-loras"):
        check("--enable-lora", "--max-loras", "0")


def test_plan_sets_the_slots_aside(checkpoints, capsys) -> None:
    from qserve.cli import main

    def plan(*extra: str) -> dict:
        assert main(["plan", checkpoints["llama"], "--gpu-memory-budget", "1GiB", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    base, lora = plan(), plan("--enable-lora", "--max-loras", "4", "--max-lora-rank", "8")
    per_layer = (
        3 * 8 * 64 + 128 * 8 + 8 * 64 + 64 * 8 + 2 * 8 * 64 + 256 * 8 + 8 * 128 + 64 * 8
    )  # A + B of qkv/o/gate_up/down
    assert base["lora_bytes"] == 0 and lora["lora_bytes"] == 2 * 4 * per_layer * 2  # 2 layers, 4 slots, fp16
    assert lora["kv_cache_bytes"] <= base["kv_cache_bytes"] - lora["lora_bytes"] + base["kv_bytes_per_token"] * 16


def test_a_submission_never_reloads_an_unloaded_adapter(served) -> None:
    from qserve.engine.async_engine import _check_registered

    client, root = served
    hosted = client.app.state.qserve.host.models["llama"]
    _check_registered(hosted, LoRARequest("sql", 1, str(root / "sql")))  # registered: fine
    with pytest.raises(ValueError, match="'gone' is not loaded"):
        _check_registered(hosted, LoRARequest("gone", 7, str(root / "extra")))


def test_serve_flags_register_the_adapters(checkpoints, served) -> None:
    """``qserve serve --enable-lora --lora-modules ...`` builds engines with LoRA and the adapters."""
    from qserve.cli import build_parser
    from qserve.commands.serve import build_host_factory

    _, root = served
    argv = ["serve", f"llama={checkpoints['llama']}", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"sql={root / 'sql'}", json.dumps({"name": "x", "path": str(root / "extra")})]  # fmt: skip
    host = build_host_factory(build_parser(argv).parse_args(argv))()
    engine = host.models["llama"].engine
    assert engine.list_loras() == ["sql", "x"] and engine.config.max_loras == 2
    assert engine.lora_manager.request_of("x").base_model_name == "llama"


def test_runtime_load_that_another_rank_cannot_read(served, monkeypatch) -> None:
    """Under tensor parallelism (``LoRAManager.publish``, here a stand-in for rank 1 that reads no
    adapter): the load is undone on rank 0 and on the ranks that read it, and the route answers
    400 naming the adapter, the rank and its reason; the adapter is not served."""
    client, root = served
    manager = client.app.state.qserve.host.models["llama"].engine.lora_manager
    sent = []

    def rank_1_reads_nothing() -> list[tuple[int, int, str]]:
        changes, manager.journal = manager.journal, []
        sent.append(changes)
        return [(1, change[1], "LoRA adapter: not a directory") for change in changes if change[0] == "add"]

    monkeypatch.setattr(manager, "journal", [])
    monkeypatch.setattr(manager, "publish", rank_1_reads_nothing, raising=False)
    load = client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(root / "extra")})
    assert load.status_code == 400
    error = load.json()["error"]
    assert error["param"] == "lora_path"
    assert "'extra'" in error["message"] and "rank 1: LoRA adapter: not a directory" in error["message"]
    (added,), (forgotten,) = sent  # the add, then its undoing (for the ranks that did read it)
    assert added[0] == "add" and forgotten == ("forget", added[1])
    assert "extra" not in manager.names() and added[1] not in manager._by_id
    assert "extra" not in {c["id"] for c in client.get("/v1/models").json()["data"]}
    assert _completion(client, "extra").status_code == 404
