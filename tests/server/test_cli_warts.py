"""``qserve serve`` on a taken port (one line naming the port, no "serving on" before it) and the
404 for an unknown model naming the served ones."""

from __future__ import annotations

import socket

import httpx

from qserve.cli import main


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
