"""Host-side (Python) overhead of one ``Engine.step()`` in decode steady state, on CPU.

A tiny random Llama makes the model forward negligible, so what is left is the engine's own
work per step: scheduling, building the runner's inputs, sampling metadata and the sampler,
``update_from_output``, detokenization and stop checks, and output objects. These are host
measurements only; they say nothing about GPU kernels.

    python bench/host_overhead.py                         # batches 128 and 256, greedy and top-p
    python bench/host_overhead.py --batch 256 --profile   # plus the cProfile top functions

Each part is timed by wrapping it (a wrapper costs well under 1 us per call); "step (bare)" is
measured first without any wrapper and is the number to compare between versions.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import io
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qserve.engine.engine as engine_module  # noqa: E402
import qserve.runner.model_runner as runner_module  # noqa: E402
from qserve import LLM, SamplingParams  # noqa: E402
from qserve.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint  # noqa: E402

PARTS = (
    "schedule",
    "runner inputs+rest",
    "model forward",
    "compute_logits",
    "build_sampling_metadata",
    "sampler",
    "update_from_output",
    "detokenize",
    "check_stop",
    "make_output",
    "engine other",
)


class _Timer:
    """Accumulates seconds per part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return timed


class _StubModel:
    """The model with its transformer layers skipped: hidden = embedding(input_ids).

    Keeps the runner's calls (``model(ids, positions, kv_caches, metadata)`` and
    ``compute_logits``) and gives input-dependent logits, so sampling and detokenization see
    varied tokens, while the CPU reference attention (not host overhead) drops out.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.compute_logits = model.compute_logits

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, metadata: Any) -> Any:
        return self._model.model.embed_tokens(input_ids)  # [num_tokens, hidden]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _TimedModel:
    """Stands in for the model inside the runner: times forward and ``compute_logits``."""

    def __init__(self, model: torch.nn.Module, timer: _Timer) -> None:
        self._model = model
        self._forward = timer.wrap("model forward", model)
        self.compute_logits = timer.wrap("compute_logits", model.compute_logits)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _step_fn(engine: engine_module.Engine, finished_only: bool) -> Callable[[], Any]:
    if finished_only:
        if "finished_only" not in inspect.signature(engine.step).parameters:
            raise SystemExit("this engine has no step(finished_only=...)")
        return lambda: engine.step(finished_only=True)
    return engine.step


def _instrument(engine: engine_module.Engine, timer: _Timer) -> Callable[[], None]:
    """Wrap the parts; returns a function that undoes it."""
    runner = engine.runner
    scheduler = engine.scheduler
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, obj.__dict__.get(attr, _MISSING) if hasattr(obj, "__dict__") else _MISSING))
        setattr(obj, attr, value)

    patch(scheduler, "schedule", timer.wrap("schedule", scheduler.schedule))
    patch(scheduler, "update_from_output", timer.wrap("update_from_output", scheduler.update_from_output))
    # launch: what the engine calls with async scheduling; execute() calls it too
    patch(runner, "launch", timer.wrap("runner execute", runner.launch))
    patch(runner, "model", _TimedModel(runner.model, timer))
    patch(runner, "sampler", timer.wrap("sampler", runner.sampler))
    patch(
        runner_module,
        "build_sampling_metadata",
        timer.wrap("build_sampling_metadata", runner_module.build_sampling_metadata),
    )
    patch(engine_module, "check_stop", timer.wrap("check_stop", engine_module.check_stop))
    patch(engine, "_make_output", timer.wrap("make_output", engine._make_output))
    original_add = IncrementalDetokenizer.add_token
    timed_add = timer.wrap("detokenize", original_add)
    IncrementalDetokenizer.add_token = timed_add  # type: ignore[method-assign]

    def undo() -> None:
        IncrementalDetokenizer.add_token = original_add  # type: ignore[method-assign]
        for obj, attr, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)

    return undo


_MISSING = object()


def _prepare(
    llm: LLM, batch: int, prompt_len: int, max_tokens: int, params: SamplingParams, tag: str
) -> engine_module.Engine:
    engine = llm.engine
    rng = random.Random(batch * 1000 + prompt_len)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, params)
    # Prefill (one step: the token budget covers all prompts), then a couple of decode steps.
    while any(not seq.request.output_token_ids for _, seq in engine._sequences.values()):  # noqa: SLF001
        engine.step()
    for _ in range(2):
        engine.step()
    return engine


def _drain(engine: engine_module.Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure(
    llm: LLM,
    batch: int,
    params: SamplingParams,
    *,
    prompt_len: int,
    max_tokens: int,
    num_steps: int,
    finished_only: bool,
    profile: bool,
    tag: str,
) -> dict[str, float]:
    """Returns microseconds per step for each part plus the bare step time."""
    # 1. Bare: no wrappers.
    engine = _prepare(llm, batch, prompt_len, max_tokens, params, tag + "a")
    step = _step_fn(engine, finished_only)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    _drain(engine)
    times.sort()
    result = {"step (bare)": times[len(times) // 2] * 1e6, "step (bare, mean)": sum(times) / len(times) * 1e6}

    # 2. Instrumented: the breakdown.
    engine = _prepare(llm, batch, prompt_len, max_tokens, params, tag + "b")
    step = _step_fn(engine, finished_only)
    timer = _Timer()
    undo = _instrument(engine, timer)
    total = 0.0
    try:
        for _ in range(num_steps):
            start = time.perf_counter()
            step()
            total += time.perf_counter() - start
    finally:
        undo()
    _drain(engine)
    s = timer.seconds
    parts = {
        "schedule": s["schedule"],
        "model forward": s["model forward"],
        "compute_logits": s["compute_logits"],
        "build_sampling_metadata": s["build_sampling_metadata"],
        "sampler": s["sampler"],
        "update_from_output": s["update_from_output"],
        "detokenize": s["detokenize"],
        "check_stop": s["check_stop"],
        "make_output": s["make_output"],
    }
    parts["runner inputs+rest"] = s["runner execute"] - sum(
        s[k] for k in ("model forward", "compute_logits", "build_sampling_metadata", "sampler")
    )
    parts["engine other"] = (
        total
        - s["runner execute"]
        - sum(s[k] for k in ("schedule", "update_from_output", "detokenize", "check_stop", "make_output"))
    )
    for key, value in parts.items():
        result[key] = value / num_steps * 1e6
    result["step (instrumented)"] = total / num_steps * 1e6

    # 3. Optional cProfile of more steps.
    if profile:
        engine = _prepare(llm, batch, prompt_len, max_tokens, params, tag + "c")
        step = _step_fn(engine, finished_only)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(num_steps):
            step()
        profiler.disable()
        _drain(engine)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="decode steps measured (< max_tokens - 3)")
    parser.add_argument(
        "--mode",
        choices=["stream", "offline", "both"],
        default="both",
        help="stream: step() returns every touched request; offline: step(finished_only=True)",
    )
    parser.add_argument("--sampling", choices=["greedy", "topp", "both"], default="both")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions per case")
    parser.add_argument(
        "--real-forward",
        action="store_true",
        help="run the real transformer layers (CPU reference attention) instead of a stub",
    )
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after start-up (what a server would do)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    if args.steps > args.max_tokens - 4:
        parser.error("--steps must leave room before the sequences finish (< max_tokens - 3)")
    torch.set_num_threads(args.threads)

    max_batch = max(args.batch)
    tokens_per_seq = args.prompt_len + args.max_tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_checkpoint(make_tiny_model("LlamaForCausalLM"), Path(tmp) / "tiny-llama")
        llm = LLM(
            str(path),
            device="cpu",
            dtype="float32",
            max_num_seqs=max_batch,
            max_num_batched_tokens=max_batch * tokens_per_seq,
            num_kv_blocks=max_batch * (-(-tokens_per_seq // 16) + 1),
        )
        if not args.real_forward:
            llm.engine.runner.model = _StubModel(llm.engine.runner.model)
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        samplings = {
            "greedy": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
            "topp": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=args.max_tokens, ignore_eos=True),
        }
        names = list(samplings) if args.sampling == "both" else [args.sampling]
        modes = ["stream", "offline"] if args.mode == "both" else [args.mode]
        rows = []
        for batch in args.batch:
            for name in names:
                for mode in modes:
                    tag = f"b{batch}-{name}-{mode}"
                    if args.profile:
                        print(f"=== cProfile {tag} ===")
                    result = measure(
                        llm,
                        batch,
                        samplings[name],
                        prompt_len=args.prompt_len,
                        max_tokens=args.max_tokens,
                        num_steps=args.steps,
                        finished_only=mode == "offline",
                        profile=args.profile,
                        tag=tag,
                    )
                    rows.append((batch, name, mode, result))

    header = f"{'part (us/step)':<26}" + "".join(f"{f'{b}/{n}/{m}':>20}" for b, n, m, _ in rows)
    print(header)
    print("-" * len(header))
    keys = ["step (bare)", "step (bare, mean)", "step (instrumented)", *PARTS]
    for key in keys:
        print(f"{key:<26}" + "".join(f"{r[key]:>20.0f}" for _, _, _, r in rows))
    host = [r["step (instrumented)"] - r["model forward"] for _, _, _, r in rows]
    print(f"{'host (instr. - forward)':<26}" + "".join(f"{h:>20.0f}" for h in host))
    print(f"{'step (bare) us/seq':<26}" + "".join(f"{r['step (bare)'] / b:>20.2f}" for b, _, _, r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
