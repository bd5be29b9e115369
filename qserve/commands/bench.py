"""Load-test a running OpenAI-compatible server (``qserve bench``), as ``vllm bench serve`` does.

Knows: the ``qserve bench`` arguments (vLLM's names where it has them: ``--base-url``,
``--endpoint``, ``--model``, ``--num-prompts``, ``--request-rate``, ``--max-concurrency``,
``--random-input-len``, ``--ignore-eos``, ``--metric-percentiles``, ``--result-dir``, ...; here
``--request-rate`` and ``--max-concurrency`` take comma-separated lists and every combination is
one load point), how they become a workload and load points, and the order of a run: ask the
server for its model, send warm-up requests (the first one's TTFT is reported: it is the
first-request latency when the bench is the server's first client), then per load point scrape
``/metrics``, send the load, scrape again, summarise, print a row and rewrite the JSON and PNG.
Must not know: the engine; it talks HTTP only, so it benches vLLM or any other server too.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from pathlib import Path
from typing import Any

API_KEY_ENVS = ("QSERVE_API_KEY", "OPENAI_API_KEY")


def _floats(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"needs positive numbers (or inf), comma-separated; got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs integers, comma-separated; got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"needs positive integers, comma-separated; got {text!r}")
    return values


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--model", default=None, help="model name (default: the server's first in /v1/models)")
    parser.add_argument(
        "--tokenizer", default=None, help="HF tokenizer directory (default: the model's root if it is a local dir)"
    )
    parser.add_argument("--api-key", default=None, help="Bearer key (default: $QSERVE_API_KEY or $OPENAI_API_KEY)")
    parser.add_argument("--dataset-name", choices=("random", "custom"), default="random",
                        help="random: the seeded ShareGPT-like synthetic workload; custom: a JSONL file")  # fmt: skip
    parser.add_argument("--dataset-path", default=None, help='JSONL for custom: {"prompt": ..., "output_len": N}')
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per load point")
    parser.add_argument("--random-input-len", type=int, default=256, help="mean prompt length (log-normal)")
    parser.add_argument("--random-output-len", type=int, default=256, help="mean output length (log-normal)")
    parser.add_argument("--random-max-len", type=int, default=2048, help="cap on drawn lengths")
    parser.add_argument("--random-sigma", type=float, default=1.0, help="sigma of the log-normal lengths")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="draw prompt token ids from [3, N) (default: the tokenizer's size)"
    )
    parser.add_argument("--custom-output-len", type=int, default=256, help="max_tokens for JSONL lines without one")
    parser.add_argument("--request-rate", type=_floats, default=[math.inf],
                        help="requests/s (Poisson arrivals), comma-separated; inf = all at once (default)")  # fmt: skip
    parser.add_argument("--max-concurrency", type=_ints, default=None,
                        help="most requests in flight, comma-separated (e.g. 1,4,8,16); default: no cap")  # fmt: skip
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM extension)")
    parser.add_argument("--num-warmups", type=int, default=1, help="requests sent one by one before measuring")
    parser.add_argument("--metric-percentiles", default="50,90,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default="qserve-bench.json", help="'' to write no JSON")
    parser.add_argument("--plot", default=None, help="PNG path (default: the result file with .png; '' for none)")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")


async def _model_info(client: Any, base_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    if response.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models answered {response.status_code}: {response.text[:200]}")
    return response.json().get("data", [])


def _load_tokenizer(name: str | None) -> Any | None:
    if not name:
        return None
    from qserve.tokenization import auto_tokenizer

    return auto_tokenizer(name)  # never the checkpoint's own code, never a prompt


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from qserve.bench import prom
    from qserve.bench.client import CHAT_ENDPOINTS, request_body, send_request
    from qserve.bench.dataset import as_text, load_jsonl, synthetic_requests
    from qserve.bench.load import LoadPoint, run_load
    from qserve.bench.metrics import summarize
    from qserve.bench.report import plot, table, write_json

    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    if args.dataset_name == "custom" and not args.dataset_path:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url + args.endpoint
    chat = args.endpoint in CHAT_ENDPOINTS
    result_path = Path(args.result_dir) / args.result_filename if args.result_filename else None
    plot_path = Path(args.plot) if args.plot else (result_path.with_suffix(".png") if result_path else None)
    if args.plot == "":
        plot_path = None

    timeout = httpx.Timeout(args.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        models = await _model_info(client, base_url, headers)
        card = next((m for m in models if m.get("id") == args.model), None) if args.model else None
        if card is None and not args.model:
            if not models:
                raise ValueError(f"{base_url}/v1/models lists no model; give --model")
            card = models[0]
        model = args.model or card["id"]
        max_model_len = (card or {}).get("max_model_len")
        tokenizer = _load_tokenizer(args.tokenizer)  # servers do not tell a path (qserve's /v1/models names none)
        if chat and tokenizer is None and args.dataset_name == "random":
            raise ValueError(f"{args.endpoint} needs text prompts: give --tokenizer to decode the synthetic ones")
        vocab_size = args.vocab_size or (len(tokenizer) if tokenizer is not None else None)
        if args.dataset_name == "random" and vocab_size is None:
            raise ValueError(
                "the synthetic workload draws token ids: give --tokenizer (the model's directory) or --vocab-size"
            )

        def workload(run: int) -> list[Any]:
            if args.dataset_name == "custom":
                requests = load_jsonl(args.dataset_path, default_output_len=args.custom_output_len, tokenizer=tokenizer)
                requests = (requests * math.ceil(args.num_prompts / len(requests)))[: args.num_prompts]
            else:
                requests = synthetic_requests(
                    args.num_prompts,
                    input_len=args.random_input_len,
                    output_len=args.random_output_len,
                    max_len=args.random_max_len,
                    sigma=args.random_sigma,
                    vocab_size=vocab_size,
                    seed=args.seed,
                    run=run,
                    max_model_len=max_model_len,
                )
            return as_text(requests, tokenizer) if chat else requests

        def make_body(request: Any) -> dict:
            return request_body(args.endpoint, model, request, ignore_eos=args.ignore_eos, extra={})

        config: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "base_url": base_url,
            "endpoint": args.endpoint,
            "model_id": model,
            "tokenizer_id": args.tokenizer,
            "dataset_name": args.dataset_name,
            "dataset_path": args.dataset_path,
            "num_prompts": args.num_prompts,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_max_len": args.random_max_len,
            "random_sigma": args.random_sigma,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "metric_percentiles": list(percentiles),
        }
        # Warm-up, one at a time: the first is the server's first request if nobody came before.
        warmups = workload(-1)[: max(args.num_warmups, 0)]
        warmup_ttfts = []
        for request in warmups:
            result = await send_request(client, url, make_body(request), request.prompt_len, headers)
            if not result.success:
                raise ValueError(f"the warm-up request failed (HTTP {result.status}): {result.error}")
            warmup_ttfts.append(result.ttft * 1e3)
        config["warmup_ttfts_ms"] = warmup_ttfts
        if warmup_ttfts:
            print(f"warm-up: first request TTFT {warmup_ttfts[0]:.1f} ms", flush=True)

        rates = args.request_rate
        concurrencies = args.max_concurrency or [None]
        points = [LoadPoint(rate, c) for rate in rates for c in concurrencies]
        runs: list[dict[str, Any]] = []
        for run, point in enumerate(points):
            requests = workload(run)
            before = await prom.scrape(client, base_url, model)
            results, duration = await run_load(
                client, url, requests, make_body, point, seed=args.seed * 1000 + run, headers=headers,
                progress=not args.disable_tqdm,
            )  # fmt: skip
            await asyncio.sleep(0.05)  # let the server's last observations land before the scrape
            after = await prom.scrape(client, base_url, model)
            summary = summarize(results, duration, percentiles)
            summary.update(
                load=point.label,
                request_rate=point.request_rate if not math.isinf(point.request_rate) else "inf",
                max_concurrency=point.max_concurrency,
                num_prompts=len(requests),
                model_id=model,
            )
            server = prom.server_view(before, after)
            summary["server_metrics"] = server
            summary["metrics_agreement"] = prom.agreement(summary, server) if server else None
            runs.append(summary)
            _print_point(summary, percentiles)
            if result_path is not None:
                write_json(result_path, config, runs)
            if plot_path is not None:
                try:
                    plot(plot_path, runs, percentiles)
                except ImportError:  # the table and JSON do not need it
                    print("no PNG: matplotlib is not installed (pip install matplotlib)", flush=True)
                    plot_path = None
    print()
    print(table(runs, percentiles))
    if result_path is not None:
        print(f"results: {result_path}" + (f", plot: {plot_path}" if plot_path else ""))
    return {"config": config, "runs": runs}


def _print_point(s: dict[str, Any], percentiles: tuple[float, ...]) -> None:
    high = f"p{max(percentiles):g}"
    line = (
        f"{s['load']}: {s['completed']}/{s['num_prompts']} done in {s['duration']:.1f} s, "
        f"{s['output_throughput']:.1f} out tok/s, {s['request_throughput']:.2f} req/s, "
        f"TTFT median/{high} {s['median_ttft_ms']:.1f}/{s[f'{high}_ttft_ms']:.1f} ms, "
        f"TPOT median/{high} {s['median_tpot_ms']:.1f}/{s[f'{high}_tpot_ms']:.1f} ms"
    )
    if s["failed"]:
        line += f"; errors {s['errors_by_status']} (first: {s['first_error']})"
    agreement = s.get("metrics_agreement")
    if agreement:
        line += (
            f"; vs server /metrics: TTFT {agreement['ttft_client_minus_server_ms']:+.1f} ms, "
            f"E2E {agreement['e2el_client_minus_server_ms']:+.1f} ms, tokens match {agreement.get('tokens_match')}"
        )
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(bench(args))
    return 0 if all(r["completed"] for r in result["runs"]) else 1
