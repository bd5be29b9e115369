"""vLLM's flag names on ``qserve serve``, generation_config.json defaults, and the log lines
(per request, and the periodic stats line) with their switches."""

from __future__ import annotations

import json
import logging

import pytest

from qserve.cli import build_parser, main
from qserve.commands.serve import build_host_factory
from qserve.outputs import CompletionOutput, RequestOutput
from qserve.server.generation_config import apply_sampling_defaults, load_sampling_defaults
from qserve.server.protocol import ChatCompletionRequest, CompletionRequest
from qserve.server.request_log import RequestLog, StatsLogger


def serve_args(*argv: str):
    argv = ["serve", *argv]
    return build_parser(argv).parse_args(argv)


def test_vllm_flags_shape_the_host(checkpoints, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text(
        json.dumps({"temperature": 0.25, "top_k": 7, "max_new_tokens": 9, "do_sample": True})
    )
    args = serve_args(
        checkpoints["llama"],
        "--served-model-name",
        "chat",
        "--device=cpu",
        "--max-model-len=64",
        "--num-kv-blocks=8",
        "--no-enable-prefix-caching",
        "-tp",
        "1",
        "--chat-template",
        str(template),
        "--generation-config",
        str(tmp_path / "gen"),
        "--log-level",
        "INFO",
        "--no-async-scheduling",
    )
    assert args.log_level == "INFO" and args.tensor_parallel_size == 1
    assert serve_args("m").async_scheduling is True  # on by default (its CUDA equivalence test passes)
    host = build_host_factory(args)()
    (hosted,) = host.models.values()
    assert hosted.name == "chat"
    assert hosted.engine.config.enable_prefix_caching is False
    assert hosted.engine.async_scheduling is False  # the flag reaches the engine
    assert hosted.engine.tokenizer.chat_template == template.read_text()
    assert hosted.sampling_defaults == {"temperature": 0.25, "top_k": 7, "max_tokens": 9}


def test_flag_translations():
    args = serve_args("m", "--gpu-memory-utilization", "0.8", "--kv-cache-dtype", "fp8_e4m3", "--enable-prefix-caching")
    from qserve.commands.serve import apply_worker_flags

    apply_worker_flags(args)
    assert args.gpu_memory_budget == "0.8" and args.kv_cache_dtype == "fp8" and args.no_prefix_caching is False
    assert serve_args("m").log_level is None  # not given: the worker's own log lines stay visible
    assert serve_args("m").shutdown_timeout == 25.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("{llama}", "--gpu-memory-utilization", "0.5", "--gpu-memory-budget", "1GiB"), "not both"),
        (("{llama}", "--gpu-memory-utilization", "1.5"), "(0, 1]"),
        (("{llama}", "--served-model-name", "a", "b"), "one name per model"),
        (("{llama}", "--shutdown-timeout", "-1"), "--shutdown-timeout must be >= 0"),
        (("{llama}", "--generation-config", "/not/a/dir"), "--generation-config"),
        (("{llama}", "--chat-template", "/not/a/file.jinja"), "--chat-template"),
        (("{llama}", "--kv-cache-dtype", "fp8_e5m2"), "supported: auto, fp8, int8"),
        (("{llama}", "--kv-events-config", '{{"enable_kv_cache_events": true, "topic": "kv@{{x}}"}}'), "may only use"),
    ],
)
def test_flag_errors(checkpoints, capsys, argv, message):
    argv = [a.format(llama=checkpoints["llama"]) for a in argv]
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_generation_config_fills_only_what_the_client_left_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_new_tokens": 20})
    )
    defaults = load_sampling_defaults("auto", str(tmp_path))
    assert load_sampling_defaults("vllm", str(tmp_path)) == {}
    assert load_sampling_defaults("auto", str(tmp_path / "nowhere")) == {}
    completion = CompletionRequest(model="m", prompt="x", temperature=1.0)
    apply_sampling_defaults(completion, defaults)
    assert completion.temperature == 1.0  # sent by the client
    assert completion.top_p == 0.9 and completion.repetition_penalty == 1.1 and completion.max_tokens == 20
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=5)
    apply_sampling_defaults(chat, defaults)
    assert chat.temperature == 0.6 and chat.max_tokens is None and chat.max_completion_tokens == 5
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        load_sampling_defaults("auto", str(tmp_path))


def _finished(request_id: str) -> RequestOutput:
    output = RequestOutput(
        request_id,
        None,
        [1, 2, 3],
        None,
        [CompletionOutput(0, "ab", [4, 5], finish_reason="stop")],
        finished=True,
    )
    output.metrics["first_token_latency"] = 0.125
    return output


def test_request_log_line_and_its_switch(caplog):
    with caplog.at_level(logging.INFO, logger="qserve.server.request_log"):
        RequestLog().on_finished("m", _finished("r1"), 0.5)
        RequestLog(log_requests=False).on_finished("m", _finished("r2"), 0.5)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "(r1): model=m prompt_tokens=3 output_tokens=2 ttft=0.125s total=0.500s finish_reason=stop" in line


class _Host:
    def __init__(self, running: int, waiting: int) -> None:
        self.values = {"num_running": running, "num_waiting": waiting, "pool_pages_used": 25, "pool_pages_total": 100}

    def stats(self):
        return {"m": self.values}


def test_stats_line_only_while_busy(caplog):
    counts = RequestLog()
    host = _Host(running=2, waiting=1)
    stats = StatsLogger(lambda: host, counts)
    with caplog.at_level(logging.INFO, logger="qserve.server.request_log"):
        counts.on_first_token("m", 0.1, 10)
        counts.on_tokens("m", 30, None)
        assert stats.log_once() == 1
        host.values.update(num_running=0, num_waiting=0)
        assert stats.log_once() == 0  # idle and no new tokens: quiet
    line = caplog.records[0].getMessage()
    assert line.startswith("stats m: running=2 waiting=1 kv_cache=25.0% prompt=") and "generation=" in line
