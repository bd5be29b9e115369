"""Load-test a running OpenAI-compatible server (``qserve bench``), as ``vllm bench serve`` does.

Knows: the ``qserve bench`` arguments (vLLM's names where it has them: ``--base-url``,
``--backend``, ``--endpoint``, ``--model``, ``--tokenizer``, ``--dataset-name random|sharegpt|custom``,
``--dataset-path``, ``--num-prompts``, ``--request-rate``, ``--burstiness``, ``--max-concurrency``,
``--random-input-len``, ``--ignore-eos``, ``--goodput``, ``--percentile-metrics``,
``--metric-percentiles``, ``--save-result``, ``--append-result``, ``--result-dir``,
``--result-filename``, ...; here ``--request-rate`` and ``--max-concurrency`` take comma-separated
lists and every combination is one load point), how they become a workload and load points, and
the order of a run: ask the server for its model (and, with no ``--tokenizer``, use the model's
local directory if ``/v1/models`` names one, else the server's own ``/tokenize`` and
``/detokenize``), send warm-up requests (the first one's TTFT is reported: it is the first-request
latency when the bench is the server's first client), then per load point scrape ``/metrics``,
send the load, scrape again, summarise, print a row and rewrite the result file and PNG.
Defaults are sized for the CPU demo server (a run with no flags takes well under two minutes);
pass vLLM's sizes (``--num-prompts 1000 --random-input-len 1024 ...``) for a GPU.
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


BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
DEFAULT_RESULT_FILENAME = "qserve-bench.json"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--backend",
        "--endpoint-type",
        dest="backend",
        choices=tuple(BACKEND_ENDPOINTS),
        default="openai",
        help="openai / vllm: /v1/completions; openai-chat: /v1/chat/completions (vLLM's names)",
    )
    parser.add_argument("--endpoint", default=None, help="the route to load (default: the --backend's)")
    parser.add_argument("--label", default=None, help="names the run in the result (default: the backend)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first in /v1/models)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory or cached Hub id (default: the model's root in /v1/models if it is a local "
        "directory, else the server's own tokenizer through /tokenize and /detokenize)",
    )
    parser.add_argument("--api-key", default=None, help="Bearer key (default: $QSERVE_API_KEY or $OPENAI_API_KEY)")
    parser.add_argument("--dataset-name", choices=("random", "sharegpt", "custom"), default="random",
                        help="random: the seeded ShareGPT-like synthetic workload; sharegpt: a ShareGPT JSON "
                             "file; custom: a JSONL file of prompts")  # fmt: skip
    parser.add_argument("--dataset-path", default=None,
                        help='sharegpt: the ShareGPT JSON; custom: JSONL {"prompt": ..., "output_len": N}')  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per load point (default 16: CPU-sized)")
    parser.add_argument("--random-input-len", type=int, default=64, help="mean prompt length (log-normal; default 64)")
    parser.add_argument("--random-output-len", type=int, default=32, help="mean output length (log-normal; default 32)")
    parser.add_argument("--random-max-len", type=int, default=256, help="cap on drawn lengths (default 256)")
    parser.add_argument("--random-sigma", type=float, default=1.0, help="sigma of the log-normal lengths")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="draw prompt token ids from [3, N) (default: the tokenizer's)"
    )
    parser.add_argument("--custom-output-len", type=int, default=256, help="max_tokens for JSONL lines without one")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="max_tokens for every ShareGPT request (default: the length of the recorded reply)")  # fmt: skip
    parser.add_argument("--request-rate", type=_floats, default=[math.inf],
                        help="requests/s, comma-separated; inf = all at once (default)")  # fmt: skip
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the inter-arrival gaps: 1 = Poisson (default), <1 burstier, >1 steadier")  # fmt: skip
    parser.add_argument("--max-concurrency", type=_ints, default=None,
                        help="most requests in flight, comma-separated (e.g. 1,4,8,16); default: no cap")  # fmt: skip
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM extension)")
    parser.add_argument("--num-warmups", type=int, default=1, help="requests sent one by one before measuring")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs for request_goodput, e.g. --goodput ttft:500 tpot:50 (ttft, tpot, e2el; ms)")  # fmt: skip
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help="metrics to report mean/median/std/percentiles of (ttft,tpot,itl,e2el)")  # fmt: skip
    parser.add_argument("--metric-percentiles", default="50,90,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", action="store_true",
                        help="write the result file (always done; kept for vLLM's command lines)")  # fmt: skip
    parser.add_argument("--append-result", action="store_true", help="append to the result file (JSON Lines)")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None,
                        help=f"default {DEFAULT_RESULT_FILENAME}; '' writes none. One JSON object per load point, "
                             "one a line")  # fmt: skip
    parser.add_argument("--plot", default=None, help="PNG path (default: the result file with .png; '' for none)")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")


async def _model_info(client: Any, base_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    if response.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models answered {response.status_code}: {response.text[:200]}")
    return response.json().get("data", [])


def _load_tokenizer(name: str) -> Any:
    from qserve.model.hub import resolve_model_path
    from qserve.tokenization import auto_tokenizer

    return auto_tokenizer(resolve_model_path(name))  # never the checkpoint's own code, never a prompt


async def _prompt_tokens(args: argparse.Namespace, card: dict[str, Any] | None, client: Any, base_url: str,
                         model: str, headers: dict[str, str]) -> Any:  # fmt: skip
    """Where token ids and text come from: --tokenizer, the model's local root, --vocab-size, the server."""
    from qserve.bench.tokens import LocalTokenizer, ServerTokenizer, VocabRange, local_tokenizer_dir

    name = args.tokenizer or local_tokenizer_dir((card or {}).get("root"))
    if name:
        return LocalTokenizer(_load_tokenizer(name), name)
    if args.vocab_size:
        return VocabRange(args.vocab_size)
    return ServerTokenizer(client, base_url, model, headers)


async def _with_lengths(requests: list[Any], tokens: Any) -> list[Any]:
    """Text prompts' token counts, where a dataset could not count them itself."""
    from qserve.bench.dataset import SampleRequest

    out = []
    for r in requests:
        if isinstance(r.prompt, str) and not r.prompt_len:
            r = SampleRequest(r.prompt, len(await tokens.encode(r.prompt)), r.output_len)
        out.append(r)
    return out


async def _as_text(requests: list[Any], tokens: Any) -> list[Any]:
    """Token-id prompts decoded to text (chat endpoints take text only); lengths re-counted."""
    from qserve.bench.dataset import SampleRequest

    out = []
    for r in requests:
        if isinstance(r.prompt, str):
            out.append(r)
            continue
        text = await tokens.decode(r.prompt)
        out.append(SampleRequest(text, len(await tokens.encode(text)), r.output_len))
    return out


async def _sharegpt(args: argparse.Namespace, tokens: Any, max_model_len: int | None) -> list[Any]:
    """vLLM's ShareGPT sampling: shuffled conversations, first turn as the prompt, the reply's
    length as max_tokens (or --sharegpt-output-len), too short or too long ones skipped."""
    from qserve.bench.dataset import SampleRequest, sharegpt_conversations, sharegpt_keeps

    requests = []
    for prompt, reply in sharegpt_conversations(args.dataset_path, args.seed):
        prompt_len = len(await tokens.encode(prompt))
        output_len = args.sharegpt_output_len or len(await tokens.encode(reply))
        if not sharegpt_keeps(prompt_len, output_len, fixed_output_len=args.sharegpt_output_len):
            continue
        if max_model_len is not None and prompt_len + output_len > max_model_len:
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
        if len(requests) == args.num_prompts:
            break
    if not requests:
        raise ValueError(f"{args.dataset_path}: no conversation fits vLLM's ShareGPT length filter")
    return requests


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from qserve.bench import prom
    from qserve.bench.client import CHAT_ENDPOINTS, request_body, send_request
    from qserve.bench.dataset import load_jsonl, synthetic_requests
    from qserve.bench.load import LoadPoint, run_load
    from qserve.bench.metrics import parse_goodput, parse_metrics, summarize
    from qserve.bench.report import plot, table, write_results

    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    metrics = parse_metrics(args.percentile_metrics)
    goodput = parse_goodput(args.goodput)
    if args.dataset_name in ("custom", "sharegpt") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    endpoint = args.endpoint or BACKEND_ENDPOINTS[args.backend]
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url + endpoint
    chat = endpoint in CHAT_ENDPOINTS
    filename = DEFAULT_RESULT_FILENAME if args.result_filename is None else args.result_filename
    result_path = Path(args.result_dir) / filename if filename else None
    plot_path = Path(args.plot) if args.plot else (result_path.with_suffix(".png") if result_path else None)
    if args.plot == "":
        plot_path = None
    before = ""
    if result_path is not None:
        result_path.parent.mkdir(parents=True, exist_ok=True)
        if args.append_result and result_path.is_file():
            before = result_path.read_text()

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
        tokens = await _prompt_tokens(args, card, client, base_url, model, headers)
        pool = await tokens.pool() if args.dataset_name == "random" else None
        fixed: list[Any] | None = None
        if args.dataset_name == "sharegpt":
            fixed = await _sharegpt(args, tokens, max_model_len)
        elif args.dataset_name == "custom":
            fixed = load_jsonl(args.dataset_path, default_output_len=args.custom_output_len)
            fixed = await _with_lengths((fixed * math.ceil(args.num_prompts / len(fixed)))[: args.num_prompts], tokens)

        async def workload(run: int) -> list[Any]:
            if fixed is not None:
                requests = fixed
            else:
                requests = synthetic_requests(
                    args.num_prompts,
                    input_len=args.random_input_len,
                    output_len=args.random_output_len,
                    max_len=args.random_max_len,
                    sigma=args.random_sigma,
                    seed=args.seed,
                    run=run,
                    max_model_len=max_model_len,
                    token_pool=pool,
                )
            return await _as_text(requests, tokens) if chat else requests

        def make_body(request: Any) -> dict:
            return request_body(endpoint, model, request, ignore_eos=args.ignore_eos, extra={})

        # vLLM's flat per-run keys first; qserve's own (the workload, the server's view) after.
        config: dict[str, Any] = {
            "date": time.strftime("%Y%m%d-%H%M%S"),
            "backend": args.backend,
            "endpoint_type": args.backend,
            "label": args.label or args.backend,
            "model_id": model,
            "tokenizer_id": args.tokenizer or getattr(tokens, "name", None),
            "base_url": base_url,
            "endpoint": endpoint,
            "dataset_name": args.dataset_name,
            "dataset_path": args.dataset_path,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_max_len": args.random_max_len,
            "random_sigma": args.random_sigma,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "goodput": goodput or None,
            "metric_percentiles": list(percentiles),
        }
        # Warm-up, one at a time: the first is the server's first request if nobody came before.
        warmups = (await workload(-1))[: max(args.num_warmups, 0)]
        warmup_ttfts = []
        for request in warmups:
            result = await send_request(client, url, make_body(request), request.prompt_len, headers)
            if not result.success:
                raise ValueError(f"the warm-up request failed (HTTP {result.status}): {result.error}")
            warmup_ttfts.append(result.ttft * 1e3)
        config["warmup_ttfts_ms"] = warmup_ttfts
        if warmup_ttfts:
            print(f"warm-up: first request TTFT {warmup_ttfts[0]:.1f} ms", flush=True)

        concurrencies = args.max_concurrency or [None]
        points = [LoadPoint(rate, c, args.burstiness) for rate in args.request_rate for c in concurrencies]
        runs: list[dict[str, Any]] = []
        for run, point in enumerate(points):
            requests = await workload(run)
            scraped = await prom.scrape(client, base_url, model)
            results, duration = await run_load(
                client, url, requests, make_body, point, seed=args.seed * 1000 + run, headers=headers,
                progress=not args.disable_tqdm,
            )  # fmt: skip
            await asyncio.sleep(0.05)  # let the server's last observations land before the scrape
            after = await prom.scrape(client, base_url, model)
            summary = summarize(results, duration, percentiles, metrics, goodput)
            flat: dict[str, Any] = dict(config)
            flat.update(
                num_prompts=len(requests),
                request_rate=point.request_rate if not math.isinf(point.request_rate) else "inf",
                burstiness=point.burstiness,
                max_concurrency=point.max_concurrency,
                load=point.label,
            )
            flat.update(summary)
            server = prom.server_view(scraped, after)
            flat["server_metrics"] = server
            flat["metrics_agreement"] = prom.agreement(flat, server) if server else None
            runs.append(flat)
            _print_point(flat, percentiles)
            if result_path is not None:
                write_results(result_path, runs, before)
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
        f"{s['output_throughput']:.1f} out tok/s, {s['request_throughput']:.2f} req/s"
    )
    if s.get("request_goodput") is not None:
        line += f", goodput {s['request_goodput']:.2f} req/s"
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT")):
        if f"median_{key}_ms" in s:
            line += f", {title} median/{high} {s[f'median_{key}_ms']:.1f}/{s[f'{high}_{key}_ms']:.1f} ms"
    if s["failed"]:
        line += f"; errors {s['errors_by_status']} (first: {s['first_error']})"
    agreement = s.get("metrics_agreement")
    if agreement:
        diffs = [f"{title} {agreement[f'{key}_client_minus_server_ms']:+.1f} ms" for key, title in
                 (("ttft", "TTFT"), ("e2el", "E2E")) if f"{key}_client_minus_server_ms" in agreement]  # fmt: skip
        diffs.append(f"tokens match {agreement.get('tokens_match')}")
        line += "; vs server /metrics: " + ", ".join(diffs)
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(bench(args))
    return 0 if all(r["completed"] for r in result["runs"]) else 1
