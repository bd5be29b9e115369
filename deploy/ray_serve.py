"""qserve replicas under Ray Serve: Ray routes requests to replicas and adds or removes
replicas on the number of ongoing requests; each replica is one ``qserve serve`` (same flags,
same OpenAI routes, /health, /metrics) in a Ray actor.

Knows: how a replica turns ``qserve serve`` arguments into a loaded host and its FastAPI
app (built on the replica, after the models are loaded, so Ray sees a replica as ready only
when it can answer), the replica's health check, and the deployment options (autoscaling on
ongoing requests, CPUs / GPUs per replica, graceful shutdown). Must not know: routing,
scheduling across replicas (Ray Serve's), engines' internals.

Run it with Ray's CLI (arguments are ``key=value``; ``serve_args`` is a ``qserve serve``
command line without the ``serve``)::

    serve run deploy.ray_serve:build_app model=/models/qwen2.5-7b-gptq \
        serve_args="--max-model-len 8192 --gpu-memory-utilization 0.9" \
        min_replicas=1 max_replicas=4 target_ongoing_requests=16 num_gpus=1

or from Python: ``serve.run(build_app({...}), route_prefix="/")``. Without ``model`` it
serves the built-in demo model (quantized once and cached, as ``qserve serve`` does).
"""

from __future__ import annotations

import logging
import shlex
from typing import Any

from ray import serve
from ray.serve import Application

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 8,  # per replica; Ray adds replicas above it
    "max_ongoing_requests": 64,  # per replica; Ray queues (or spreads) beyond it
    "num_cpus": 1.0,
    "num_gpus": 0.0,
    "upscale_delay_s": 10.0,
    "downscale_delay_s": 60.0,
    "metrics_interval_s": 2.0,
    "look_back_period_s": 10.0,
    "graceful_shutdown_timeout_s": 25.0,  # as qserve serve's --shutdown-timeout default
}


@serve.ingress()  # the ASGI app is built on each replica by __serve_build_asgi_app__
class QServeReplica:
    """One replica: parses ``qserve serve`` arguments, loads the models, serves qserve's app."""

    def __init__(self, serve_argv: list[str]) -> None:
        from qserve.cli import build_parser
        from qserve.commands.serve import build_host_factory
        from qserve.server.app import create_app

        argv = ["serve", *serve_argv]
        args = build_parser(argv).parse_args(argv)
        host = build_host_factory(args)()  # loads now: Ray routes to the replica once this returns
        self._app = create_app(host, log_requests=not args.disable_log_requests, log_stats=not args.disable_log_stats)
        logger.info("qserve replica ready: %s", ", ".join(host.model_names))

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    def check_health(self) -> None:
        """Ray restarts a replica whose engine stopped (its step thread died)."""
        state = self._app.state.qserve
        if state.host is not None and not state.ready:
            raise RuntimeError("the qserve engine is not running")


def _options(config: dict[str, Any]) -> dict[str, Any]:
    def number(key: str) -> float:
        return float(config.get(key, DEFAULTS[key]))

    min_replicas, max_replicas = int(number("min_replicas")), int(number("max_replicas"))
    if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
        raise ValueError(
            f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got {min_replicas}, {max_replicas}"
        )
    return {
        "autoscaling_config": {
            "min_replicas": min_replicas,
            "initial_replicas": max(min_replicas, 1),
            "max_replicas": max_replicas,
            "target_ongoing_requests": number("target_ongoing_requests"),
            "upscale_delay_s": number("upscale_delay_s"),
            "downscale_delay_s": number("downscale_delay_s"),
            "metrics_interval_s": number("metrics_interval_s"),
            "look_back_period_s": number("look_back_period_s"),
        },
        "max_ongoing_requests": int(number("max_ongoing_requests")),
        "ray_actor_options": {"num_cpus": number("num_cpus"), "num_gpus": number("num_gpus")},
        "graceful_shutdown_timeout_s": number("graceful_shutdown_timeout_s"),
        "health_check_period_s": 5.0,
    }


def build_app(config: dict[str, Any]) -> Application:
    """The Ray Serve application (``serve run deploy.ray_serve:build_app key=value ...``).

    Keys: ``model`` (a path or NAME=PATH; default: the demo model), ``serve_args`` (more
    ``qserve serve`` flags, one string), and the deployment options in ``DEFAULTS``.
    """
    unknown = sorted(set(config) - set(DEFAULTS) - {"model", "serve_args", "name"})
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)}; known: model, serve_args, name, {', '.join(DEFAULTS)}"
        )
    argv = [str(config["model"])] if config.get("model") else []
    argv += shlex.split(str(config.get("serve_args", "")))
    deployment = serve.deployment(QServeReplica, name=str(config.get("name", "qserve")), **_options(config))
    return deployment.bind(argv)
