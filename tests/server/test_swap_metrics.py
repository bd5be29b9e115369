"""/metrics series of swap preemption: vllm:num_requests_swapped, qserve:num_swapped_{out,in}_total,
from a real engine that swapped, and the process-wide series first when several models are served."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from qserve import LLM, SamplingParams
from qserve.engine.async_engine import AsyncEngine
from qserve.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render().decode()
    return {
        (sample.name, sample.labels.get("model_name", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_swap_series_follow_the_engine(checkpoints):
    llm = LLM(
        checkpoints["llama"], device="cpu", dtype="float32", block_size=4, num_kv_blocks=24,
        preemption_mode="swap", swap_space=2**20 / 2**30,
    )  # fmt: skip
    engine = llm.engine
    engine.scheduler.watermark, engine.scheduler.watermark_per_running = 0.0, 0
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(40 + i, 58))}, params)
    host = AsyncEngine({"tiny": engine})
    metrics = ServerMetrics(lambda: host)
    seen_swapped = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        seen_swapped = max(seen_swapped, _samples(metrics)[("vllm:num_requests_swapped", "tiny")])
    samples = _samples(metrics)
    assert seen_swapped >= 1 and samples[("vllm:num_requests_swapped", "tiny")] == 0
    out = samples[("qserve:num_swapped_out_total", "tiny")]
    assert out == engine.scheduler.num_swapped_out > 0
    assert samples[("qserve:num_swapped_in_total", "tiny")] == out  # all came back
    assert samples[("vllm:num_preemptions_total", "tiny")] >= out  # every preemption counts there too


def test_several_models_open_with_the_process_wide_series():
    class Host:
        def stats(self) -> dict:
            return {
                "a": {"num_swapped": 1, "num_swapped_out": 4, "num_swapped_in": 3},
                "b": {"num_swapped": 2, "num_swapped_out": 5, "num_swapped_in": 3},
            }

    from qserve.server.swap_metrics import SwapCollector

    families = {f.name: f for f in SwapCollector(Host).collect()}
    swapped = families["vllm:num_requests_swapped"].samples
    assert [(s.labels["model_name"], s.value) for s in swapped] == [("", 3), ("a", 1), ("b", 2)]
    out = families["qserve:num_swapped_out"].samples
    assert [(s.labels["model_name"], s.value) for s in out if s.name.endswith("_total")] == [
        ("", 9),
        ("a", 4),
        ("b", 5),
    ]


def test_serve_flags_reach_every_engine_with_the_space_split(checkpoints):
    from qserve.commands.serve import build_host_factory
    from tests.server.test_serve_command import serve_args

    common = (f"a={checkpoints['llama']}", f"b={checkpoints['qwen']}", "--device=cpu", "--max-model-len=64")
    host = build_host_factory(
        serve_args(*common, "--num-kv-blocks=32", "--preemption-mode=swap", "--swap-space=0.002")
    )()
    for hosted in host.models.values():
        engine = hosted.engine
        swapper = engine.runner.kv_swapper
        assert engine.scheduler.preemption_mode == "swap"
        assert swapper.num_host_blocks == int(0.001 * 2**30) // swapper.block_bytes  # half of 0.002 GiB each
        assert engine.scheduler.swap_space.num_slots == swapper.num_host_blocks
    default = build_host_factory(serve_args(*common, "--num-kv-blocks=32"))()
    assert all(h.engine.runner.kv_swapper is None for h in default.models.values())
    assert all(h.engine.scheduler.preemption_mode == "recompute" for h in default.models.values())
