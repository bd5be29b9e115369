"""Serving benchmark: the real ``AsyncEngine``, in-process, under a ShareGPT-like workload.

No HTTP: requests go straight to ``AsyncEngine.submit`` from asyncio tasks, so this measures
the engine (scheduler, step thread, streaming delivery), not uvicorn or JSON. The workload is
seeded: prompt and output lengths log-normal with means ~256 / ~256 (caps 2048), random
token-id prompts, ``ignore_eos`` so every request generates exactly its drawn output length.
Each rate in ``--rates`` is one run over the same lengths (fresh token ids per run, so the
prefix cache cannot reuse a previous run's prompts): ``inf`` submits every request at once,
a number is a Poisson arrival process at that many requests/s.

Per rate it reports output tok/s, request throughput, TTFT / TPOT / ITL / end-to-end latency
at p50 and p99 (vLLM's definitions: TTFT = first output token - arrival; TPOT = (e2e - TTFT)
/ (output tokens - 1); ITL = gaps between successive deliveries of tokens; arrival is when
``submit`` is called, token times are when the stream yields on the event loop), the peak of
running sequences and of used KV pages (sampled after every ``schedule()`` on the step thread),
and preemptions. Before the timed runs a correctness spot check runs a few greedy requests
through the engine offline (the ``LLM.generate`` loop, on the same engine) and then through the
``AsyncEngine`` streams and compares the tokens (with ``--small``, also against HF
transformers greedy decoding); it doubles as the warm-up.

On the GPU (the Qwen2.5-14B-shaped random GPTQ-4bit checkpoint is written to /tmp/qb first,
or reused if already there)::

    PYTHONPATH=. python3 bench/serving.py --build-qwen14b /tmp/qb --gpu-memory-budget 24GiB \
        --num-requests 1000 --rates 4,8,16,inf --out $OUT/serving.md

With ``--gpu-memory-budget`` it ends by checking that the peak allocator stayed within the budget
(exit status 1 if not); ``--sampling mixed`` makes every 4th request use the sampler's costliest
path, so that check covers it.

To check the script on CPU (a tiny random Llama, short lengths; the numbers mean nothing)::

    python bench/serving.py --small --num-requests 40 --rates 8,inf --out /tmp/serving_small.md

The markdown table in ``--out`` is rewritten after each rate, so a run cut short keeps what it
measured.

Preemption under pressure (issue 17, item 6): ``--num-kv-blocks`` forces a small KV pool and
``--preemption-mode recompute|swap|auto`` (``--swap-space`` GiB of host memory) picks how
preempted sequences come back; the table then shows preemptions, how many went to the host and
came back, and the tokens the engine computed against the workload's own (recomputes add to
them). Run it once per mode on the same pool, e.g. on the H200::

    for mode in recompute swap; do timeout 120 python3 bench/serving.py --build-qwen14b /tmp/qb \
        --num-kv-blocks 1200 --num-requests 300 --rates inf --watermark 0 --watermark-per-running 0 \
        --preemption-mode $mode --out $OUT/preempt_$mode.md; done
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import QWEN14B, lognormal_lengths, write_random_gptq  # noqa: E402
from qserve.engine.async_engine import AsyncEngine, HostConfig, ModelSpec, RequestItem, build_engines  # noqa: E402
from qserve.engine.engine import Engine  # noqa: E402
from qserve.memory.planner import parse_memory_budget  # noqa: E402
from qserve.model.registry import read_model_config
from qserve.runner.cuda_allocator import prefer_expandable_segments  # noqa: E402
from qserve.sampling_params import SamplingParams  # noqa: E402
from qserve.scheduler.swap import PREEMPTION_MODES  # noqa: E402

MODEL = "bench"
GIB = 2**30
SPOT_CHECK_LENGTHS = (7, 33, 120, 257)  # prompt lengths of the greedy spot-check requests
SPOT_CHECK_TOKENS = 24


# ---------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    in_lens: list[int]
    out_lens: list[int]
    vocab: int
    seed: int

    def prompts(self, run: int) -> list[list[int]]:
        """Random token ids of the drawn lengths, fresh for each run (no prefix-cache reuse)."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + 17 + run)
        return [torch.randint(3, self.vocab, (k,), generator=gen).tolist() for k in self.in_lens]


def make_workload(n: int, mean_in: int, mean_out: int, cap: int, vocab: int, seed: int) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    in_lens = lognormal_lengths(n, mean_in, cap, gen)
    out_lens = lognormal_lengths(n, mean_out, cap, gen)
    return Workload(in_lens, out_lens, vocab, seed)


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: all 0 for ``inf``, else Poisson."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, offsets = 0.0, []
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


# ---------------------------------------------------------------------- step-thread sampling
class StepSampler:
    """Wraps the engine's ``scheduler.schedule`` (an instance attribute, so only this engine):
    after each schedule, on whatever thread steps the engine (the step thread once the host
    runs), it records running sequences, used KV pages and preemptions. Two ``len`` calls per
    step; nothing crosses threads but plain ints read once the engine is idle."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._sampled_schedule
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.peak_running = 0
        self.peak_pages = 0
        self.preemptions = 0
        self.batched_tokens = 0
        self.swapped_out = 0
        self.swapped_in = 0
        self._swapped_in_before = self.engine.scheduler.num_swapped_in

    def _sampled_schedule(self):  # noqa: ANN202 - SchedulerOutput
        out = self._schedule()
        self.steps += 1
        self.peak_running = max(self.peak_running, self.engine.scheduler.num_running)
        self.peak_pages = max(self.peak_pages, self.engine.block_pool.num_used_by(self.engine.owner))
        self.preemptions += len(out.preempted_request_ids)
        self.batched_tokens += out.num_batched_tokens
        self.swapped_out += len(out.swapped_out_request_ids)
        self.swapped_in = self.engine.scheduler.num_swapped_in - self._swapped_in_before
        return out


# ---------------------------------------------------------------------- one request, one run
@dataclass
class Record:
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per delivery that added tokens
    num_output: int = 0
    error: str | None = None


# --sampling mixed: every 4th request samples with everything the sampler can be asked for, so
# each step's sampler takes its worst path (the memory budget must hold it too).
MIXED_PARAMS = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.05, logprobs=5, seed=1)


def request_params(index: int, max_tokens: int, sampling: str) -> SamplingParams:
    if sampling == "mixed" and index % 4 == 0:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **MIXED_PARAMS)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def run_request(host: AsyncEngine, request_id: str, ids: list[int], params: SamplingParams, rec: Record) -> None:
    rec.arrival = time.monotonic()
    try:
        stream = await host.submit(MODEL, [RequestItem(request_id, {"prompt_token_ids": ids}, params)])
        seen = 0
        async for _, output in stream:
            now = time.monotonic()
            n = len(output.outputs[0].token_ids)
            if n < seen:
                raise AssertionError(f"cumulative output shrank from {seen} to {n} tokens")
            if n > seen:
                rec.token_times.append(now)
                seen = n
        rec.num_output = seen
    except Exception as err:  # noqa: BLE001 - counted and reported, the run goes on
        rec.error = f"{type(err).__name__}: {err}"


async def run_rate(
    host: AsyncEngine, workload: Workload, rate: float, run: int, sampling: str = "greedy"
) -> tuple[list[Record], float]:
    prompts = workload.prompts(run)
    offsets = arrival_offsets(len(prompts), rate, workload.seed * 1000 + run)
    records = [Record() for _ in prompts]
    tasks = []
    start = time.monotonic()
    for i, (ids, max_tokens, offset) in enumerate(zip(prompts, workload.out_lens, offsets)):
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        params = request_params(i, max_tokens, sampling)
        tasks.append(asyncio.create_task(run_request(host, f"r{run}-{i}", ids, params, records[i])))
    await asyncio.gather(*tasks)
    return records, time.monotonic() - start


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[Record], duration: float, workload: Workload) -> dict[str, float]:
    ok = [r for r in records if r.error is None and r.token_times]
    ttft = [(r.token_times[0] - r.arrival) * 1e3 for r in ok]
    e2e = [(r.token_times[-1] - r.arrival) * 1e3 for r in ok]
    tpot = [(r.token_times[-1] - r.token_times[0]) * 1e3 / (r.num_output - 1) for r in ok if r.num_output > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    out_tokens = sum(r.num_output for r in ok)
    in_tokens = sum(k for k, r in zip(workload.in_lens, records) if r.error is None and r.token_times)
    wrong_len = sum(r.num_output != k for r, k in zip(records, workload.out_lens) if r.error is None)
    stats = {
        "completed": len(ok),
        "failed": sum(r.error is not None for r in records),
        "wrong_len": wrong_len,
        "duration": duration,
        "req_s": len(ok) / duration,
        "out_tok_s": out_tokens / duration,
        "total_tok_s": (in_tokens + out_tokens) / duration,
        "out_tokens": out_tokens,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        stats[f"{name}_mean"] = float(np.mean(values)) if values else float("nan")
        stats[f"{name}_p50"] = pct(values, 50)
        stats[f"{name}_p99"] = pct(values, 99)
    return stats


# ---------------------------------------------------------------------- correctness spot check
def offline_generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """``LLM.generate``'s loop on an existing engine (the host's step thread is not running yet)."""
    ids = [f"offline-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step(finished_only=True):
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    return [finished[i] for i in ids]


async def streamed_generate(host: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        stream = await host.submit(MODEL, [RequestItem(f"spot-{i}", {"prompt_token_ids": prompt}, params)])
        tokens: list[int] = []
        async for _, output in stream:
            tokens = list(output.outputs[0].token_ids)
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def hf_generate(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from HF transformers (the reference path), fp32 on CPU: small models only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


def compare(name: str, got: list[list[int]], want: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(got, want))
    text = f"{name}: {same}/{len(want)} greedy equal"
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            text += f" (request {i}: first difference at token {at})"
            break
    return text


# ---------------------------------------------------------------------- report
COLUMNS = (
    "rate (req/s)",
    "done",
    "time (s)",
    "req/s",
    "out tok/s",
    "TTFT p50 / p99 (ms)",
    "TPOT p50 / p99 (ms)",
    "ITL p50 / p99 (ms)",
    "E2E p50 / p99 (s)",
    "peak running",
    "peak KV pages",
    "preempt",
    "swapped out / in",
    "tokens computed (x workload)",
    "steps",
)


def row(
    rate: float, s: dict[str, float], sampler: StepSampler, total_pages: int, n: int, workload_tokens: int
) -> list[str]:
    done = f"{s['completed']}/{n}"
    if s["failed"] or s["wrong_len"]:
        done += f" ({s['failed']} failed, {s['wrong_len']} wrong length)"
    return [
        "inf (all at once)" if math.isinf(rate) else f"{rate:g}",
        done,
        f"{s['duration']:.1f}",
        f"{s['req_s']:.2f}",
        f"{s['out_tok_s']:.0f}",
        f"{s['ttft_p50']:.0f} / {s['ttft_p99']:.0f}",
        f"{s['tpot_p50']:.1f} / {s['tpot_p99']:.1f}",
        f"{s['itl_p50']:.1f} / {s['itl_p99']:.1f}",
        f"{s['e2e_p50'] / 1e3:.2f} / {s['e2e_p99'] / 1e3:.2f}",
        str(sampler.peak_running),
        f"{sampler.peak_pages} / {total_pages} ({100 * sampler.peak_pages / total_pages:.0f}%)",
        str(sampler.preemptions),
        f"{sampler.swapped_out} / {sampler.swapped_in}",
        f"{sampler.batched_tokens} ({sampler.batched_tokens / max(workload_tokens, 1):.2f})",
        str(sampler.steps),
    ]


def emit(out: str | None, header: list[str], rows: list[list[str]]) -> None:
    lines = [*header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    if out:
        Path(out).write_text(text)


# ---------------------------------------------------------------------- main
def build_small(tmp: Path) -> str:
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

    model = make_tiny_model("LlamaForCausalLM", seed=1, max_position_embeddings=1024)
    return str(save_tiny_checkpoint(model, tmp / "serving-small-llama"))


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"--rates needs positive numbers or inf, got {text!r}")
    return rates


async def bench(args: argparse.Namespace, path: str, header: list[str]) -> None:
    small = args.small
    max_model_len = args.max_model_len or (512 if small else 4096)
    config = HostConfig(
        device=args.device,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_budget=args.gpu_memory_budget,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        num_kv_blocks=args.num_kv_blocks,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        speculative_config=args.speculative_config or None,
    )
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = build_engines([ModelSpec(MODEL, path)], config)[MODEL]
    total_pages = engine.block_pool.num_blocks
    header.append(
        f"- engine: {engine.device} {engine.dtype}, KV {args.kv_cache_dtype}, {total_pages} pages of "
        f"{engine.kv_manager.block_size} tokens, max_num_seqs {args.max_num_seqs}, max_model_len {max_model_len}, "
        f"budget {args.gpu_memory_budget or 'default'}, async scheduling {'on' if args.async_scheduling else 'off'}; built in {time.perf_counter() - t0:.1f} s"
    )
    if config.speculative_config is not None:
        header.append(f"- speculative decoding: {json.dumps(config.speculative_config)}")
    sampler = StepSampler(engine)
    if args.watermark is not None:
        engine.scheduler.watermark = args.watermark
    if args.watermark_per_running is not None:
        engine.scheduler.watermark_per_running = args.watermark_per_running
    header.append(
        f"- admission watermark: {engine.scheduler.watermark:g} of the pages + "
        f"{engine.scheduler.watermark_per_running} per running sequence"
    )
    preemption = f"- preemption mode: {args.preemption_mode}"
    swapper = engine.runner.kv_swapper
    if swapper is not None:
        cost = engine.swap_cost
        preemption += (
            f", host pool {swapper.num_host_blocks} blocks ({swapper.num_host_blocks * swapper.block_bytes / GIB:.2f} "
            f"GiB{', pinned' if swapper.pinned else ''}), measured copy bandwidth {cost.bandwidth_bytes_per_s / 1e9:.1f} GB/s"
        )
    header.append(preemption)

    vocab = read_model_config(path).vocab_size
    mean, cap = (64, 256) if small else (256, 2048)
    workload = make_workload(args.num_requests, mean, mean, cap, vocab, args.seed)
    header.append(
        f"- workload: {args.num_requests} requests, seed {args.seed}, log-normal lengths (sigma 1) mean {mean} "
        f"cap {cap}: prompt tokens {sum(workload.in_lens)} (mean {np.mean(workload.in_lens):.0f}), output tokens "
        f"{sum(workload.out_lens)} (mean {np.mean(workload.out_lens):.0f}), ignore_eos, greedy, random token ids"
    )

    # Correctness spot check (and warm-up): offline on this engine, then through the host.
    gen = torch.Generator().manual_seed(args.seed + 99)
    spot_prompts = [
        torch.randint(3, vocab, (min(k, max_model_len - SPOT_CHECK_TOKENS - 1),), generator=gen).tolist()
        for k in SPOT_CHECK_LENGTHS
    ]
    spot_params = SamplingParams(temperature=0, max_tokens=SPOT_CHECK_TOKENS, ignore_eos=True)
    offline = offline_generate(engine, spot_prompts, spot_params)
    host = AsyncEngine({MODEL: engine})
    host.start()
    rows: list[list[str]] = []
    try:
        streamed = await streamed_generate(host, spot_prompts, spot_params)
        checks = [compare("AsyncEngine streams vs offline LLM.generate loop (same engine)", streamed, offline)]
        if small:
            checks.append(
                compare(
                    "engine vs HF transformers greedy (fp32)",
                    offline,
                    hf_generate(path, spot_prompts, SPOT_CHECK_TOKENS),
                )
            )
        header.append("- correctness spot check: " + "; ".join(checks))
        for line in header:
            print(line, flush=True)
        emit(args.out, header, rows)

        footer: list[str] = []
        spec_lines: list[str] = []
        for run, rate in enumerate(parse_rates(args.rates)):
            sampler.reset()
            spec = engine.spec_stats
            spec_before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else None
            records, duration = await run_rate(host, workload, rate, run, args.sampling)
            stats = summarize(records, duration, workload)
            # Tokens the workload needs computed: each prompt, and each output but the last (never fed back).
            workload_tokens = sum(workload.in_lens) + sum(workload.out_lens) - len(workload.out_lens)
            rows.append(row(rate, stats, sampler, total_pages, args.num_requests, workload_tokens))
            errors = [r.error for r in records if r.error]
            print(
                f"rate {rate:g}: {stats['completed']}/{args.num_requests} done in {duration:.1f} s, "
                f"{stats['out_tok_s']:.0f} out tok/s, {stats['req_s']:.2f} req/s, "
                f"TTFT p50/p99 {stats['ttft_p50']:.0f}/{stats['ttft_p99']:.0f} ms, "
                f"TPOT p50/p99 {stats['tpot_p50']:.1f}/{stats['tpot_p99']:.1f} ms, "
                f"ITL p50/p99 {stats['itl_p50']:.1f}/{stats['itl_p99']:.1f} ms, "
                f"E2E p50/p99 {stats['e2e_p50'] / 1e3:.2f}/{stats['e2e_p99'] / 1e3:.2f} s, "
                f"peak running {sampler.peak_running}, peak pages {sampler.peak_pages}/{total_pages}, "
                f"preemptions {sampler.preemptions} (swapped out/in {sampler.swapped_out}/{sampler.swapped_in}), "
                f"tokens computed {sampler.batched_tokens} ({sampler.batched_tokens / max(workload_tokens, 1):.2f}x "
                f"the workload's), steps {sampler.steps}" + (f"; first error: {errors[0]}" if errors else ""),
                flush=True,
            )
            if spec_before is not None:  # speculation (issue 29): what this rate drafted and what was accepted
                drafts, drafted, accepted = (
                    now - then
                    for now, then in zip(
                        (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens), spec_before
                    )
                )
                spec_lines.append(
                    f"- speculation at rate {rate:g}: {drafts} drafts, {drafted} draft tokens, {accepted} accepted "
                    f"({accepted / drafted if drafted else 0.0:.0%})"
                )
                print(spec_lines[-1], flush=True)
            footer = list(spec_lines)
            if cuda:
                footer.append(
                    f"- peak allocator so far: {torch.cuda.max_memory_allocated() / GIB:.2f} GiB allocated, "
                    f"{torch.cuda.max_memory_reserved() / GIB:.2f} GiB reserved"
                )
                emit(args.out, [*header, *footer], rows)
            else:
                emit(args.out, [*header, *footer], rows)
    finally:
        host.shutdown()
    if cuda and args.gpu_memory_budget:
        # Issue 17 item 5: everything qserve allocated while serving stays inside the budget.
        budget = parse_memory_budget(args.gpu_memory_budget, torch.cuda.get_device_properties(0).total_memory)
        peak = torch.cuda.max_memory_allocated()
        verdict = "within" if peak <= budget else "OVER"
        line = f"- budget check: peak allocator {peak / GIB:.3f} GiB {verdict} the budget of {budget / GIB:.3f} GiB"
        print(line, flush=True)
        emit(args.out, [*header, *footer, line], rows)
        if peak > budget:
            raise SystemExit(f"peak allocator {peak / GIB:.3f} GiB exceeds --gpu-memory-budget {budget / GIB:.3f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory to serve")
    source.add_argument("--build-qwen14b", metavar="DIR", help="write (or reuse) the random Qwen2.5-14B GPTQ here")
    source.add_argument("--small", action="store_true", help="tiny random Llama, CPU-sized lengths (script check)")
    parser.add_argument("--gpu-memory-budget", default=None, help="e.g. 24GiB; default: the planner's")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "int8", "int4"))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--rates", default="4,8,16,inf", help="requests/s, comma-separated; inf = all at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None, help="default 4096 (512 with --small)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule step N+1 while step N runs (default: on, as the engine)",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages (overrides the budget)")
    parser.add_argument(
        "--watermark", type=float, default=None, help="share of KV pages admission keeps free (default: the engine's)"
    )
    parser.add_argument(
        "--watermark-per-running", type=int, default=None, help="and pages per running sequence (default: the engine's)"
    )
    # -- preemption (issue 17, item 6) --
    parser.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default="recompute",
        help="how preempted sequences come back: recompute, swap (KV to pinned host memory) or auto",
    )
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped KV")
    parser.add_argument(
        "--sampling",
        choices=("greedy", "mixed"),
        default="greedy",
        help="mixed: every 4th request uses top-k/top-p/min-p/penalties/logprobs (the sampler's worst case)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (issue 29: serving with speculation)',
    )
    parser.add_argument("--tmp", default="/tmp/qserve-bench", help="where --small writes its checkpoint")
    parser.add_argument("--out", default=None, help="markdown file, rewritten after each rate")
    args = parser.parse_args()
    if args.speculative_config:
        try:
            args.speculative_config = json.loads(args.speculative_config)
        except json.JSONDecodeError as err:
            parser.error(f"--speculative-config is not valid JSON: {err}")
    # qserve's allocator setting (the engine asks for it too, but writing the random checkpoint starts
    # CUDA first: the ninth session's run reserved 26.5 GiB under a 24 GiB budget without it)
    prefer_expandable_segments()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)

    header = ["# Serving benchmark (AsyncEngine in-process, ShareGPT-like synthetic)", ""]
    if args.small:
        path = build_small(Path(args.tmp))
    elif args.build_qwen14b:
        ckpt = Path(args.build_qwen14b)
        if (ckpt / "config.json").exists() and (ckpt / "tokenizer_config.json").exists():
            header.append(f"- checkpoint: reused {ckpt}")
        else:
            t0 = time.perf_counter()
            size = write_random_gptq(ckpt, QWEN14B)
            header.append(
                f"- checkpoint: random Qwen2.5-14B GPTQ-4bit, {size / GIB:.2f} GiB written in "
                f"{time.perf_counter() - t0:.0f} s"
            )
        path = str(ckpt)
    else:
        path = args.model
    header.append(f"- model: {path}")
    if torch.cuda.is_available():
        header.append(f"- device: {torch.cuda.get_device_name()}")
    asyncio.run(bench(args, path, header))


if __name__ == "__main__":
    main()
