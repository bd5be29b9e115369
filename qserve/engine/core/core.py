"""The engine-core process: loads every hosted model onto one page pool, then steps them and
answers the front end over ZMQ (``python -m qserve.engine.core.core``, started by
``qserve.engine.core.client``).

Knows: the loop (inbound messages between steps; one step per busy model per round, round-robin,
as ``AsyncEngine`` does; one ``Outputs`` message per step), per-model queue bounds (checked
exactly here, on add), grammar compiles off the loop (a request with a constraint the core has
not compiled yet is queued once its compile, on a helper thread, is done), a failing model's
requests (aborted, reported), KV-cache events (``--kv-events-config``: published here), the live numbers (sent every ``STATS_INTERVAL_S`` while busy, with
every output that finishes a request, and once on going idle), and how it ends: on ``Shutdown``
(abort all, send the last outputs, ``Bye``), or when its parent process is gone (nobody would
read its outputs: it exits at once, so every page dies with it). SIGINT and SIGTERM are ignored:
the front end drains first and then stops the core. Must not know: HTTP, text, tokenizing
prompts, Prometheus.

Start-up: the parent writes a pickled ``CoreConfig`` to the child's stdin; the child connects
its two sockets (PULL for requests, PUSH for outputs; the parent bound both), loads the models,
and sends ``Ready`` (or ``StartupFailed``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import zmq

from qserve.engine.async_engine import (
    IDLE_WAIT_S,
    EngineDeadError,
    HostConfig,
    HostedModel,
    KVEventFeed,
    KVEventPublisher,
    ModelSpec,
    QueueFullError,
    abort_model,
    build_engines,
)
from qserve.engine.core.core_engine import CoreEngine
from qserve.engine.core.messages import (
    Abort,
    Added,
    AddRequests,
    Bye,
    Codec,
    ModelFailed,
    ModelInfo,
    ModelOutputs,
    Outputs,
    Ready,
    RequestDelta,
    SetTenants,
    Shutdown,
    StartupFailed,
    request_params,
)
from qserve.engine.kv_events import KVEventsConfig, ZmqKVEventPublisher
from qserve.spec_decode.metrics import stats_entries

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05  # live numbers (queues, pages) go out at most this often while busy
SEND_LINGER_MS = 2000  # on exit, time for the last messages to leave
COMPILE_THREADS = 2
COMPILE_POLL_S = 0.005  # while only grammar compiles are pending


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Everything the core process needs (pickled to its stdin)."""

    models: Sequence[ModelSpec]
    host: HostConfig
    input_address: str  # the front end's PUSH (bound by the front end)
    output_address: str  # the front end's PULL (bound by the front end)
    max_queue: int | None = None
    retry_after_s: int = 1
    log_level: int = logging.WARNING
    kv_events: KVEventsConfig | None = None  # --kv-events-config: the core publishes them
    port: int = 0  # the server's port ({port} of the KV-event topic)


class EngineCore:
    """The loop of the core process (one thread: it owns every engine)."""

    def __init__(
        self,
        engines: Mapping[str, CoreEngine],
        config: CoreConfig,
        inbound: zmq.Socket,
        outbound: zmq.Socket,
        kv_events: KVEventPublisher | None = None,
    ):
        self.models = {name: HostedModel(name, engine, config.max_queue) for name, engine in engines.items()}
        self.config = config
        self.codec = Codec()
        self.inbound = inbound
        self.outbound = outbound
        self.parent = os.getppid()
        self._compiles = concurrent.futures.ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="qserve-core-grammar"
        )
        self._compiling: list[tuple[concurrent.futures.Future[None], AddRequests]] = []
        self._cancelled: set[tuple[str, str]] = set()  # aborted while their grammar compiled
        self._stopping = False
        self._stats_sent = 0.0
        self._was_busy = False
        # KV-cache events (as AsyncEngine): one recorder per distinct page pool, published after every step.
        self.kv_events = kv_events
        self._kv_feed = KVEventFeed(self.models, kv_events) if kv_events is not None else None

    # ------------------------------------------------------------------ handshake
    def ready(self) -> Ready:
        infos = []
        for name, hosted in self.models.items():
            engine = hosted.engine
            infos.append(
                ModelInfo(
                    name=name,
                    path=str(engine.config.model),
                    max_model_len=engine.max_model_len,
                    vocab_size=engine.model_config.vocab_size,
                    hidden_size=engine.model_config.hidden_size,
                    eos_token_ids=sorted(engine.eos_token_ids),
                    max_queue=hosted.max_queue,
                    cache_info={
                        "block_size": engine.config.block_size,
                        "num_gpu_blocks": engine.block_pool.num_blocks,
                        "cache_dtype": engine.config.kv_cache_dtype,
                        "enable_prefix_caching": engine.config.enable_prefix_caching,
                        "max_model_len": engine.max_model_len,
                    },
                )
            )
        return Ready(infos, self.stats(), os.getpid())

    def stats(self) -> dict[str, dict[str, int]]:
        """``AsyncEngine.stats()``'s numbers."""
        result = {}
        for name, hosted in self.models.items():
            engine = hosted.engine
            kv = engine.kv_manager
            result[name] = {
                "num_running": hosted.num_running,
                "num_waiting": hosted.num_waiting,
                "pool_pages_used": engine.block_pool.num_used_by(engine.owner),
                "pool_pages_total": engine.block_pool.num_blocks,
                "pool_pages_free": engine.block_pool.num_free_blocks,
                "prefix_cache_queries": kv.num_prefix_queries,
                "prefix_cache_hits": kv.num_prefix_hits,
                "num_preemptions": engine.num_preemptions,
                "num_swapped": engine.scheduler.num_swapped,
                "num_swapped_out": engine.scheduler.num_swapped_out,
                "num_swapped_in": engine.scheduler.num_swapped_in,
                **stats_entries(engine.spec_stats),  # speculative decoding's counters
            }
        return result

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        rotation = 0
        try:
            while not self._stopping:
                if os.getppid() != self.parent:
                    logger.error("the front end (pid %d) is gone; the engine core exits", self.parent)
                    return
                busy = [m for m in self.models.values() if m.engine.has_unfinished_requests()]
                if not busy and self._was_busy:  # the numbers at the end of a busy spell, before idling
                    self._was_busy = False
                    self._send(Outputs([], self.stats()))
                # Idle: wait for work; compiling only: look again soon; busy: do not wait.
                self._receive(0.0 if busy else COMPILE_POLL_S if self._compiling else IDLE_WAIT_S)
                self._admit_compiled()
                if self._stopping:
                    break
                busy = [m for m in self.models.values() if m.engine.has_unfinished_requests()]
                if not busy:
                    continue
                self._was_busy = True
                start = rotation % len(busy)
                rotation += 1
                for hosted in busy[start:] + busy[:start]:
                    self._step(hosted)
                    self._receive(0.0)  # aborts land between models' steps
            self._abort_all()
            self._send(Bye())
        finally:
            self._compiles.shutdown(wait=False, cancel_futures=True)

    def _receive(self, wait_s: float) -> None:
        """Handle every waiting message (waiting up to ``wait_s`` for the first)."""
        timeout = int(wait_s * 1000)
        while not self._stopping and self.inbound.poll(timeout):
            timeout = 0
            message = self.codec.decode_frontend(self.inbound.recv(copy=False).buffer)
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001 - a bad message must not kill the core
                logger.exception("engine core: handling %s failed", type(message).__name__)

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequests):
            self._add_or_compile(message)
        elif isinstance(message, Abort):
            self._abort(message)
        elif isinstance(message, SetTenants):
            for hosted in self.models.values():
                hosted.engine.scheduler.set_tenants(message.weights, message.max_running)
        elif isinstance(message, Shutdown):
            self._stopping = True

    def _abort(self, message: Abort) -> None:
        hosted = self.models.get(message.model)
        if hosted is None:
            return
        if any(message.request_id in {r.request_id for r in add.requests} for _, add in self._compiling):
            self._cancelled.add((message.model, message.request_id))
        if message.index is None:
            hosted.engine.abort_request(message.request_id)
        else:
            hosted.engine.finish_sequence(message.request_id, message.index)

    # ------------------------------------------------------------------ adding requests
    def _add_or_compile(self, message: AddRequests) -> None:
        hosted = self.models.get(message.model)
        if hosted is None:
            self._send(Added(message.submit_id, "model", message.model))
            return
        try:
            params = [request_params(r) for r in message.requests]
        except ValueError as err:
            self._send(Added(message.submit_id, "value", str(err)))
            return
        constraints = [p.structured_outputs for p in params if getattr(p, "structured_outputs", None) is not None]
        compiler = hosted.engine.grammar_compiler
        if constraints and compiler.tokenizer is not None:
            # Compiled on a helper thread, so the steps of running requests go on meanwhile.
            def compile_all() -> None:
                for constraint in constraints:
                    compiler.compile(constraint)

            self._compiling.append((self._compiles.submit(compile_all), message))
            return
        self._add(hosted, message, params)

    def _admit_compiled(self) -> None:
        if not self._compiling:
            return
        still = []
        for future, message in self._compiling:
            if not future.done():
                still.append((future, message))
                continue
            hosted = self.models[message.model]
            error = future.exception()
            if error is not None:
                self._send(Added(message.submit_id, "value", str(error)))
                continue
            self._add(hosted, message, [request_params(r) for r in message.requests])
            for request in message.requests:
                if (message.model, request.request_id) in self._cancelled:
                    self._cancelled.discard((message.model, request.request_id))
                    hosted.engine.abort_request(request.request_id)
        self._compiling = still

    def _add(self, hosted: HostedModel, message: AddRequests, params: list) -> None:
        """All or none, as ``AsyncEngine.submit``; the answer says which error, if any."""
        items = list(zip(message.requests, params))
        try:
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            hosted.check_queue(sum(p.n for _, p in items), self.config.retry_after_s)
            for request, p in items:  # validate all before queuing any
                hosted.engine.validate_request(request.prompt_token_ids, p)
            added: list[str] = []
            try:
                for request, p in items:
                    extra = {"tenant": request.tenant} if request.tenant is not None else {}
                    hosted.engine.add_request(request.request_id, request.prompt_token_ids, p, **extra)
                    added.append(request.request_id)
            except BaseException:
                for request_id in added:
                    hosted.engine.abort_request(request_id)
                raise
            hosted.active.update(added)
        except QueueFullError as err:
            self._send(
                Added(
                    message.submit_id,
                    "queue_full",
                    str(err),
                    err.retry_after_s,
                    err.max_queue,
                    sum(p.n for _, p in items),
                )
            )
        except EngineDeadError as err:
            self._send(Added(message.submit_id, "dead", str(err)))
        except ValueError as err:
            self._send(Added(message.submit_id, "value", str(err)))
        else:
            self._send(Added(message.submit_id))

    # ------------------------------------------------------------------ steps
    def _step(self, hosted: HostedModel) -> None:
        try:
            outputs: list[RequestDelta] = hosted.engine.step()  # type: ignore[assignment]
        except Exception as err:  # noqa: BLE001 - fail this model's requests, keep serving others
            logger.exception("step of model %s failed; aborting its requests", hosted.name)
            self._fail_model(hosted, err)
            return
        finished = False
        for output in outputs:
            if output.finished:
                finished = True
                hosted.active.discard(output.request_id)
        step_tokens = hosted.engine.take_step_tokens()
        if self._kv_feed is not None:
            self._kv_feed.publish_pending()
        now = time.monotonic()
        stats = None
        # With a finished request, the numbers that no longer count it travel with its last output.
        if finished or now - self._stats_sent >= STATS_INTERVAL_S:
            self._stats_sent = now
            stats = self.stats()
        if outputs or step_tokens or stats is not None:
            self._send(Outputs([ModelOutputs(hosted.name, outputs, step_tokens)], stats))

    def _fail_model(self, hosted: HostedModel, err: Exception) -> None:
        request_ids = abort_model(hosted)
        self._send(ModelFailed(hosted.name, request_ids, f"model {hosted.name!r} failed: {err}"))

    def _abort_all(self) -> None:
        """On shutdown: abort everything, flush, and send the last outputs (every stream ends)."""
        for _, message in self._compiling:
            self._send(Added(message.submit_id, "dead", "the engine is shutting down"))
        self._compiling = []
        for hosted in self.models.values():
            for request_id in hosted.active:
                hosted.engine.abort_request(request_id)
            hosted.active.clear()
            try:
                outputs = hosted.engine.step() if hosted.engine.has_unfinished_requests() else []
            except Exception:  # noqa: BLE001
                logger.exception("flushing aborts of model %s failed", hosted.name)
                continue
            if outputs:
                self._send(Outputs([ModelOutputs(hosted.name, outputs)]))  # type: ignore[arg-type]

    def _send(self, message: object) -> None:
        self.outbound.send(self.codec.encode(message), copy=False)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- process entry
def main() -> int:
    # The front end drives shutdown (SIGTERM drains there first, then it sends Shutdown); a
    # Ctrl-C in the terminal reaches this process too and must not kill it under the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config: CoreConfig = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=config.log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    context = zmq.Context()
    inbound = context.socket(zmq.PULL)
    inbound.setsockopt(zmq.RCVHWM, 0)
    inbound.connect(config.input_address)
    outbound = context.socket(zmq.PUSH)
    # Unbounded: a send never blocks the loop (if the front end is gone, the parent check ends it).
    outbound.setsockopt(zmq.SNDHWM, 0)
    outbound.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    outbound.connect(config.output_address)
    codec = Codec()
    publisher = None
    try:
        try:
            engines = build_engines(config.models, config.host, engine_cls=CoreEngine)
            if config.kv_events is not None:
                device = next(iter(engines.values())).device
                medium = "GPU" if device.type == "cuda" else "CPU"
                publisher = ZmqKVEventPublisher(config.kv_events, port=config.port, medium=medium)
            core = EngineCore(engines, config, inbound, outbound, publisher)  # type: ignore[arg-type]
        except Exception as err:  # noqa: BLE001 - reported to the front end, which decides
            user_error = isinstance(err, (ValueError, FileNotFoundError))
            if not user_error:
                logger.exception("loading the models failed")
            outbound.send(codec.encode(StartupFailed(str(err), user_error)))
            return 1
        outbound.send(codec.encode(core.ready()))
        core.run()
        return 0
    finally:
        if publisher is not None:
            publisher.close()
        inbound.close(linger=0)
        outbound.close()
        context.term()


if __name__ == "__main__":
    sys.exit(main())
