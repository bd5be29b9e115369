"""The front end's handle on the engine-core process, shaped like ``AsyncEngine`` so the server's
code is the same for both (``models``, ``submit``, ``abort``, ``check_queue``, ``stats``,
``cache_info``, ``start``, ``shutdown``, ``is_running``, ``listener``; with ``--enable-lora``,
``add_lora``, ``remove_lora``, ``lora_info`` and ``lora_adapters``).

Knows: how the core process is started (``qserve.engine.core.process``; two ZMQ sockets over
``ipc://``: this side binds the one it reads, the core the one it reads) and stopped
(``Shutdown``, then SIGKILL past the timeout); how one of several front ends attaches to a core
that ``qserve serve`` started (``connect``: it never stops that core; its ``shutdown`` leaves it,
ending its own streams with 'abort' and closing its liveness pipe, so the core aborts its
requests; the core's own liveness pipe reaching EOF says the core is gone); the threads: a
receiver thread reads and decodes the core's messages and hands each to the event loop, in
order, through one inbox task, where the ``OutputProcessor`` of each model turns token ids into
``RequestOutput``s for the streams (the same ``OutputStream`` and listener calls as
``AsyncEngine``) ``output_chunk_size`` at a time, yielding to the loop between chunks (vLLM's
output handler does the same: a step of 300 streams must not hold ``/health`` and the other
requests' handlers until all 300 are turned into text); what the front end keeps of each
model (its own tokenizer, a grammar compiler for the compile gate, the core's last live numbers);
and faults: a core that exits on its own
fails every pending submission and stream with ``EngineDeadError``, turns ``is_running`` off (so
``/health`` answers 503) and calls ``on_dead`` (``qserve serve`` then exits non-zero). Must not
know: HTTP, OpenAI shapes, Prometheus, how engines step.

LoRA adapters live in the core: this side keeps the core's last adapter list (from ``Ready``, the
answer to each of its ``LoRAControl``s, and the news of other front ends' changes), bumps
``lora_version`` whenever it changes (the server rebuilds its model list then), and sends each
request's adapter with it as plain data.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import itertools
import logging
import os
import select
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from qserve.engine.async_engine import (
    EngineDeadError,
    HostConfig,
    HostedModel,
    ModelSpec,
    OutputStream,
    QueueFullError,
    RequestItem,
    RequestListener,
    _Tracked,
    observe_output,
)
from qserve.engine.core.core import ClientAddresses, CoreConfig
from qserve.engine.core.messages import (
    Abort,
    Added,
    AddRequests,
    Bye,
    Codec,
    CoreRequest,
    LoRAControl,
    LoRASpec,
    LoRAState,
    ModelFailed,
    ModelInfo,
    Outputs,
    Ready,
    SetTenants,
    Shutdown,
    StartupFailed,
    params_fields,
)
from qserve.engine.core.output_processor import OutputProcessor
from qserve.engine.core.process import start_core_process
from qserve.engine.kv_events import KVEventsConfig
from qserve.lora.request import LoRARequest
from qserve.outputs import RequestOutput
from qserve.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

POLL_MS = 100  # the receiver thread looks at the core process at least this often
# Outputs turned into text between two yields to the event loop (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE)
OUTPUT_CHUNK_SIZE = 128
STARTUP_POLL_MS = 500


class _SchedulerView:
    """What the server reads of a model's scheduler: queue sizes (the core's last numbers) and
    ``set_tenants`` (sent to the core)."""

    def __init__(self, client: EngineCoreClient, name: str) -> None:
        self._client = client
        self._name = name

    @property
    def num_waiting(self) -> int:
        return self._client._stats.get(self._name, {}).get("num_waiting", 0)  # noqa: SLF001

    @property
    def num_running(self) -> int:
        return self._client._stats.get(self._name, {}).get("num_running", 0)  # noqa: SLF001

    def set_tenants(self, weights: dict[str, float], max_running: dict[str, int | None] | None = None) -> None:
        self._client.set_tenants(weights, max_running or {})


@dataclass(frozen=True, slots=True)
class _ConfigView:
    model: str
    block_size: int
    kv_cache_dtype: str
    enable_prefix_caching: bool


class ModelView:
    """What the server reads of ``HostedModel.engine`` (``OpenAIServing``, embeddings, ``qserve
    serve``): the checkpoint's config and the front end's own tokenizer and grammar compiler."""

    def __init__(self, client: EngineCoreClient, info: ModelInfo) -> None:
        from qserve.model.registry import read_model_config
        from qserve.structured.grammar import GrammarCompiler
        from qserve.tokenization import load_tokenizer

        cache = info.cache_info
        self.config = _ConfigView(info.path, cache["block_size"], cache["cache_dtype"], cache["enable_prefix_caching"])
        self.owner = info.name
        self.max_model_len = info.max_model_len
        self.model_config = read_model_config(info.path)
        self.tokenizer = load_tokenizer(info.path)
        self.eos_token_ids = set(info.eos_token_ids)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, info.vocab_size, self.eos_token_ids)
        self.grammar_compiler.prepare()
        self.scheduler = _SchedulerView(client, info.name)
        # None: the model serves no adapters (no --enable-lora), as Engine.lora_manager
        self.lora_manager = LoRAView(client, info.name) if info.name in client._lora_info else None  # noqa: SLF001


class LoRAView:
    """What the server reads of a model's ``lora_manager``: the core's adapters of that model (the
    client's copy of the core's list)."""

    def __init__(self, client: EngineCoreClient, name: str) -> None:
        self._client = client
        self._name = name

    def _mine(self) -> dict[str, LoRARequest]:
        return {n: r for n, r in self._client._loras.items() if r.base_model_name == self._name}  # noqa: SLF001

    def names(self) -> list[str]:
        return list(self._mine())

    def request_of(self, name: str) -> LoRARequest | None:
        return self._mine().get(name)

    def lookup(self, name: str) -> int | None:
        request = self._mine().get(name)
        return None if request is None else request.lora_int_id


class _CoreWatch:
    """Is the core process still there? Its ``Popen`` (the core is this process's child) or the
    read end of the core's liveness pipe (the core is a sibling: the pipe reaches EOF when it exits)."""

    def __init__(self, process: subprocess.Popen[bytes] | None = None, alive_fd: int | None = None) -> None:
        if (process is None) == (alive_fd is None):
            raise ValueError("watch the core through its process or its liveness pipe, one of them")
        self.process = process
        self.fd = alive_fd

    def gone(self) -> bool:
        if self.process is not None:
            return self.process.poll() is not None
        try:
            readable, _, _ = select.select([self.fd], [], [], 0)
            return bool(readable) and os.read(self.fd, 1) == b""  # type: ignore[arg-type]
        except OSError:  # closed by shutdown meanwhile
            return True

    def describe(self, pid: int) -> str:
        if self.process is not None:
            return f"exit code {self.process.returncode}"
        return f"pid {pid}"

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class EngineCoreClient:
    """Hosts the models of an engine-core process (see the module doc). Build it with ``launch``
    (this front end starts and owns the core) or ``connect`` (one of several front ends)."""

    def __init__(
        self,
        process: subprocess.Popen[bytes] | None,
        context: zmq.Context,
        sender: zmq.Socket,
        receiver: zmq.Socket,
        ready: Ready,
        socket_dir: str | None,
        *,
        retry_after_s: int = 1,
        core_alive_fd: int | None = None,
        alive_fd: int | None = None,
    ) -> None:
        self.process = process
        self.core_pid = ready.pid
        self._watch = _CoreWatch(process, core_alive_fd)
        self._alive_fd = alive_fd  # the write end of this front end's liveness pipe (attached mode)
        self._context = context
        self._sender = sender
        self._receiver = receiver
        self._socket_dir = socket_dir
        self._codec = Codec()
        self.retry_after_s = retry_after_s
        self.listener: RequestListener | None = None
        self.on_dead: list[Callable[[str], None]] = []  # called on the loop thread when the core dies
        self.dead_reason: str | None = None
        self.num_steps = 0
        self._stats: dict[str, dict[str, int]] = dict(ready.stats)
        self._cache_info = {info.name: dict(info.cache_info) for info in ready.models}
        self._lora_info: dict[str, dict[str, Any]] = dict(ready.lora_info)
        self._loras: dict[str, LoRARequest] = {}  # the core's adapters by name (base_model_name set)
        self.lora_version = 0  # bumped whenever _loras changes
        self._set_loras(ready.loras)
        self._controls = itertools.count()
        self._control_pending: dict[int, asyncio.Future[LoRAState]] = {}  # loop thread only
        self.models: dict[str, HostedModel] = {}
        self._processors: dict[str, OutputProcessor] = {}
        for info in ready.models:
            view = ModelView(self, info)
            self.models[info.name] = HostedModel(info.name, view, info.max_queue)  # type: ignore[arg-type]
            self._processors[info.name] = OutputProcessor(
                copy.deepcopy(view.tokenizer), info.eos_token_ids, info.max_model_len
            )
        self._send_lock = threading.Lock()
        self._submit_ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future[Added], str]] = {}  # loop thread only
        self._tracked: dict[tuple[str, str], _Tracked] = {}  # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._shut = False
        # the receiver's calls, in arrival order, run by one task at a time (loop thread only)
        self._inbox: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._inbox_task: asyncio.Task[None] | None = None
        self.output_chunk_size = OUTPUT_CHUNK_SIZE

    # ------------------------------------------------------------------ start-up
    @classmethod
    def launch(
        cls,
        models: Sequence[ModelSpec],
        config: HostConfig,
        *,
        max_queue: int | None = None,
        retry_after_s: int = 1,
        kv_events: KVEventsConfig | None = None,
        port: int = 0,
        lora_modules: Sequence[LoRARequest] = (),
    ) -> EngineCoreClient:
        """Start the core process, wait until it has loaded every model, and return its client.
        A load error is raised here (ValueError for bad input, with the core's message).
        ``kv_events``: the core publishes KV-cache events (``port``: the topic's ``{port}``);
        ``lora_modules``: adapters the core loads before it is ready (``--lora-modules``)."""
        socket_dir = tempfile.mkdtemp(prefix="qserve-core-")
        addresses = ClientAddresses(f"ipc://{socket_dir}/input", f"ipc://{socket_dir}/output")
        context, sender, receiver = _open_sockets(addresses)
        core_config = CoreConfig(
            models=list(models),
            host=config,
            clients=[addresses],
            max_queue=max_queue,
            retry_after_s=retry_after_s,
            log_level=logging.getLogger().getEffectiveLevel(),
            kv_events=kv_events,
            port=port,
            lora_modules=list(lora_modules),
        )
        process = None
        try:
            process = start_core_process(core_config)
            ready = cls._wait_ready(_CoreWatch(process), receiver)
            return cls(process, context, sender, receiver, ready, socket_dir, retry_after_s=retry_after_s)
        except BaseException:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
            sender.close()
            receiver.close()
            context.term()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise

    @classmethod
    def connect(
        cls, addresses: ClientAddresses, *, core_alive_fd: int, alive_fd: int, retry_after_s: int = 1
    ) -> EngineCoreClient:
        """Attach to a core that ``qserve serve`` started for several front ends: wait until it has
        loaded every model and return this front end's client. ``addresses``: this front end's
        sockets; ``core_alive_fd``: the read end of the core's liveness pipe; ``alive_fd``: the
        write end of this front end's own (closing it, or exiting, tells the core it is gone).
        A load error is raised here, as by ``launch``."""
        context, sender, receiver = _open_sockets(addresses)
        try:
            ready = cls._wait_ready(_CoreWatch(alive_fd=core_alive_fd), receiver)
            return cls(
                None, context, sender, receiver, ready, None, retry_after_s=retry_after_s,
                core_alive_fd=core_alive_fd, alive_fd=alive_fd,
            )  # fmt: skip
        except BaseException:
            sender.close()
            receiver.close()
            context.term()
            raise

    @staticmethod
    def _wait_ready(watch: _CoreWatch, receiver: zmq.Socket) -> Ready:
        codec = Codec()
        while True:
            if receiver.poll(STARTUP_POLL_MS):
                message = codec.decode_core(receiver.recv())
                if isinstance(message, Ready):
                    logger.info(
                        "engine core ready (pid %d): %s", message.pid, ", ".join(m.name for m in message.models)
                    )
                    return message
                if isinstance(message, StartupFailed):
                    if message.user_error:
                        raise ValueError(message.message)
                    raise RuntimeError(f"the engine core could not load the models: {message.message}")
                continue
            if watch.gone():
                if receiver.poll(STARTUP_POLL_MS):
                    continue  # its last word (StartupFailed) may still be on the way
                how = f" (exit code {watch.process.returncode})" if watch.process is not None else ""
                raise RuntimeError(f"the engine core process exited during start-up{how}")

    # ------------------------------------------------------------------ lifecycle (AsyncEngine's)
    @property
    def model_names(self) -> list[str]:
        return list(self.models)

    @property
    def is_running(self) -> bool:
        return (
            self._thread is not None and self.dead_reason is None and not self._stopping.is_set()
            and not self._watch.gone()
        )  # fmt: skip

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the receiver thread; outputs are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._receive_loop, name="qserve-core-receiver", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core: it aborts what runs (those streams end with 'abort') and exits; killed
        if it has not within ``timeout``. Attached (``connect``): leave the core, which serves the
        other front ends on; this front end's streams end with 'abort' here and the core aborts
        their requests. Idempotent; any thread."""
        with self._send_lock:
            if self._shut:
                return
            self._shut = True
        self._stopping.set()
        if self.process is None:
            self._leave()
            return
        if self.process.poll() is None:
            self._send(Shutdown())
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.wait()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._call_in_loop(self._end_all)  # streams the core did not end (it was killed)
        with self._send_lock:
            self._sender.close()
        if self._thread is None or not self._thread.is_alive():  # else it still reads (never seen)
            self._receiver.close()
            self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    # ------------------------------------------------------------------ requests (loop thread)
    def get_model(self, name: str) -> HostedModel:
        if name not in self.models:
            raise KeyError(name)
        return self.models[name]

    def check_queue(self, model: str, num_adding: int = 1) -> None:
        """An early check against the core's last numbers (the core checks again, exactly)."""
        self.get_model(model).check_queue(num_adding, self.retry_after_s)

    def set_tenants(self, weights: dict[str, float], max_running: dict[str, int | None]) -> None:
        self._send(SetTenants(dict(weights), dict(max_running)))

    async def submit(self, model: str, items: Sequence[RequestItem]) -> OutputStream:
        """As ``AsyncEngine.submit``: all or none; KeyError, QueueFullError, ValueError or
        EngineDeadError, and nothing is queued when it raises."""
        hosted = self.get_model(model)
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        processor = self._processors[model]
        view: ModelView = hosted.engine  # type: ignore[assignment]
        requests = []
        prompts = []
        for item in items:
            text, token_ids = _prompt_of(item.prompt, view.tokenizer)
            prompts.append((text, token_ids))
            key = "pooling" if isinstance(item.params, PoolingParams) else "sampling"
            lora = None if item.lora_request is None else LoRASpec.of(item.lora_request)
            requests.append(
                CoreRequest(
                    item.request_id, token_ids, tenant=item.tenant, lora=lora, **{key: params_fields(item.params)}
                )
            )
        for item in items:
            if item.request_id in processor:
                raise ValueError(f"request_id {item.request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = OutputStream(self, model, [item.request_id for item in items])  # type: ignore[arg-type]
        now = time.monotonic()
        for item, (text, token_ids) in zip(items, prompts):
            processor.add(item.request_id, text, token_ids, item.params, item.lora_request)
            self._tracked[(model, item.request_id)] = _Tracked(
                item.request_id, stream, now, max_tokens=item.params.max_tokens
            )
        submit_id = next(self._submit_ids)
        answer: asyncio.Future[Added] = loop.create_future()
        self._pending[submit_id] = (answer, model)
        try:
            self._send(AddRequests(submit_id, model, requests))
            added = await answer
            _raise_refusal(added, model)
        except BaseException as err:
            self._pending.pop(submit_id, None)
            for item in items:
                self._tracked.pop((model, item.request_id), None)
                processor.forget(item.request_id)
                if isinstance(err, asyncio.CancelledError):  # the add may still land: undo it
                    self._send(Abort(model, item.request_id))
            raise
        return stream

    # ------------------------------------------------------------------ LoRA adapters (loop thread)
    def lora_adapters(self) -> list[LoRARequest]:
        """The core's adapters as last heard (``base_model_name``: the model that runs each)."""
        return list(self._loras.values())

    async def add_lora(self, model: str, lora_request: LoRARequest) -> int:
        """Load an adapter onto ``model`` in the core (once, whichever front end asks); returns the id
        the core gave it. ValueError, with the core's message, if it cannot be served."""
        self.get_model(model)
        state = await self._control(LoRAControl(0, "load", model, LoRASpec.of(lora_request)))
        _raise_lora_error(state)
        # the id from the answer itself: news of a later change (another front end unloading it) can be
        # applied to ``_loras`` between the answer's arrival and this coroutine resuming
        for adapter in state.adapters:
            if adapter.name == lora_request.lora_name:
                return adapter.int_id
        raise ValueError(f"lora_name: adapter {lora_request.lora_name!r} was not in the engine core's answer")

    async def remove_lora(self, model: str, lora_name: str) -> bool:
        """Unload an adapter in the core (False if the core does not have it); requests running
        with it finish with it."""
        self.get_model(model)
        state = await self._control(LoRAControl(0, "unload", model, lora_name=lora_name))
        if state.error == "not_found":
            return False
        _raise_lora_error(state)
        return True

    async def refresh_loras(self) -> list[LoRARequest]:
        """Ask the core for its adapter list now (it may have changed through another front end)."""
        await self._control(LoRAControl(0, "list"))
        return self.lora_adapters()

    def lora_info(self) -> dict[str, dict[str, Any]]:
        """The core's last numbers per model with LoRA enabled (``AsyncEngine.lora_info``)."""
        return {name: dict(info) for name, info in self._lora_info.items()}

    async def _control(self, message: LoRAControl) -> LoRAState:
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        message.control_id = next(self._controls)
        answer: asyncio.Future[LoRAState] = asyncio.get_running_loop().create_future()
        self._control_pending[message.control_id] = answer
        try:
            self._send(message)
            return await answer
        finally:
            self._control_pending.pop(message.control_id, None)

    def _set_loras(self, adapters: Sequence[LoRASpec]) -> None:
        loras = {a.name: a.request() for a in adapters}
        if loras != self._loras:
            self._loras = loras
            self.lora_version += 1

    def abort(self, model: str, request_id: str) -> None:
        """Abort a request; its pages are freed in the core before its next step. Idempotent."""
        if model in self.models:
            self._send(Abort(model, request_id))

    def _leave(self) -> None:
        """``shutdown`` of an attached front end."""
        if self._alive_fd is not None:  # the core aborts this front end's requests (pages freed)
            os.close(self._alive_fd)
            self._alive_fd = None
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # it stops at its next poll
        self._call_in_loop(self._end_all)  # this front end's streams end with 'abort'
        with self._send_lock:
            self._sender.close(linger=0)
        if self._thread is None or not self._thread.is_alive():
            self._receiver.close(linger=0)
            self._context.term()
            self._watch.close()

    def _send(self, message: object) -> None:
        with self._send_lock:
            if self._sender.closed:
                return
            try:
                # Never blocks: the queue towards the core is unbounded (this side connects, so
                # messages wait in it until the core is up); if the core is gone, they are moot.
                self._sender.send(self._codec.encode(message), zmq.NOBLOCK)  # type: ignore[arg-type]
            except zmq.Again:
                logger.debug("the engine core is not connected; %s dropped", type(message).__name__)

    # ------------------------------------------------------------------ receiver thread
    def _receive_loop(self) -> None:
        codec = Codec()  # this thread's own decoder
        receiver = self._receiver
        poller = zmq.Poller()
        poller.register(receiver, zmq.POLLIN)
        if self._watch.fd is not None:  # its EOF wakes this thread at once
            poller.register(self._watch.fd, zmq.POLLIN)
        attached = self.process is None
        while True:
            if attached and self._stopping.is_set():
                return  # left the core: what it still sends is for nobody
            events = dict(poller.poll(POLL_MS))
            if receiver in events:
                message = codec.decode_core(receiver.recv(copy=False).buffer)
                self._call_in_loop(self._on_message, message)
                continue
            if self._watch.gone():
                while receiver.poll(0):  # what it sent before it exited
                    self._call_in_loop(self._on_message, codec.decode_core(receiver.recv()))
                self._call_in_loop(self._on_core_exit, self._watch.describe(self.core_pid))
                return

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop after every call handed over before it (any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._post, fn, args)
        except RuntimeError:  # loop closed meanwhile
            pass

    def _post(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._inbox.append((fn, args))
        if self._inbox_task is None or self._inbox_task.done():
            self._inbox_task = asyncio.get_running_loop().create_task(self._drain_inbox())

    async def _drain_inbox(self) -> None:
        while self._inbox:
            fn, args = self._inbox.popleft()
            try:
                if fn == self._on_message and isinstance(args[0], Outputs):
                    await self._on_outputs_in_chunks(args[0])
                else:
                    fn(*args)
            except Exception:  # one message's failure must not stop the delivery of the next
                logger.exception("engine core client: handling %s failed", getattr(fn, "__name__", fn))

    # ------------------------------------------------------------------ loop thread: delivery
    def _on_message(self, message: object) -> None:
        if isinstance(message, Outputs):
            self._on_outputs(message)
        elif isinstance(message, Added):
            pending = self._pending.pop(message.submit_id, None)
            if pending is not None and not pending[0].done():
                pending[0].set_result(message)
        elif isinstance(message, ModelFailed):
            error = RuntimeError(message.message)
            processor = self._processors.get(message.model)
            for request_id in message.request_ids:
                if processor is not None:
                    processor.forget(request_id)
                tracked = self._tracked.pop((message.model, request_id), None)
                if tracked is not None:
                    tracked.stream._put(error)  # noqa: SLF001
        elif isinstance(message, LoRAState):
            self._set_loras(message.adapters)  # before the caller resumes: its next look sees the change
            control = None if message.control_id is None else self._control_pending.pop(message.control_id, None)
            if control is not None and not control.done():
                control.set_result(message)
        elif isinstance(message, Bye):
            logger.info("engine core stopped")

    async def _on_outputs_in_chunks(self, message: Outputs) -> None:
        """``_on_outputs``, yielding to the loop after every ``output_chunk_size`` sequences' outputs."""
        for done in self._on_outputs(message):
            if done:
                await asyncio.sleep(0)

    def _on_outputs(self, message: Outputs) -> Iterator[bool]:
        """Deliver one step's outputs; yields True after each ``output_chunk_size`` outputs (a point
        where the caller may let the loop run other work) and False at the end."""
        count = 0
        if message.stats is not None:
            self._stats = message.stats
        if message.lora_info is not None:
            self._lora_info = message.lora_info
        now = time.monotonic()
        listener = self.listener
        for model_outputs in message.models:
            model = model_outputs.model
            self.num_steps += len(model_outputs.step_tokens)
            if listener is not None and hasattr(listener, "on_step"):
                for num_tokens in model_outputs.step_tokens:
                    listener.on_step(model, num_tokens)  # type: ignore[attr-defined]
            processor = self._processors[model]
            for delta in model_outputs.outputs:
                processed = processor.process(delta)
                for request_id, index in processed.aborts:
                    self._send(Abort(model, request_id, index))
                if processed.output is not None:
                    self._deliver(model, processed.output, now)
                count += 1
                if count % self.output_chunk_size == 0:
                    yield True
        yield False

    def _deliver(self, model: str, output: RequestOutput, now: float) -> None:
        tracked = self._tracked.get((model, output.request_id))
        if tracked is None:
            return
        tracked.context.run(observe_output, self.listener, model, tracked, output, now)
        if output.finished:
            del self._tracked[(model, output.request_id)]
        tracked.stream._put((output.request_id, output))  # noqa: SLF001

    def _end_all(self) -> None:
        """After shutdown: end what the core did not (as its abort would have)."""
        now = time.monotonic()
        for model, request_id in list(self._tracked):
            output = self._processors[model].fail(request_id, "abort")
            if output is not None:
                self._deliver(model, output, now)
            else:
                self._tracked.pop((model, request_id), None)
        self._fail_pending(EngineDeadError("the engine is shutting down"))

    def _fail_pending(self, error: Exception) -> None:
        for answer, _ in self._pending.values():
            if not answer.done():
                answer.set_exception(error)
        self._pending.clear()
        for control in self._control_pending.values():
            if not control.done():
                control.set_exception(error)
        self._control_pending.clear()

    def _on_core_exit(self, how: str) -> None:
        if self._stopping.is_set():
            return  # asked to stop
        reason = f"the engine core process died ({how}); no request can be served"
        self.dead_reason = reason
        logger.error("%s", reason)
        error = EngineDeadError(reason)
        self._fail_pending(error)
        for (model, request_id), tracked in list(self._tracked.items()):
            self._processors[model].forget(request_id)
            tracked.stream._put(error)  # noqa: SLF001
        self._tracked.clear()
        for callback in self.on_dead:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - every callback runs
                logger.exception("on_dead callback failed")

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, dict[str, int]]:
        """The core's last live numbers per model (sent while it is busy, and when it goes idle)."""
        return {name: dict(values) for name, values in self._stats.items()}

    def cache_info(self) -> dict[str, dict[str, Any]]:
        return {name: dict(info) for name, info in self._cache_info.items()}


def _open_sockets(addresses: ClientAddresses) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """(context, sender, receiver): this side binds what it reads and connects what it writes, so
    nothing sent before the core is up is lost (it waits in the sender's queue)."""
    context = zmq.Context()
    sender = context.socket(zmq.PUSH)
    receiver = context.socket(zmq.PULL)
    for sock in (sender, receiver):
        sock.setsockopt(zmq.SNDHWM, 0)  # never block nor drop: the peer reads everything
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
    receiver.bind(addresses.output_address)
    sender.connect(addresses.input_address)
    return context, sender, receiver


def _raise_refusal(added: Added, model: str) -> None:
    if added.error is None:
        return
    if added.error == "queue_full":
        raise QueueFullError(model, added.max_queue, added.retry_after_s, added.num_adding)
    if added.error == "dead":
        raise EngineDeadError(added.message)
    if added.error == "model":
        raise KeyError(model)
    raise ValueError(added.message)


def _raise_lora_error(state: LoRAState) -> None:
    if state.error == "internal":
        raise RuntimeError(state.message)
    if state.error is not None:
        raise ValueError(state.message)


def _prompt_of(prompt: Any, tokenizer: Any) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a ``RequestItem.prompt`` (token ids preferred)."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt_token_ids", "prompt"}
        if unknown:
            raise ValueError(f"unknown prompt field(s) {sorted(unknown)}; supported: prompt, prompt_token_ids")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return _prompt_of(prompt["prompt"], tokenizer)
        raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    return None, _token_ids(prompt)


def _token_ids(token_ids: Any) -> list[int]:
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise ValueError("prompt_token_ids must be a list of integers")
    return list(token_ids)
