"""Wall time vs device time per decode step, with async scheduling off and on (issue 17, item 4).

One engine on a Qwen2.5-14B-shaped random GPTQ-4bit checkpoint (``bench/e2e.py``'s
``write_random_gptq``, written to ``--checkpoint`` if it is not there yet), greedy decode-only
steps at each batch size, first with ``async_scheduling`` off (every step's host work — outputs,
detokenization, stop checks, the next schedule and inputs — adds to the device's) and then on
(that work overlaps the next step's device time). Per step it reports:

- wall: ``Engine.step()`` calls in steady decode, wall clock / number of steps;
- device: CUDA events recorded around each step's device work (``ModelRunner.launch``: inputs,
  forward, sampler, the sampled ids' copy to the host), summed; on CPU the launch's own time;
- wall / device: 1.00 means the host's work is hidden.

    python bench/step_overlap.py --out step_overlap.md                        # H200, < 4 minutes
    python bench/step_overlap.py --small --out /tmp/step_overlap.md           # tiny model, CPU or GPU

The table goes to stdout and ``--out`` (markdown).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e import QWEN14B, SMALL, write_random_gptq  # noqa: E402

from qserve import LLM, SamplingParams  # noqa: E402


class DeviceTimer:
    """Wraps ``runner.launch``: times each step's device work (CUDA events; wall time on CPU)."""

    def __init__(self, engine) -> None:  # noqa: ANN001 - an Engine
        self.runner = engine.runner
        self.cuda = engine.device.type == "cuda"
        self.spans: list = []
        self._launch = self.runner.launch

        def launch(scheduler_output, previous=None):  # noqa: ANN001, ANN202 - ModelRunner.launch
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                step = self._launch(scheduler_output, previous)
                end.record()
                self.spans.append((start, end))
            else:
                began = time.perf_counter()
                step = self._launch(scheduler_output, previous)
                self.spans.append(time.perf_counter() - began)
            return step

        self.runner.launch = launch

    def take_ms(self) -> list[float]:
        """Device milliseconds of each step timed since the last call."""
        spans, self.spans = self.spans, []
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in spans]
        return [1000 * s for s in spans]

    def close(self) -> None:
        self.runner.launch = self._launch


def measure(llm: LLM, timer: DeviceTimer, batch: int, args: argparse.Namespace, vocab: int) -> tuple[float, float]:
    """Steady decode of ``batch`` sequences: (wall ms per step, device ms per step)."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=args.warmup_steps + args.steps + 8, ignore_eos=True)
    tag = f"b{batch}-{'async' if engine.async_scheduling else 'sync'}-"
    for i in range(batch):
        ids = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, params)
    # Prefill, then a few decode steps, so that every sequence decodes in every measured step.
    while any(len(seq.request.output_token_ids) < args.warmup_steps for _, seq in engine._sequences.values()):
        engine.step()
    timer.take_ms()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - start
    device = timer.take_ms()
    for i in range(batch):
        engine.abort_request(f"{tag}{i}")
    while engine.has_unfinished_requests():
        engine.step()
    timer.take_ms()
    return 1000 * wall / args.steps, statistics.fmean(device) if device else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (checks the script; CPU is fine)")
    parser.add_argument("--checkpoint", default="/tmp/qb", help="the random GPTQ checkpoint (written if missing)")
    parser.add_argument("--out", default="step_overlap.md")
    parser.add_argument("--batches", default=None, help="default 1,64,128,256 (--small: 1,16,64)")
    parser.add_argument(
        "--steps", type=int, default=None, help="measured decode steps per row (default 100; --small 10)"
    )
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--budget", default="40GiB", help="--gpu-memory-budget of the engine (CUDA)")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 10 if args.small else 100
    batches = [int(b) for b in (args.batches or ("1,16,64" if args.small else "1,64,128,256")).split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SMALL if args.small else QWEN14B
    path = Path(args.checkpoint + ("-small" if args.small else ""))
    if not (path / "config.json").exists():
        began = time.perf_counter()
        size = write_random_gptq(path, shape)
        print(f"wrote {path} ({size / 2**30:.2f} GiB) in {time.perf_counter() - began:.0f} s", flush=True)

    began = time.perf_counter()
    llm = LLM(
        str(path),
        device=device,
        max_model_len=1024,
        max_num_seqs=max(batches),
        gpu_memory_budget=args.budget if device == "cuda" else None,
        num_kv_blocks=None if device == "cuda" else 64 * max(batches),
    )
    engine = llm.engine
    print(f"engine ready in {time.perf_counter() - began:.0f} s on {device}", flush=True)
    timer = DeviceTimer(engine)
    rows = []
    for batch in batches:
        results = {}
        for mode in (False, True):
            engine.set_async_scheduling(mode)
            results[mode] = measure(llm, timer, batch, args, shape["vocab"])
            wall, dev = results[mode]
            print(
                f"batch {batch:4d} async {'on ' if mode else 'off'}: wall {wall:8.3f} ms  device {dev:8.3f} ms",
                flush=True,
            )
        for mode in (False, True):
            wall, dev = results[mode]
            speedup = results[False][0] / wall
            rows.append(
                f"| {batch} | {'on' if mode else 'off'} | {wall:.3f} | {dev:.3f} | {wall / dev:.3f} | {speedup:.2f}x |"
            )
    timer.close()

    name = "tiny random GPTQ-4bit (--small)" if args.small else "Qwen2.5-14B-shaped random GPTQ-4bit"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [
        f"## Decode step: wall vs device time, async scheduling off / on ({name}, {gpu})",
        "",
        f"Greedy decode-only steps, prompt {args.prompt_len} tokens, {args.steps} measured steps per row; "
        + (
            "device = CUDA events around each step's launch (inputs, forward, sampler, copy of the sampled ids), "
            if device == "cuda"
            else "device = the launch's own wall time (on CPU the forward runs inside it, so no overlap is possible), "
        )
        + "mean; wall = Engine.step() wall clock per step. Target (H200): wall <= 1.05x device at batch 1 and 128.",
        "",
        "| batch | async scheduling | wall ms/step | device ms/step | wall / device | wall speed-up vs off |",
        "|---:|:---:|---:|---:|---:|---:|",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
