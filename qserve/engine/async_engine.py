"""The multi-model host: one background thread steps every hosted ``Engine``; asyncio code
submits requests and reads their outputs as streams.

Knows: which models it hosts, the thread that owns the engines (only that thread calls
``add_request`` / ``abort_request`` / ``step``; everything else reaches it through a command
queue), round-robin interleaving of steps across models with work (one step per busy model
per round, so a flooded model cannot starve a quiet one), per-model waiting-queue bounds, and
per-request timing (arrival, first token, last token) that it reports to a listener. Must
not know: HTTP, JSON, OpenAI shapes, Prometheus.

Threads: the event loop thread calls ``submit`` / ``abort`` / ``shutdown`` and iterates
``OutputStream``s; the step thread runs engines and hands outputs back with
``loop.call_soon_threadsafe``. A tokenizer is not shared between threads: the engine's
belongs to the step thread; the front end gets its own copy from ``frontend_tokenizer``.

Also here: ``build_engines``, which loads several models onto one shared KV page pool
(``qserve.memory.shared_pool``) under one memory budget, and ``build_tensor_parallel_engine``,
which loads one model sharded over N processes (``qserve.engine.tensor_parallel``). The host
learns nothing about tensor parallelism: such an engine comes with ``HostHooks`` (a keep-alive
the step thread calls while it runs, and a shutdown that stops the worker processes after it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from qserve.engine.engine import LORA_GRAPHS_ENV, Engine, EngineConfig, PromptInput, resolve_device, resolve_dtype
from qserve.lora.request import LoRARequest
from qserve.model.registry import read_model_config
from qserve.outputs import RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import SamplingParams
from qserve.scheduler.kv_events import KVEvent, KVEventRecorder
from qserve.scheduler.swap import check_tensor_parallel_preemption
from qserve.spec_decode.metrics import stats_entries

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle step thread sleeps between checks (it is woken on new work)


class QueueFullError(Exception):
    """The model's waiting queue is at ``max_queue``; retry later."""

    def __init__(self, model: str, max_queue: int, retry_after_s: int = 1, num_adding: int = 1) -> None:
        what = "a request" if num_adding == 1 else f"{num_adding} sequences (prompts x n)"
        super().__init__(
            f"model {model!r} keeps at most {max_queue} sequences waiting; {what} would pass that bound; retry later"
        )
        self.model = model
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The host is shut down (or its step thread died); no new requests are taken."""


class KVEventPublisher(Protocol):
    """Sends KV-cache events somewhere (``qserve.engine.kv_events.ZmqKVEventPublisher``). Step thread only."""

    def publish(self, events: Sequence[KVEvent], model_of_owner: Mapping[str, str]) -> None: ...

    def close(self) -> None: ...


class RequestListener(Protocol):
    """Receives per-request events (the server's metrics implement it). Called on the loop thread."""

    def on_first_token(self, model: str, seconds: float, num_prompt_tokens: int) -> None: ...

    def on_tokens(self, model: str, num_tokens: int, seconds_since_last: float | None) -> None: ...

    def on_finished(self, model: str, output: RequestOutput, seconds: float) -> None: ...


class Listeners:
    """Several ``RequestListener``s behind one (e.g. metrics and the request log)."""

    def __init__(self, *listeners: RequestListener) -> None:
        self.listeners = listeners

    def on_first_token(self, model: str, seconds: float, num_prompt_tokens: int) -> None:
        for listener in self.listeners:
            listener.on_first_token(model, seconds, num_prompt_tokens)

    def on_tokens(self, model: str, num_tokens: int, seconds_since_last: float | None) -> None:
        for listener in self.listeners:
            listener.on_tokens(model, num_tokens, seconds_since_last)

    def on_finished(self, model: str, output: RequestOutput, seconds: float) -> None:
        for listener in self.listeners:
            listener.on_finished(model, output, seconds)

    def on_step(self, model: str, num_tokens: int) -> None:
        """An engine step of ``num_tokens`` tokens (prompt and generated) completed."""
        for listener in self.listeners:
            on_step = getattr(listener, "on_step", None)  # optional in a RequestListener
            if on_step is not None:
                on_step(model, num_tokens)


@dataclass(eq=False)
class _Tracked:
    """Loop-thread state of one engine request."""

    request_id: str
    stream: OutputStream
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    max_tokens: int | None = None  # the request's (vLLM's request_params_max_tokens)
    # The submitter's context (e.g. the HTTP request id a log filter reads): listener calls
    # for this request run inside it, as if the submitting task made them.
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


def observe_output(
    listener: RequestListener | None, model: str, tracked: _Tracked, output: RequestOutput, now: float
) -> None:
    """Tell ``listener`` what ``output`` (of ``tracked``, delivered at ``now``) means: first token,
    new tokens, finish (with vLLM's timing names added to ``output.metrics``)."""
    num_tokens = sum(len(c.token_ids) for c in output.outputs)
    new_tokens = num_tokens - tracked.num_tokens
    tracked.num_tokens = num_tokens
    if new_tokens > 0:
        if tracked.first_token is None:
            tracked.first_token = now
            if listener is not None:
                listener.on_first_token(model, now - tracked.arrival, len(output.prompt_token_ids))
        if listener is not None:
            gap = None if tracked.last_token is None else now - tracked.last_token
            listener.on_tokens(model, new_tokens, gap)
        tracked.last_token = now
    if output.finished and listener is not None:
        if tracked.first_token is not None:  # vLLM's RequestOutput.metrics names
            output.metrics["first_token_latency"] = tracked.first_token - tracked.arrival
            output.metrics["first_token_time"] = tracked.first_token
            output.metrics["last_token_time"] = tracked.last_token or tracked.first_token
        if tracked.max_tokens is not None:
            output.metrics["max_tokens_param"] = tracked.max_tokens
        listener.on_finished(model, output, now - tracked.arrival)


@dataclass(frozen=True, slots=True)
class RequestItem:
    """One engine request of a submission: id, prompt (preferably token ids) and params."""

    request_id: str
    prompt: PromptInput
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request
    tenant: str | None = None  # the API key's tenant (the scheduler shares seats by tenant)
    # The LoRA adapter it runs with (None: the base model); registered with the engine (add_lora) first.
    lora_request: LoRARequest | None = None


@dataclass(eq=False)
class HostedModel:
    """One model of the host: its engine and its front-end limits."""

    name: str
    engine: Engine
    max_queue: int | None = None  # refuse new requests while this many sequences wait
    # Request fields a client did not send take these values (generation_config.json, as vLLM).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)  # unfinished request ids (step thread only)

    def queue_is_full(self, num_adding: int = 1) -> bool:
        """Would queuing ``num_adding`` more sequences pass ``max_queue``? (A submission counts
        every sequence it adds, prompts x n, and is refused whole.)"""
        return self.max_queue is not None and self.num_waiting + num_adding > self.max_queue

    def check_queue(self, num_adding: int, retry_after_s: int) -> None:
        """ValueError if ``num_adding`` could never be queued; QueueFullError if not now."""
        if self.max_queue is None:
            return
        if num_adding > self.max_queue > 0:
            raise ValueError(
                f"n: this request adds {num_adding} sequences (prompts x n), more than model "
                f"{self.name!r} ever queues ({self.max_queue})"
            )
        if self.queue_is_full(num_adding):
            raise QueueFullError(self.name, self.max_queue, retry_after_s, num_adding)

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running


class KVEventFeed:
    """The hosted models' KV-cache events: one recorder per distinct page pool, drained after
    every step and published (best effort: a router's index must not stop serving). Step thread only."""

    def __init__(self, models: Mapping[str, HostedModel], publisher: KVEventPublisher) -> None:
        self.publisher = publisher
        self._recorders: list[KVEventRecorder] = []
        self._model_of_owner = {hosted.engine.owner: name for name, hosted in models.items()}
        for hosted in models.values():
            pool = hosted.engine.block_pool
            if pool.kv_events is None:
                pool.kv_events = KVEventRecorder()
                self._recorders.append(pool.kv_events)

    def publish_pending(self) -> None:
        for recorder in self._recorders:
            events = recorder.take()
            if events:
                try:
                    self.publisher.publish(events, self._model_of_owner)
                except Exception:  # noqa: BLE001 - a router's index is best effort; keep serving
                    logger.exception("publishing %d KV events failed", len(events))


def abort_model(hosted: HostedModel) -> list[str]:
    """A model whose step failed: abort its active requests and flush the aborts (their pages come
    back); returns their ids, for the error each of them gets."""
    request_ids = list(hosted.active)
    hosted.active.clear()
    for request_id in request_ids:
        hosted.engine.abort_request(request_id)
    try:
        hosted.engine.step()  # flushes the aborts, freeing pages
    except Exception:  # noqa: BLE001
        logger.exception("could not flush aborts of model %s", hosted.name)
    return request_ids


def abort_for_shutdown(hosted: HostedModel) -> list[RequestOutput]:
    """On shutdown: abort a model's active requests and flush the aborts; returns the flushed
    outputs (each stream's last, finished with 'abort'), none if the flush failed."""
    for request_id in hosted.active:
        hosted.engine.abort_request(request_id)
    hosted.active.clear()
    try:
        return hosted.engine.step() if hosted.engine.has_unfinished_requests() else []
    except Exception:  # noqa: BLE001
        logger.exception("flushing aborts of model %s failed", hosted.name)
        return []


class OutputStream:
    """The outputs of one submission (one or more engine requests), in arrival order.

    ``async for request_id, output in stream`` yields cumulative ``RequestOutput``s and ends
    once every request of the submission has finished. ``abort()`` stops the unfinished ones.
    """

    def __init__(self, host: AsyncEngine, model: str, request_ids: Sequence[str]) -> None:
        self._host = host
        self.model = model
        self.request_ids = list(request_ids)
        self._queue: asyncio.Queue[tuple[str, RequestOutput] | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)

    def _put(self, item: tuple[str, RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> tuple[str, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        request_id, output = item
        if output.finished:
            self._unfinished.discard(request_id)
        return request_id, output

    def abort(self) -> None:
        """Abort every unfinished request of this stream (idempotent)."""
        for request_id in list(self._unfinished):
            self._host.abort(self.model, request_id)
        self._unfinished.clear()


class AsyncEngine:
    """Hosts several engines; steps them in one background thread."""

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_queue: int | Mapping[str, int | None] | None = None,
        listener: RequestListener | None = None,
        retry_after_s: int = 1,
        hooks: HostHooks | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        if not engines:
            raise ValueError("AsyncEngine needs at least one model")
        self.models: dict[str, HostedModel] = {}
        for name, engine in engines.items():
            limit = max_queue.get(name) if isinstance(max_queue, Mapping) else max_queue
            if limit is not None and limit < 0:
                raise ValueError(f"max_queue must be >= 0, got {limit}")
            self.models[name] = HostedModel(name, engine, limit)
        self.listener = listener
        self.retry_after_s = retry_after_s
        self.hooks = hooks or HostHooks()
        self._hooks_closed = False
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracked: dict[tuple[str, str], _Tracked] = {}  # loop thread only
        self.num_steps = 0
        # KV-cache events (prefix-aware routing): one recorder per distinct page pool, drained
        # and published by the step thread after every step.
        self.kv_events = kv_events
        self._kv_feed = KVEventFeed(self.models, kv_events) if kv_events is not None else None

    # ------------------------------------------------------------------ lifecycle
    @property
    def model_names(self) -> list[str]:
        return list(self.models)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the step thread; outputs are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="qserve-step", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step thread; outstanding requests are aborted (their streams end with 'abort').
        Then run ``hooks.shutdown`` once (e.g. stop tensor-parallel workers). Idempotent."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the step thread did not stop within %.0f s", timeout)
        if self._hooks_closed:
            return
        self._hooks_closed = True
        if self.kv_events is not None:
            self.kv_events.close()
        if self.hooks.shutdown is not None:
            # After the step thread: workers must not be stopped under a step that still needs them.
            self.hooks.shutdown()

    # ------------------------------------------------------------------ requests (loop thread)
    def get_model(self, name: str) -> HostedModel:
        """KeyError naming the model if it is not hosted."""
        if name not in self.models:
            raise KeyError(name)
        return self.models[name]

    def check_queue(self, model: str, num_adding: int = 1) -> None:
        """Raise QueueFullError now if ``num_adding`` more sequences would pass ``model``'s queue
        bound (a cheap early check; ``submit`` checks again, exactly, on the step thread)."""
        self.get_model(model).check_queue(num_adding, self.retry_after_s)

    async def submit(self, model: str, items: Sequence[RequestItem]) -> OutputStream:
        """Queue the requests of one submission (all or none) and return their stream.

        Raises KeyError (unknown model), QueueFullError, ValueError (bad request, message from
        the engine) or EngineDeadError. Nothing is queued when it raises.
        """
        hosted = self.get_model(model)
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream = OutputStream(self, model, [item.request_id for item in items])
        now = time.monotonic()
        for item in items:
            self._tracked[(model, item.request_id)] = _Tracked(
                item.request_id, stream, now, max_tokens=item.params.max_tokens
            )
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def add() -> None:  # step thread
            if not done.set_running_or_notify_cancel():
                return  # the submitter gave up (client gone) before we got here
            try:
                if self._stopping.is_set():
                    raise EngineDeadError("the engine is shutting down")
                hosted.check_queue(sum(item.params.n for item in items), self.retry_after_s)
                for item in items:  # validate all before queuing any
                    hosted.engine.validate_request(item.prompt, item.params, item.lora_request)
                    _check_registered(hosted, item.lora_request)
                added: list[str] = []
                try:
                    for item in items:
                        extra = {"tenant": item.tenant} if item.tenant is not None else {}
                        if item.lora_request is not None:
                            extra["lora_request"] = item.lora_request
                        hosted.engine.add_request(item.request_id, item.prompt, item.params, **extra)
                        added.append(item.request_id)
                except BaseException:
                    for request_id in added:  # all or nothing: nobody would read the others
                        hosted.engine.abort_request(request_id)  # pages back at once
                    raise
                hosted.active.update(added)
            except BaseException as err:  # noqa: BLE001 - handed to the submitter
                done.set_exception(err)
            else:
                done.set_result(None)

        self._commands.put(add)
        self._wake.set()
        try:
            await asyncio.wrap_future(done, loop=loop)
        except BaseException as err:
            for item in items:
                self._tracked.pop((model, item.request_id), None)
                if isinstance(err, asyncio.CancelledError):  # the add may still land: undo it
                    self.abort(model, item.request_id)
            raise
        return stream

    async def _on_step_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the step thread (between steps) and return its result or raise its error."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                done.set_exception(err)

        self._commands.put(command)
        self._wake.set()
        return await asyncio.wrap_future(done)

    async def add_lora(self, model: str, lora_request: LoRARequest) -> int:
        """Register a LoRA adapter with ``model``'s engine (read and checked on the step thread, between
        steps: running requests go on); ValueError naming the field if it cannot be served."""
        hosted = self.get_model(model)
        return await self._on_step_thread(lambda: hosted.engine.add_lora(lora_request))

    async def remove_lora(self, model: str, lora_name: str) -> bool:
        """Unregister an adapter of ``model`` (False if unknown); its running requests finish with it."""
        hosted = self.get_model(model)
        return await self._on_step_thread(lambda: hosted.engine.remove_lora(lora_name))

    def lora_info(self) -> dict[str, dict[str, Any]]:
        """Per model with LoRA enabled: ``max_lora`` and the adapters of its running and waiting
        requests (read from the step thread's state; approximate, as ``stats``)."""
        result = {}
        for name, hosted in self.models.items():
            engine = hosted.engine
            if getattr(engine, "lora_manager", None) is None:
                continue
            running, waiting = engine.lora_stats()
            result[name] = {"max_lora": engine.config.max_loras, "running": running, "waiting": waiting}
        return result

    def abort(self, model: str, request_id: str) -> None:
        """Abort a request; its pages are freed before the next step. Safe to call twice."""
        hosted = self.models.get(model)
        if hosted is None:
            return
        self._commands.put(lambda: hosted.engine.abort_request(request_id))
        self._wake.set()

    # ------------------------------------------------------------------ step thread
    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # noqa: BLE001 - a bad command must not kill the loop
                logger.exception("engine command failed")

    def _run(self) -> None:
        rotation = 0
        try:
            while not self._stopping.is_set():
                self._drain_commands()
                self._tick()
                busy = [m for m in self.models.values() if m.engine.has_unfinished_requests()]
                if not busy:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                start = rotation % len(busy)
                rotation += 1
                for hosted in busy[start:] + busy[:start]:
                    self._step(hosted)
                    self._drain_commands()  # aborts land between models' steps, within one step
        finally:
            self._abort_all()
            self._drain_commands()  # submissions that raced with shutdown fail with EngineDeadError

    def _tick(self) -> None:
        tick = self.hooks.tick
        if tick is None:
            return
        try:
            tick()
        except Exception:  # noqa: BLE001 - a failed keep-alive shows up in the next step; keep serving
            logger.exception("host tick failed")

    def _step(self, hosted: HostedModel) -> None:
        try:
            outputs = hosted.engine.step()
        except Exception as err:  # noqa: BLE001 - fail this model's requests, keep serving others
            logger.exception("step of model %s failed; aborting its requests", hosted.name)
            self._fail_model(hosted, err)
            return
        self.num_steps += 1
        step_tokens = getattr(hosted.engine, "take_step_tokens", None)
        if step_tokens is not None and self.listener is not None and hasattr(self.listener, "on_step"):
            for num_tokens in step_tokens():
                self._call_in_loop(self.listener.on_step, hosted.name, num_tokens)
        if self._kv_feed is not None:
            self._kv_feed.publish_pending()
        for output in outputs:
            if output.finished:
                hosted.active.discard(output.request_id)
        if outputs:
            self._publish(hosted.name, outputs)

    def _fail_model(self, hosted: HostedModel, err: Exception) -> None:
        request_ids = abort_model(hosted)
        error = RuntimeError(f"model {hosted.name!r} failed: {err}")
        self._call_in_loop(self._deliver_error, hosted.name, request_ids, error)

    def _abort_all(self) -> None:
        """On shutdown: abort everything, flush, and end every stream."""
        self._drain_commands()
        for hosted in self.models.values():
            outputs = abort_for_shutdown(hosted)
            if outputs:
                self._publish(hosted.name, outputs)

    def _publish(self, model: str, outputs: list[RequestOutput]) -> None:
        self._call_in_loop(self._deliver, model, outputs, time.monotonic())

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed meanwhile
            pass

    # ------------------------------------------------------------------ loop thread: delivery
    def _deliver(self, model: str, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            tracked = self._tracked.get((model, output.request_id))
            if tracked is None:
                continue
            tracked.context.run(self._observe, model, tracked, output, now)
            if output.finished:
                del self._tracked[(model, output.request_id)]
            tracked.stream._put((output.request_id, output))  # noqa: SLF001

    def _deliver_error(self, model: str, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            tracked = self._tracked.pop((model, request_id), None)
            if tracked is not None:
                tracked.stream._put(error)  # noqa: SLF001

    def _observe(self, model: str, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        observe_output(self.listener, model, tracked, output, now)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, dict[str, int]]:
        """Per-model queue and pool numbers (read from the step thread's state; approximate)."""
        result = {}
        for name, hosted in self.models.items():
            pool = hosted.engine.block_pool
            kv = hosted.engine.kv_manager
            result[name] = {
                "num_running": hosted.num_running,
                "num_waiting": hosted.num_waiting,
                "pool_pages_used": pool.num_used_by(hosted.engine.owner),
                "pool_pages_total": pool.num_blocks,
                "pool_pages_free": pool.num_free_blocks,
                "prefix_cache_queries": kv.num_prefix_queries,
                "prefix_cache_hits": kv.num_prefix_hits,
                "num_preemptions": hosted.engine.num_preemptions,
                # swap preemption (qserve.server.swap_metrics): requests on the host now, and totals
                "num_swapped": hosted.engine.scheduler.num_swapped,
                "num_swapped_out": hosted.engine.scheduler.num_swapped_out,
                "num_swapped_in": hosted.engine.scheduler.num_swapped_in,
                **stats_entries(hosted.engine.spec_stats),  # speculative decoding (qserve.server.spec_metrics)
            }
        return result

    def cache_info(self) -> dict[str, dict[str, Any]]:
        """Per-model KV-cache settings (vLLM's ``cache_config_info`` labels)."""
        return {
            name: {
                "block_size": hosted.engine.config.block_size,
                "num_gpu_blocks": hosted.engine.block_pool.num_blocks,
                "cache_dtype": hosted.engine.config.kv_cache_dtype,
                "enable_prefix_caching": hosted.engine.config.enable_prefix_caching,
                "max_model_len": hosted.engine.max_model_len,
            }
            for name, hosted in self.models.items()
        }


def _check_registered(hosted: HostedModel, lora_request: LoRARequest | None) -> None:
    """A submission never loads an adapter (the engine would for an unknown name): one unloaded between
    the front end's lookup and this step-thread check is refused, not brought back."""
    manager = getattr(hosted.engine, "lora_manager", None)
    if lora_request is not None and manager is not None and manager.lookup(lora_request.lora_name) is None:
        raise ValueError(f"model: the LoRA adapter {lora_request.lora_name!r} is not loaded (it was unloaded)")


# ---------------------------------------------------------------------- building engines
@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model to serve: its public name and checkpoint path, and its pool shares."""

    name: str
    path: str
    min_share: float | None = None
    max_share: float | None = None


@dataclass(frozen=True, slots=True)
class HostConfig:
    """Settings every hosted model shares."""

    device: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_cache_dtype: str = "auto"
    gpu_memory_budget: str | None = None  # bytes with a unit or a fraction; None: the planner's default
    num_kv_blocks: int | None = None  # pages of the shared pool, overriding the budget
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = True  # schedule step N+1 while step N runs (EngineConfig.async_scheduling)
    # Swap preemption (EngineConfig.preemption_mode); swap_space is GiB of host memory for the
    # whole process, split evenly between the hosted models.
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    # LoRA adapters (EngineConfig's fields, vLLM's names), for every hosted model.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding for every hosted model (EngineConfig.speculative_config); None: off.
    speculative_config: Any = None
    enable_expert_parallel: bool = False  # a tensor-parallel MoE model: whole experts per rank


SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "int8", "int4")


@dataclass(frozen=True, slots=True)
class HostHooks:
    """Duties of an ``AsyncEngine`` towards engines that hold resources outside this process
    (a tensor-parallel engine's worker processes). Both are optional."""

    tick: Callable[[], None] | None = None  # step thread, once per loop round (>= every IDLE_WAIT_S)
    shutdown: Callable[[], None] | None = None  # once, after the step thread has stopped


def _check_kv_cache_dtype(config: HostConfig) -> None:
    if config.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )


def build_engines(
    models: Sequence[ModelSpec], config: HostConfig, *, engine_cls: type[Engine] = Engine
) -> dict[str, Engine]:
    """Load every model onto ONE shared KV page pool sized by one budget (``engine_cls``: the
    engine-core process builds its ``CoreEngine``s here).

    Pages: ``--num-kv-blocks`` if given; else the budget (bytes, or a fraction of the device)
    minus the weights of all models (from metadata) and the activation / overhead estimates,
    divided by the page size; with no budget, the planner's default (1 GiB on CPU, 90% of
    free memory on GPU).
    """
    from qserve.config import ModelConfig
    from qserve.memory.profiler import kv_cache_torch_dtype
    from qserve.memory.shared_pool import ModelKVSpec, SharedKVPool, num_pages_for

    _check_kv_cache_dtype(config)
    if not models:
        raise ValueError("no model given")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names} (use name=path)")
    device = resolve_device(config.device)
    specs: list[ModelKVSpec] = []
    model_configs: dict[str, ModelConfig] = {}
    for m in models:
        model_config = read_model_config(m.path)
        model_configs[m.name] = model_config
        dtype = kv_cache_torch_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype, model_config.dtype, device))
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        specs.append(ModelKVSpec(m.name, model_config, dtype, config.block_size, max_model_len, config.max_num_seqs))
    if config.num_kv_blocks is not None:
        num_pages = config.num_kv_blocks
    else:
        num_pages = num_pages_for(specs, _kv_budget_bytes(models, specs, config, device))
    pool = SharedKVPool(
        specs,
        num_pages,
        device,
        min_shares={m.name: m.min_share for m in models if m.min_share is not None},
        max_shares={m.name: m.max_share for m in models if m.max_share is not None},
    )
    logger.info(
        "shared KV pool: %d pages of %d bytes (%.1f MiB) for %s",
        num_pages,
        pool.page_bytes,
        pool.num_bytes / 2**20,
        ", ".join(names),
    )
    engines: dict[str, Engine] = {}
    for m in models:
        engine_config = EngineConfig(
            model=m.path,
            device=str(device),
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            seed=config.seed,
            kv_cache_dtype=config.kv_cache_dtype,
            enforce_eager=config.enforce_eager,
            async_scheduling=config.async_scheduling,
            preemption_mode=config.preemption_mode,
            swap_space=config.swap_space / len(models),
            enable_lora=config.enable_lora,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            speculative_config=config.speculative_config,
        )
        engines[m.name] = engine_cls(
            engine_config, block_pool=pool.block_pool, owner=m.name, kv_caches=pool.kv_caches(m.name)
        )
    return engines


def build_tensor_parallel_engine(
    model: ModelSpec, config: HostConfig, tensor_parallel_size: int
) -> tuple[dict[str, Engine], HostHooks]:
    """Load ONE model sharded over ``tensor_parallel_size`` processes (this one is rank 0 and
    drives; ``launch_engine`` spawns the others) and return ``({name: rank 0's engine}, hooks)``.

    Pass the hooks to ``AsyncEngine``: ``shutdown`` stops the worker processes, ``tick`` keeps
    them alive while the server is idle. The engine has its own page pool on every rank (a
    tensor-parallel engine cannot draw from a shared pool), so pool shares do not apply;
    ``gpu_memory_budget`` / ``num_kv_blocks`` are per device, as for ``LLM(...,
    tensor_parallel_size=N)``. Errors of ``launch_engine`` (sizes, device count) pass unchanged.
    """
    from qserve.engine.tensor_parallel import launch_engine

    _check_kv_cache_dtype(config)
    check_tensor_parallel_preemption(config.preemption_mode, tensor_parallel_size, "--preemption-mode")
    if model.min_share is not None or model.max_share is not None:
        raise ValueError(f"model {model.name!r}: pool shares need a shared pool; a tensor-parallel model has its own")
    engine_config = EngineConfig(
        model=model.path,
        device=config.device,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        gpu_memory_budget=config.gpu_memory_budget,
        kv_cache_dtype=config.kv_cache_dtype,
        enforce_eager=config.enforce_eager,
        enable_expert_parallel=config.enable_expert_parallel,
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
    )
    handle = launch_engine(engine_config, tensor_parallel_size)
    engine = handle.engine
    return {model.name: engine}, HostHooks(tick=engine.runner.keepalive, shutdown=handle.shutdown)


def _kv_budget_bytes(models: Sequence[ModelSpec], specs: Sequence[Any], config: HostConfig, device: Any) -> int:
    """Bytes the shared KV pool may take."""
    import os

    import torch

    import loaders
    from qserve.memory.planner import (
        CPU_KV_BUDGET_BYTES,
        GPU_DEFAULT_FRACTION,
        activation_bytes_estimate,
        cuda_graph_bytes_estimate,
        decode_graph_pool_bytes,
        lora_slot_bytes,
        parse_memory_budget,
        piecewise_graph_bytes_estimate,
        weight_bytes,
    )
    from qserve.runner.piecewise_graphs import piecewise_enabled

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if config.gpu_memory_budget is None:
        if device.type != "cuda":
            return CPU_KV_BUDGET_BYTES
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_DEFAULT_FRACTION)
    else:
        budget = parse_memory_budget(config.gpu_memory_budget, total)
        if device.type != "cuda":
            return budget  # on CPU the budget caps the KV pool itself
    act_dtypes = [resolve_dtype(config.dtype, s.config.dtype, device) for s in specs]  # specs hold KV dtypes
    weights = sum(weight_bytes(s.config, loaders.detect(m.path), d) for m, s, d in zip(models, specs, act_dtypes))
    tokens = config.max_num_batched_tokens or 2048
    activations = max(
        activation_bytes_estimate(s.config, tokens, config.max_num_seqs, d) for s, d in zip(specs, act_dtypes)
    )
    overhead = 64 << 20
    # LoRA decodes under graphs unless they are turned off (qserve.engine.engine.LORA_GRAPHS_ENV)
    graphs = not config.enforce_eager and (not config.enable_lora or os.environ.get(LORA_GRAPHS_ENV, "1") != "0")
    if graphs:  # decode CUDA graphs: their pool and logits buffer, per model
        overhead = sum(cuda_graph_bytes_estimate(s.config, config.max_num_seqs, d) for s, d in zip(specs, act_dtypes))
    if not config.enforce_eager and piecewise_enabled(device):  # each model's piecewise graphs (engine.py)
        overhead += sum(
            piecewise_graph_bytes_estimate(
                s.config, tokens, d, decode_graph_pool_bytes(s.config, config.max_num_seqs, d) if graphs else 0
            )
            for s, d in zip(specs, act_dtypes)
        )
    if config.enable_lora:  # every model's adapter slots
        overhead += sum(
            lora_slot_bytes(s.config, config.max_loras, config.max_lora_rank, d) for s, d in zip(specs, act_dtypes)
        )
    kv_bytes = budget - weights - activations - overhead
    if kv_bytes <= 0:
        raise ValueError(
            f"--gpu-memory-budget {config.gpu_memory_budget or budget} leaves no room for KV pages after "
            f"weights ({weights / 2**30:.2f} GiB) and activations ({activations / 2**30:.2f} GiB)"
        )
    return kv_bytes
