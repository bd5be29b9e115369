"""Summarize a ``py-spy record --subprocesses --threads -f raw`` profile of ``qserve serve`` (issue
27's profile of the HTTP path): per process and thread, the share of samples, and the functions
that took them (self time, and inclusive time of qserve's own functions), so the front end's
cost per step (HTTP, JSON, detokenization, stop strings) and what delays the engine's next step
can be read off one table.

    py-spy record -s -t -r 100 -d 30 -p SERVER_PID -f raw -o prof.txt --nonblocking
    python bench/pyspy_summary.py prof.txt [--top 15] [--within capture_decode_graphs]

Knows: py-spy's raw format (``process PID:"cmd";thread (TID): name;frame;...;frame COUNT``). Must
not know: qserve's internals beyond the ``qserve/`` path prefix of its frames.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_FRAME = re.compile(r"^(?P<function>.+?) \((?P<file>[^():]+)(?::\d+)?\)$")


def _name(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    return f"{match['function']} ({match['file']})" if match else frame.strip()


def summarize(lines: list[str], top: int, within: str | None = None) -> str:
    """The table; ``within``: only the samples whose stack holds a function frame naming it (a phase,
    such as ``capture_decode_graphs``: the samples of the thread running it, not of others meanwhile)."""
    by_thread: Counter[tuple[str, str]] = Counter()
    self_time: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    inclusive: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    total = 0
    for line in lines:
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        process = "process ?"
        while frames and frames[0].startswith("process "):  # a subprocess's stack names its parents first
            process = frames.pop(0)
        thread = frames.pop(0) if frames and frames[0].startswith("thread ") else "thread ?"
        if within is not None and not any(within in frame for frame in frames):  # function frames only
            continue
        pid = process.split(":", 1)[0]
        command = "engine core" if "qserve.engine.core" in process else "front end"
        key = (f"{pid} ({command})", thread.split(": ", 1)[-1])
        total += count
        by_thread[key] += count
        if frames:
            self_time[key][_name(frames[-1])] += count
        for name in {_name(f) for f in frames if "qserve/" in f or "quant_kernels/" in f}:
            inclusive[key][name] += count
    out = [f"{total} samples" + (f" in stacks holding {within!r}" if within is not None else "")]
    for key, count in by_thread.most_common():
        out.append(f"\n== {key[0]}, thread {key[1]}: {count} samples ({100 * count / max(total, 1):.1f}%)")
        out.append("  self time:")
        out += [f"    {n:6d} {100 * n / count:5.1f}%  {name}" for name, n in self_time[key].most_common(top)]
        out.append("  inclusive (qserve frames):")
        out += [f"    {n:6d} {100 * n / count:5.1f}%  {name}" for name, n in inclusive[key].most_common(top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="py-spy raw output (-f raw)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--within", help="only the samples whose stack holds a frame naming this (a phase)")
    args = parser.parse_args()
    with open(args.profile) as f:
        print(summarize(f.readlines(), args.top, args.within))


if __name__ == "__main__":
    main()
