"""The engine-core process: loads every hosted model onto one page pool, then steps them and
answers its front ends over ZMQ (``python -m qserve.engine.core.core``, started by
``qserve.engine.core.process``: for one front end by its ``EngineCoreClient``, for
``--api-server-count N`` by ``qserve serve``'s parent process).

Knows: the loop (inbound messages between steps; one step per busy model per round, round-robin,
as ``AsyncEngine`` does; one ``Outputs`` message per step), per-model queue bounds (checked
exactly here, on add), grammar compiles off the loop (a request with a constraint the core has
not compiled yet is queued once its compile, on a helper thread, is done), a failing model's
requests (aborted, reported), KV-cache events (``--kv-events-config``: published here), the live numbers (sent every ``STATS_INTERVAL_S`` while busy, with
every output that finishes a request, and once on going idle), and how it ends: on ``Shutdown``
(abort all, send the last outputs, ``Bye``), or when its parent process is gone (nobody would
read its outputs: it exits at once, so every page dies with it). SIGINT and SIGTERM are ignored:
the front ends drain first and then stop the core. Must not know: HTTP, text, tokenizing
prompts, Prometheus.

Several front ends (``--api-server-count``): each is a ``ClientChannel`` of its own sockets, so a
message's sender is the socket it came on. A request's engine id is ``"<client>/<request id>"``
(unique across front ends whatever ids they pick); its outputs, ``Added`` answers and failures go
back to that front end only, with the id it sent. The live numbers go to every front end; the
tokens of each step to one (the first still there), so ``/metrics``, summed over the front ends'
processes, counts each step once. A front end with a liveness pipe (``alive_fd``: the read end; it
holds the write end) that reaches EOF is gone: its requests are aborted (pages freed at once),
its grammar compiles dropped, its sockets closed; when every such front end is gone the core exits.

LoRA adapters (``--enable-lora``): the core owns them. ``CoreConfig.lora_modules`` are registered
before ``Ready`` (which lists them); a request's ``LoRASpec`` is checked against the adapters loaded
(an unloaded one is refused, as in ``AsyncEngine``); a ``LoRAControl`` (runtime load / unload /
list) runs once here, between steps, and is answered with the whole adapter list (``LoRAState``);
after a change every other front end gets that list too, before the caller's answer. The adapters
of running and waiting requests travel with the live numbers (``lora_requests_info``).

Start-up: the parent writes a pickled ``CoreConfig`` to the child's stdin; the child binds each
front end's request socket (PULL) and connects its output socket (PUSH; the front end binds it):
each side binds what it reads, so a message sent before the other side is up waits in ZMQ's
queue. Then it loads the models and sends ``Ready`` (or ``StartupFailed``) to every front end.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    _check_registered,
    abort_for_shutdown,
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
    LoRAControl,
    LoRASpec,
    LoRAState,
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
from qserve.engine.core.startup_heap import freeze_startup_heap
from qserve.engine.kv_events import KVEventsConfig, ZmqKVEventPublisher
from qserve.lora.request import LoRARequest
from qserve.spec_decode.metrics import stats_entries

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05  # live numbers (queues, pages) go out at most this often while busy
SEND_LINGER_MS = 2000  # on exit, time for the last messages to leave
COMPILE_THREADS = 2
COMPILE_POLL_S = 0.005  # while only grammar compiles are pending


@dataclass(frozen=True, slots=True)
class ClientAddresses:
    """Where the core meets one front end (``ipc://`` paths in a private directory)."""

    input_address: str  # its requests: the core binds a PULL here, the front end connects its PUSH
    output_address: str  # its outputs: the front end binds a PULL here, the core connects its PUSH
    alive_fd: int | None = None  # the core's end of the front end's liveness pipe (EOF: it is gone)


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Everything the core process needs (pickled to its stdin)."""

    models: Sequence[ModelSpec]
    host: HostConfig
    clients: Sequence[ClientAddresses]  # one per front end, in client-index order
    max_queue: int | None = None
    retry_after_s: int = 1
    log_level: int = logging.WARNING
    kv_events: KVEventsConfig | None = None  # --kv-events-config: the core publishes them
    port: int = 0  # the server's port ({port} of the KV-event topic)
    alive_fd: int | None = None  # the write end of the core's own liveness pipe, held until it exits
    lora_modules: Sequence[LoRARequest] = ()  # --lora-modules, base_model_name set: loaded before Ready


@dataclass(eq=False)
class ClientChannel:
    """One front end as the core sees it: its two sockets and, if it has one, its liveness pipe."""

    index: int
    inbound: zmq.Socket
    outbound: zmq.Socket
    alive_fd: int | None = None
    gone: bool = False


def engine_request_id(client: int, request_id: str) -> str:
    """The id a front end's request has in the engines (unique across front ends)."""
    return f"{client}/{request_id}"


def split_request_id(engine_id: str) -> tuple[int, str]:
    """``engine_request_id``'s inverse: (client index, the front end's own id)."""
    client, _, request_id = engine_id.partition("/")
    return int(client), request_id


class EngineCore:
    """The loop of the core process (one thread: it owns every engine)."""

    def __init__(
        self,
        engines: Mapping[str, CoreEngine],
        config: CoreConfig,
        clients: Sequence[ClientChannel],
        kv_events: KVEventPublisher | None = None,
    ):
        if not clients:
            raise ValueError("the engine core needs at least one front end")
        self.models = {name: HostedModel(name, engine, config.max_queue) for name, engine in engines.items()}
        self.config = config
        self.codec = Codec()
        self.clients = list(clients)
        # Only front ends with a liveness pipe can leave; the last one to go ends the core.
        self._watched = any(client.alive_fd is not None for client in self.clients)
        self._poller = zmq.Poller()
        for client in self.clients:
            self._poller.register(client.inbound, zmq.POLLIN)
            if client.alive_fd is not None:
                self._poller.register(client.alive_fd, zmq.POLLIN)
        self.parent = os.getppid()
        self._compiles = concurrent.futures.ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="qserve-core-grammar"
        )
        # (its compile, the message, the front end that sent it)
        self._compiling: list[tuple[concurrent.futures.Future[None], AddRequests, ClientChannel]] = []
        self._cancelled: set[tuple[str, str]] = set()  # (model, engine id) aborted while their grammar compiled
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
        return Ready(infos, self.stats(), os.getpid(), self.lora_adapters(), self.lora_info())

    # ------------------------------------------------------------------ LoRA adapters
    def lora_adapters(self) -> list[LoRASpec]:
        """Every model's adapters, in load order (``base_model_name``: the model)."""
        adapters = []
        for name, hosted in self.models.items():
            manager = hosted.engine.lora_manager
            for adapter in [] if manager is None else manager.names():
                request = manager.request_of(adapter)
                if request is not None:
                    adapters.append(LoRASpec(request.lora_name, request.lora_int_id, request.lora_path, name))
        return adapters

    def lora_info(self) -> dict[str, dict[str, Any]]:
        """``AsyncEngine.lora_info()``: per model with LoRA enabled, its slots and the adapters of
        its running and waiting requests."""
        result = {}
        for name, hosted in self.models.items():
            engine = hosted.engine
            if engine.lora_manager is None:
                continue
            running, waiting = engine.lora_stats()
            result[name] = {"max_lora": engine.config.max_loras, "running": running, "waiting": waiting}
        return result

    def _lora_control(self, message: LoRAControl, client: ClientChannel) -> None:
        """Run one load / unload / list; answer the caller; tell the others of a change (first, so
        that a front end the caller talks to next already knows)."""
        error: str | None = None
        text = ""
        changed = False
        try:
            if message.op == "load":
                changed = self._load_lora(message)
            elif message.op == "unload":
                changed = any(hosted.engine.remove_lora(message.lora_name) for hosted in self.models.values())
                if not changed:
                    error, text = "not_found", f"The lora adapter '{message.lora_name}' cannot be found."
            elif message.op != "list":
                raise ValueError(f"unknown LoRA control op {message.op!r}; use load, unload or list")
        except ValueError as err:  # an adapter that cannot be served: its files, rank, modules
            error, text = "value", str(err)
        except Exception as err:  # noqa: BLE001 - the caller waits for an answer, whatever happened
            logger.exception("engine core: LoRA %s failed", message.op)
            error, text = "internal", f"LoRA {message.op} failed in the engine core: {err}"
        adapters = self.lora_adapters()
        if changed:
            for other in self.clients:
                if other is not client:
                    self._send(other, LoRAState(adapters))
        self._send(client, LoRAState(adapters, message.control_id, error, text))

    def _load_lora(self, message: LoRAControl) -> bool:
        hosted = self.models.get(message.model)
        if hosted is None or hosted.engine.lora_manager is None:
            raise ValueError(f"lora_name: model {message.model!r} does not serve LoRA adapters (--enable-lora)")
        spec = message.lora
        if spec is None:
            raise ValueError("lora_path: a load names the adapter's directory")
        loaded = {a.name: a for a in self.lora_adapters()}
        if spec.name in loaded:
            if loaded[spec.name].path == spec.path:
                return False  # loaded already, from there: nothing changes (as Engine.add_lora)
            raise ValueError(f"lora_name: The lora adapter '{spec.name}' has already been loaded.")
        # The core numbers the adapters: front ends cannot agree on ids among themselves.
        int_id = 1 + max((a.int_id for a in loaded.values()), default=0)
        hosted.engine.add_lora(LoRARequest(spec.name, int_id, spec.path, message.model))
        return True

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
                    logger.error("the parent process (pid %d) is gone; the engine core exits", self.parent)
                    return
                if self._watched and all(client.gone for client in self.clients):
                    logger.info("every front end is gone; the engine core exits")
                    break
                busy = [m for m in self.models.values() if m.engine.has_unfinished_requests()]
                if not busy and self._was_busy:  # the numbers at the end of a busy spell, before idling
                    self._was_busy = False
                    self._broadcast(Outputs([], self.stats(), self._lora_numbers()))
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
            self._broadcast(Bye())
        finally:
            self._compiles.shutdown(wait=False, cancel_futures=True)

    def _receive(self, wait_s: float) -> None:
        """Handle every waiting message of every front end, and notice the ones that are gone
        (waiting up to ``wait_s`` for the first event)."""
        timeout = int(wait_s * 1000)
        while not self._stopping:
            events = dict(self._poller.poll(timeout))
            if not events:
                return
            timeout = 0
            for client in self.clients:
                if client.gone:
                    continue
                if client.alive_fd is not None and client.alive_fd in events and _at_eof(client.alive_fd):
                    self._drop_client(client)
                    continue
                if client.inbound in events:
                    message = self.codec.decode_frontend(client.inbound.recv(copy=False).buffer)
                    try:
                        self._handle(message, client)
                    except Exception:  # noqa: BLE001 - a bad message must not kill the core
                        logger.exception("engine core: handling %s failed", type(message).__name__)
                    if self._stopping:
                        return

    def _handle(self, message: object, client: ClientChannel | None = None) -> None:
        client = client or self.clients[0]
        if isinstance(message, AddRequests):
            self._add_or_compile(message, client)
        elif isinstance(message, Abort):
            self._abort(message, client)
        elif isinstance(message, SetTenants):
            for hosted in self.models.values():
                hosted.engine.scheduler.set_tenants(message.weights, message.max_running)
        elif isinstance(message, LoRAControl):
            self._lora_control(message, client)
        elif isinstance(message, Shutdown):
            self._stopping = True

    def _abort(self, message: Abort, client: ClientChannel) -> None:
        hosted = self.models.get(message.model)
        if hosted is None:
            return
        engine_id = engine_request_id(client.index, message.request_id)
        for _, add, sender in self._compiling:
            if sender is client and add.model == message.model:
                if any(r.request_id == message.request_id for r in add.requests):
                    self._cancelled.add((message.model, engine_id))
        if message.index is None:
            hosted.engine.abort_request(engine_id)
        else:
            hosted.engine.finish_sequence(engine_id, message.index)

    def _drop_client(self, client: ClientChannel) -> None:
        """A front end is gone (its process died or it shut down): abort its requests (their pages
        come back now), drop its pending grammar compiles, close its sockets."""
        client.gone = True
        prefix = engine_request_id(client.index, "")
        aborted = 0
        for hosted in self.models.values():
            for engine_id in [r for r in hosted.active if r.startswith(prefix)]:
                hosted.engine.abort_request(engine_id)
                hosted.active.discard(engine_id)
                aborted += 1
        self._compiling = [entry for entry in self._compiling if entry[2] is not client]
        self._poller.unregister(client.inbound)
        if client.alive_fd is not None:
            self._poller.unregister(client.alive_fd)
            os.close(client.alive_fd)
            client.alive_fd = None
        client.inbound.close(linger=0)
        client.outbound.close(linger=0)  # what was queued for it has no reader
        left = sum(not c.gone for c in self.clients)
        logger.log(
            logging.WARNING if aborted else logging.INFO,
            "front end %d is gone: %d of its request(s) aborted; %d front end(s) left",
            client.index,
            aborted,
            left,
        )

    # ------------------------------------------------------------------ adding requests
    def _add_or_compile(self, message: AddRequests, client: ClientChannel) -> None:
        hosted = self.models.get(message.model)
        if hosted is None:
            self._send(client, Added(message.submit_id, "model", message.model))
            return
        try:
            params = [request_params(r) for r in message.requests]
        except ValueError as err:
            self._send(client, Added(message.submit_id, "value", str(err)))
            return
        constraints = [p.structured_outputs for p in params if getattr(p, "structured_outputs", None) is not None]
        compiler = hosted.engine.grammar_compiler
        if constraints and compiler.tokenizer is not None:
            # Compiled on a helper thread, so the steps of running requests go on meanwhile.
            def compile_all() -> None:
                for constraint in constraints:
                    compiler.compile(constraint)

            self._compiling.append((self._compiles.submit(compile_all), message, client))
            return
        self._add(hosted, message, params, client)

    def _admit_compiled(self) -> None:
        if not self._compiling:
            return
        still = []
        for future, message, client in self._compiling:
            if not future.done():
                still.append((future, message, client))
                continue
            hosted = self.models[message.model]
            error = future.exception()
            if error is not None:
                self._send(client, Added(message.submit_id, "value", str(error)))
                continue
            self._add(hosted, message, [request_params(r) for r in message.requests], client)
            for request in message.requests:
                engine_id = engine_request_id(client.index, request.request_id)
                if (message.model, engine_id) in self._cancelled:
                    self._cancelled.discard((message.model, engine_id))
                    hosted.engine.abort_request(engine_id)
        self._compiling = still

    def _add(self, hosted: HostedModel, message: AddRequests, params: list, client: ClientChannel) -> None:
        """All or none, as ``AsyncEngine.submit``; the answer says which error, if any."""
        items = [(engine_request_id(client.index, r.request_id), r, p) for r, p in zip(message.requests, params)]
        try:
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            hosted.check_queue(sum(p.n for _, _, p in items), self.config.retry_after_s)
            loras = [None if r.lora is None else r.lora.request() for _, r, _ in items]
            for (_, request, p), lora in zip(items, loras):  # validate all before queuing any
                hosted.engine.validate_request(request.prompt_token_ids, p, lora)
                _check_registered(hosted, lora)  # an adapter unloaded meanwhile is refused
            added: list[str] = []
            try:
                for (engine_id, request, p), lora in zip(items, loras):
                    extra: dict[str, Any] = {"tenant": request.tenant} if request.tenant is not None else {}
                    if lora is not None:
                        extra["lora_request"] = lora
                    hosted.engine.add_request(engine_id, request.prompt_token_ids, p, **extra)
                    added.append(engine_id)
            except BaseException:
                for engine_id in added:
                    hosted.engine.abort_request(engine_id)
                raise
            hosted.active.update(added)
        except QueueFullError as err:
            self._send(
                client,
                Added(
                    message.submit_id,
                    "queue_full",
                    str(err),
                    err.retry_after_s,
                    err.max_queue,
                    sum(p.n for _, _, p in items),
                ),
            )
        except EngineDeadError as err:
            self._send(client, Added(message.submit_id, "dead", str(err)))
        except ValueError as err:
            self._send(client, Added(message.submit_id, "value", str(err)))
        else:
            self._send(client, Added(message.submit_id))

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
        stats = lora = None
        # With a finished request, the numbers that no longer count it travel with its last output.
        if finished or now - self._stats_sent >= STATS_INTERVAL_S:
            self._stats_sent = now
            stats = self.stats()
            lora = self._lora_numbers()
        self._send_outputs(hosted.name, outputs, step_tokens, stats, lora)

    def _lora_numbers(self) -> dict[str, dict[str, Any]] | None:
        return self.lora_info() or None  # None: no model serves adapters (nothing to send)

    def _send_outputs(
        self,
        model: str,
        outputs: Iterable[RequestDelta],
        step_tokens: list[int] | None = None,
        stats: dict[str, dict[str, int]] | None = None,
        lora: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Each front end gets its own requests' outputs (under the ids it sent) and the numbers;
        the step tokens go to one front end only (each step is counted once)."""
        by_client: dict[int, list[RequestDelta]] = {}
        for output in outputs:
            client, output.request_id = split_request_id(output.request_id)
            by_client.setdefault(client, []).append(output)
        tokens_to = next((c for c in self.clients if not c.gone), None)
        for client in self.clients:
            if client.gone:
                continue
            deltas = by_client.get(client.index, [])
            tokens = list(step_tokens or []) if client is tokens_to else []
            if deltas or tokens or stats is not None:
                self._send(client, Outputs([ModelOutputs(model, deltas, tokens)], stats, lora))

    def _fail_model(self, hosted: HostedModel, err: Exception) -> None:
        by_client: dict[int, list[str]] = {}
        for engine_id in abort_model(hosted):
            client, request_id = split_request_id(engine_id)
            by_client.setdefault(client, []).append(request_id)
        for client in self.clients:
            if not client.gone and client.index in by_client:
                message = ModelFailed(hosted.name, by_client[client.index], f"model {hosted.name!r} failed: {err}")
                self._send(client, message)

    def _abort_all(self) -> None:
        """On shutdown: abort everything, flush, and send the last outputs (every stream ends)."""
        for _, message, client in self._compiling:
            self._send(client, Added(message.submit_id, "dead", "the engine is shutting down"))
        self._compiling = []
        for hosted in self.models.values():
            outputs = abort_for_shutdown(hosted)
            if outputs:
                self._send_outputs(hosted.name, outputs)  # type: ignore[arg-type]

    def _send(self, client: ClientChannel, message: object) -> None:
        if not client.gone:
            client.outbound.send(self.codec.encode(message), copy=False)  # type: ignore[arg-type]

    def _broadcast(self, message: object) -> None:
        data = self.codec.encode(message)  # type: ignore[arg-type]
        for client in self.clients:
            if not client.gone:
                client.outbound.send(data, copy=False)


def _at_eof(fd: int) -> bool:
    """A liveness pipe is readable: EOF (nobody writes to it) unless a stray byte came."""
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# ---------------------------------------------------------------------- process entry
def main() -> int:
    # The front ends drive shutdown (SIGTERM drains there first, then they stop or leave the
    # core); a Ctrl-C in the terminal reaches this process too and must not kill it under the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config: CoreConfig = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=config.log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    # Liveness pipes stay in this process only: a helper process that kept one open would hide
    # this process's death from the front ends (or a front end's death from it).
    for fd in (config.alive_fd, *(c.alive_fd for c in config.clients)):
        if fd is not None:
            os.set_inheritable(fd, False)
    context = zmq.Context()
    clients = []
    for index, addresses in enumerate(config.clients):
        inbound = context.socket(zmq.PULL)
        inbound.setsockopt(zmq.RCVHWM, 0)
        inbound.bind(addresses.input_address)
        outbound = context.socket(zmq.PUSH)
        # Unbounded: a send never blocks the loop (a front end that is gone is dropped, and if all
        # are, or the parent is, the core exits).
        outbound.setsockopt(zmq.SNDHWM, 0)
        outbound.setsockopt(zmq.LINGER, SEND_LINGER_MS)
        outbound.connect(addresses.output_address)
        clients.append(ClientChannel(index, inbound, outbound, addresses.alive_fd))
    codec = Codec()

    def broadcast(message: object) -> None:
        data = codec.encode(message)  # type: ignore[arg-type]
        for client in clients:
            if not client.gone:
                client.outbound.send(data)

    publisher = None
    try:
        try:
            engines = build_engines(config.models, config.host, engine_cls=CoreEngine)
            for lora_request in config.lora_modules:  # --lora-modules: read and checked now
                base = lora_request.base_model_name or next(iter(engines))
                engines[base].add_lora(lora_request)
            if config.kv_events is not None:
                device = next(iter(engines.values())).device
                medium = "GPU" if device.type == "cuda" else "CPU"
                publisher = ZmqKVEventPublisher(config.kv_events, port=config.port, medium=medium)
            core = EngineCore(engines, config, clients, publisher)  # type: ignore[arg-type]
        except Exception as err:  # noqa: BLE001 - reported to the front ends, which decide
            user_error = isinstance(err, (ValueError, FileNotFoundError))
            if not user_error:
                logger.exception("loading the models failed")
            broadcast(StartupFailed(str(err), user_error))
            return 1
        freeze_startup_heap()  # the loaded engines' objects out of the collector's walks (a step stall)
        broadcast(core.ready())
        core.run()
        return 0
    finally:
        if publisher is not None:
            publisher.close()
        for client in clients:
            if not client.gone:
                client.inbound.close(linger=0)
                client.outbound.close()
        context.term()


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown (torch's took seconds): every socket is closed and
    every message sent by now; the parent or front end waits for this exit, within its deadline."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
