"""vLLM's launch lines start qserve (issue 28): ``--enable-auto-tool-choice``,
``--tool-call-parser``, ``--quantization`` (checked against the checkpoint), ``--root-path``
and the CORS flags with vLLM's JSON-list syntax and defaults."""

from __future__ import annotations

import argparse

import pytest

from qserve.cli import build_parser
from qserve.commands import serve as serve_command
from qserve.commands.serve import TOOL_CALL_PARSERS, build_host_factory
from qserve.commands.vllm_flags import check_quantization, cors_config, json_list
from qserve.server.tools import PARSERS


def serve_args(*argv: str) -> argparse.Namespace:
    argv = ["serve", *argv]
    return build_parser(argv).parse_args(argv)


def test_a_vllm_tool_calling_launch_line_parses():
    args = serve_args(
        "m",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--quantization",
        "gptq",
        "--root-path",
        "/llm",
        "--allowed-origins",
        '["https://a.example", "https://b.example"]',
        "--allowed-methods",
        '["GET", "POST"]',
        "--allow-credentials",
    )
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes" and args.quantization == "gptq"
    assert args.root_path == "/llm"
    cors = cors_config(args)
    assert cors.allowed_origins == ["https://a.example", "https://b.example"]
    assert cors.allowed_methods == ["GET", "POST"] and cors.allowed_headers == ["*"] and cors.allow_credentials


def test_cors_defaults_are_vllms_and_an_empty_list_turns_it_off():
    cors = cors_config(serve_args("m"))
    assert (cors.allowed_origins, cors.allowed_methods, cors.allowed_headers, cors.allow_credentials) == (
        ["*"],
        ["*"],
        ["*"],
        False,
    )
    assert cors_config(serve_args("m", "--allowed-origins", "[]")) is None
    assert json_list("a.example, b.example") == ["a.example", "b.example"]
    with pytest.raises(argparse.ArgumentTypeError):
        json_list('["a", 1]')


@pytest.mark.parametrize("parser", PARSERS)
def test_every_tool_call_parser_is_a_cli_choice(parser):
    assert serve_args("m", "--tool-call-parser", parser).tool_call_parser == parser
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


@pytest.mark.parametrize(
    ("requested", "detected"),
    [
        ("gptq", "gptq"),
        ("gptq_marlin", "gptq"),
        ("awq_marlin", "awq"),
        ("AWQ", "awq"),
        ("compressed-tensors", "compressed-tensors"),
        (None, "awq"),
    ],
)
def test_quantization_matching_the_checkpoint_passes(requested, detected):
    check_quantization(requested, detected, "m")


@pytest.mark.parametrize(
    ("requested", "detected", "message"),
    [
        ("gptq", "awq", "'m' is a awq checkpoint"),
        ("awq_marlin", "gptq", "is a gptq checkpoint"),
        ("gptq", "none", "'m' is not quantized"),
        ("fp8", "gptq", "qserve serves 4-bit"),
        ("marlin", "gptq", "qserve serves 4-bit"),
    ],
)
def test_quantization_mismatch_is_one_clear_error(requested, detected, message):
    with pytest.raises(ValueError, match=message):
        check_quantization(requested, detected, "m")


def test_quantization_is_checked_before_the_server_starts(checkpoints):
    args = serve_args(checkpoints["llama"], "--quantization", "gptq", "--device", "cpu")
    with pytest.raises(ValueError, match=r"--quantization gptq: model 'llama\w*' is not quantized"):
        build_host_factory(args)


def test_root_path_and_cors_reach_uvicorn_and_the_app(checkpoints, monkeypatch):
    from qserve.server.draining_server import DrainingServer

    started = {}
    monkeypatch.setattr(DrainingServer, "run", lambda self, sockets=None: started.setdefault("server", self))
    args = serve_args(checkpoints["llama"], "--device", "cpu", "--root-path", "/llm", "--enable-auto-tool-choice")
    assert serve_command.run(args) == 0
    server = started["server"]
    assert server.config.root_path == "/llm"
    assert any(m.cls.__name__ == "CORSMiddleware" for m in server.config.app.user_middleware)
