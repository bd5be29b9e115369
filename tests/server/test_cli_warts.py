"""``qserve serve`` on a taken port (one line naming the port, no "serving on" before it, with one
API server or several) and the 404 for an unknown model naming the served ones."""

from __future__ import annotations

import socket

import httpx
import pytest

from qserve.cli import main
from qserve.server.listen import reuse_port_balances


def test_taken_port_is_one_line_and_no_serving_line(checkpoints, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", checkpoints["llama"], "--port", str(port), "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "serving on" not in out
    assert len(err.strip().splitlines()) == 1 and f"port {port} is already in use" in err


@pytest.mark.skipif(not reuse_port_balances(), reason="API servers share one socket here")
def test_a_port_held_by_reuse_port_listeners_is_taken_for_api_servers_too(checkpoints, capsys):
    """The API servers of ``--api-server-count 2`` listen through SO_REUSEPORT, which would let
    them join another server's group on the port (another such qserve): the parent's check binds
    without it, so the port is refused in one line instead of silently shared."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", checkpoints["llama"], "--port", str(port), "--device", "cpu", "--api-server-count", "2"]
        code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert "serving on" not in out
    assert len(err.strip().splitlines()) == 1 and f"port {port} is already in use" in err


def test_unknown_model_404_lists_the_served_names(two_model_server):
    body = {"model": "gpt-4o", "prompt": "hi", "max_tokens": 1}
    response = httpx.post(f"{two_model_server.base_url}/completions", json=body, timeout=30)
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "`gpt-4o` does not exist" in message and "Served models: llama, qwen." in message
    assert (
        "Served models: llama, qwen."
        in httpx.get(f"{two_model_server.base_url}/models/nope").json()["error"]["message"]
    )
