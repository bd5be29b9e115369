"""``qserve serve`` access flags: where the API key comes from, which Host headers are allowed."""

from __future__ import annotations

import logging

import pytest

from qserve.cli import build_parser
from qserve.commands.serve import API_KEY_ENV, resolve_allowed_hosts, resolve_api_key
from qserve.server.guard import host_name


def args(*argv: str):
    argv = ["serve", *argv]
    return build_parser(argv).parse_args(argv)


def test_key_from_file_env_and_flag(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(args()) is None
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret  \n")
    assert resolve_api_key(args("--api-key-file", str(key_file))) == "s3cret"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(args()) == "from-env"
    with caplog.at_level(logging.WARNING):
        assert resolve_api_key(args("--api-key", "on-the-command-line")) == "on-the-command-line"
    assert "process list" in caplog.text and "on-the-command-line" not in caplog.text


@pytest.mark.parametrize(("content", "message"), [(None, "cannot read"), ("", "empty"), ("\n\n", "empty")])
def test_bad_key_files_are_refused(tmp_path, content, message):
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        resolve_api_key(args("--api-key-file", str(path)))


def test_key_given_twice_is_refused(tmp_path):
    (tmp_path / "k").write_text("a")
    with pytest.raises(ValueError, match="once"):
        resolve_api_key(args("--api-key", "b", "--api-key-file", str(tmp_path / "k")))


def test_allowed_hosts_defaults_and_flags():
    assert set(resolve_allowed_hosts(args())) == {"127.0.0.1", "localhost", "::1"}
    assert "myhost" in resolve_allowed_hosts(args("--host", "myhost"))
    assert resolve_allowed_hosts(args("--host", "0.0.0.0")) is None  # any: names are not knowable
    assert resolve_allowed_hosts(args("--allowed-hosts", "a.example,b.example", "--allowed-hosts", "c")) == [
        "a.example",
        "b.example",
        "c",
    ]
    assert resolve_allowed_hosts(args("--allowed-hosts", "*")) is None


@pytest.mark.parametrize(
    ("header", "name"),
    [("Example.COM:8000", "example.com"), ("[::1]:8000", "::1"), ("localhost", "localhost"), ("::1", "::1")],
)
def test_host_name(header, name):
    assert host_name(header) == name


def test_guard_metrics_without_key():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from qserve.server.app import error_response
    from qserve.server.guard import GuardConfig, RequestGuard

    async def ok(_):
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/metrics", "/health", "/v1/models")])

    def build(metrics_without_key: bool) -> TestClient:
        config = GuardConfig(authorized=lambda h: h == "Bearer k", metrics_without_key=metrics_without_key)
        guard = RequestGuard(inner, config, lambda s, m, h: error_response(s, m, headers=h))
        return TestClient(guard)

    strict, relaxed = build(False), build(True)
    assert strict.get("/metrics").status_code == 401 and relaxed.get("/metrics").status_code == 200
    assert strict.get("/health").status_code == 200
    assert relaxed.get("/v1/models").status_code == 401
    assert relaxed.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert strict.post("/v1/models", content=b"x" * 10, headers={"Authorization": "Bearer k"}).status_code == 200
