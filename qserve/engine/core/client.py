"""The front end's handle on the engine-core process, shaped like ``AsyncEngine`` so the server's
code is the same for both (``models``, ``submit``, ``abort``, ``check_queue``, ``stats``,
``cache_info``, ``start``, ``shutdown``, ``is_running``, ``listener``).

Knows: how the core process is started (``python -m qserve.engine.core.core``, its config pickled
to its stdin, two ZMQ sockets over ``ipc://`` that this side binds) and stopped (``Shutdown``,
then SIGKILL past the timeout); the threads: a receiver thread reads and decodes the core's
messages and hands each to the event loop, where the ``OutputProcessor`` of each model turns
token ids into ``RequestOutput``s for the streams (the same ``OutputStream`` and listener calls as
``AsyncEngine``); what the front end keeps of each model (its own tokenizer, a grammar compiler
for the compile gate, the core's last live numbers); and faults: a core that exits on its own
fails every pending submission and stream with ``EngineDeadError``, turns ``is_running`` off (so
``/health`` answers 503) and calls ``on_dead`` (``qserve serve`` then exits non-zero). Must not
know: HTTP, OpenAI shapes, Prometheus, how engines step.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
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
from qserve.engine.core.core import CoreConfig
from qserve.engine.core.messages import (
    Abort,
    Added,
    AddRequests,
    Bye,
    Codec,
    CoreRequest,
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
from qserve.engine.kv_events import KVEventsConfig
from qserve.outputs import RequestOutput
from qserve.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

POLL_MS = 100  # the receiver thread looks at the core process at least this often
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


class EngineCoreClient:
    """Hosts the models of an engine-core process (see the module doc). Build it with ``launch``."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        context: zmq.Context,
        sender: zmq.Socket,
        receiver: zmq.Socket,
        ready: Ready,
        socket_dir: str,
        *,
        retry_after_s: int = 1,
    ) -> None:
        self.process = process
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
    ) -> EngineCoreClient:
        """Start the core process, wait until it has loaded every model, and return its client.
        A load error is raised here (ValueError for bad input, with the core's message).
        ``kv_events``: the core publishes KV-cache events (``port``: the topic's ``{port}``)."""
        socket_dir = tempfile.mkdtemp(prefix="qserve-core-")
        input_address = f"ipc://{socket_dir}/input"
        output_address = f"ipc://{socket_dir}/output"
        context = zmq.Context()
        sender = context.socket(zmq.PUSH)
        receiver = context.socket(zmq.PULL)
        for sock in (sender, receiver):
            sock.setsockopt(zmq.SNDHWM, 0)  # never block nor drop: the peer reads everything
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
        sender.bind(input_address)
        receiver.bind(output_address)
        core_config = CoreConfig(
            models=list(models),
            host=config,
            input_address=input_address,
            output_address=output_address,
            max_queue=max_queue,
            retry_after_s=retry_after_s,
            log_level=logging.getLogger().getEffectiveLevel(),
            kv_events=kv_events,
            port=port,
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "qserve.engine.core.core"], stdin=subprocess.PIPE, env=_core_environment(config)
        )
        try:
            assert process.stdin is not None
            process.stdin.write(pickle.dumps(core_config))
            process.stdin.close()
            ready = cls._wait_ready(process, receiver)
            return cls(process, context, sender, receiver, ready, socket_dir, retry_after_s=retry_after_s)
        except BaseException:
            if process.poll() is None:
                process.kill()
                process.wait()
            sender.close()
            receiver.close()
            context.term()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise

    @staticmethod
    def _wait_ready(process: subprocess.Popen[bytes], receiver: zmq.Socket) -> Ready:
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
            if process.poll() is not None:
                raise RuntimeError(f"the engine core process exited during start-up (exit code {process.returncode})")

    # ------------------------------------------------------------------ lifecycle (AsyncEngine's)
    @property
    def model_names(self) -> list[str]:
        return list(self.models)

    @property
    def is_running(self) -> bool:
        return (
            self._thread is not None and self.dead_reason is None and not self._stopping.is_set()
            and self.process.poll() is None
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
        if it has not within ``timeout``. Idempotent; any thread."""
        with self._send_lock:
            if self._shut:
                return
            self._shut = True
        self._stopping.set()
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
            requests.append(
                CoreRequest(item.request_id, token_ids, tenant=item.tenant, **{key: params_fields(item.params)})
            )
        for item in items:
            if item.request_id in processor:
                raise ValueError(f"request_id {item.request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = OutputStream(self, model, [item.request_id for item in items])  # type: ignore[arg-type]
        now = time.monotonic()
        for item, (text, token_ids) in zip(items, prompts):
            processor.add(item.request_id, text, token_ids, item.params)
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

    def abort(self, model: str, request_id: str) -> None:
        """Abort a request; its pages are freed in the core before its next step. Idempotent."""
        if model in self.models:
            self._send(Abort(model, request_id))

    def _send(self, message: object) -> None:
        with self._send_lock:
            if self._sender.closed:
                return
            try:
                # Never blocks: the queue towards a connected core is unbounded, and a PUSH socket
                # without one (the core is gone) would wait forever; the message is moot then.
                self._sender.send(self._codec.encode(message), zmq.NOBLOCK)  # type: ignore[arg-type]
            except zmq.Again:
                logger.debug("the engine core is not connected; %s dropped", type(message).__name__)

    # ------------------------------------------------------------------ receiver thread
    def _receive_loop(self) -> None:
        codec = Codec()  # this thread's own decoder
        receiver = self._receiver
        while True:
            if receiver.poll(POLL_MS):
                message = codec.decode_core(receiver.recv(copy=False).buffer)
                self._call_in_loop(self._on_message, message)
                continue
            returncode = self.process.poll()
            if returncode is not None:
                while receiver.poll(0):  # what it sent before it exited
                    self._call_in_loop(self._on_message, codec.decode_core(receiver.recv()))
                self._call_in_loop(self._on_core_exit, returncode)
                return

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed meanwhile
            pass

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
        elif isinstance(message, Bye):
            logger.info("engine core stopped")

    def _on_outputs(self, message: Outputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
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

    def _on_core_exit(self, returncode: int) -> None:
        if self._stopping.is_set():
            return  # asked to stop
        reason = f"the engine core process died (exit code {returncode}); no request can be served"
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


def _core_environment(config: HostConfig) -> dict[str, str]:
    """The core's environment: this one, plus, on CPU, OpenMP threads that sleep when idle
    (``OMP_WAIT_POLICY=PASSIVE``, unless set). Why: the front end works between the core's
    steps; with OpenMP's default spinning, a step's threads waited for a CPU the spinning took
    (2-core machine, tiny model: 20-75 ms per token instead of 2-4 ms; passive: 4 ms, in-process 3)."""
    from qserve.engine.engine import resolve_device

    env = dict(os.environ)
    if resolve_device(config.device).type == "cpu":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


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
