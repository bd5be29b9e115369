"""The container recipe (no Docker daemon in CI): its command line is a valid ``qserve serve``
invocation on 0.0.0.0:8000, its probe reads /health, and everything it copies exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

from qserve.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def instruction(name: str) -> list[str]:
    """The values of every ``NAME ...`` instruction (continuation lines joined)."""
    text = DOCKERFILE.replace("\\\n", " ")
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def test_command_line_parses_as_qserve_serve():
    (entrypoint,) = instruction("ENTRYPOINT")
    (cmd,) = instruction("CMD")
    argv = json.loads(entrypoint) + json.loads(cmd)
    assert argv[0] == "qserve"
    args = build_parser(argv[1:]).parse_args(argv[1:])
    assert args.command == "serve" and args.models == ["/models/model"]
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    # Flags a user appends after the image name parse too.
    extra = ["--served-model-name", "m", "--gpu-memory-utilization", "0.9"]
    assert build_parser(argv[1:] + extra).parse_args(argv[1:] + extra).served_model_name == ["m"]


def test_probe_port_and_copies():
    assert instruction("EXPOSE") == ["8000"]
    (healthcheck,) = instruction("HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in healthcheck
    assert instruction("STOPSIGNAL") == ["SIGTERM"]
    for copy in instruction("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            assert (REPO / source).exists(), source
