"""What crosses the socket between the front end and the engine-core process (msgspec structs).

Knows: every message's fields and the two tagged unions (``FrontendMessage``: front end ->
core; ``CoreMessage``: core -> front end), their msgpack encoding, and how ``SamplingParams`` /
``PoolingParams`` travel (their constructor's fields; the receiver builds them again, so they
are validated on both sides). Must not know: sockets, engines, asyncio, HTTP.

Shape of the traffic: requests go in already tokenized (prompt token ids, sampling params with
the grammar spec); outputs come back once per engine step as ONE ``Outputs`` message holding, for
every request the step touched, its new token ids, finish reason and (if asked) raw logprobs
``(token ids, logprobs, ranks)`` per position. Text is never made in the core: the front end
detokenizes, checks stop strings and decodes logprob tokens.

LoRA adapters (``--enable-lora``): a request names its adapter as plain data (``LoRASpec``); the
core owns the adapters (``--lora-modules`` are loaded there at start-up and listed in ``Ready``);
runtime loads and unloads are ``LoRAControl`` messages, answered by ``LoRAState`` (the core's whole
adapter list, with the error if refused), which the core also sends to every other front end after
a change, so each front end's ``/v1/models`` follows the core's list.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from qserve.lora.request import LoRARequest
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import SamplingParams
from qserve.structured.params import StructuredOutputsParams

# One position's logprobs as sent: (token ids, logprobs, ranks), entry 0 the chosen/actual token.
RawLogprobs = tuple[list[int], list[float], list[int | None]]


# ---------------------------------------------------------------------- LoRA adapters
class LoRASpec(msgspec.Struct, array_like=True, omit_defaults=True):
    """A ``LoRARequest`` as plain data (its fields; the receiver builds it again, validated)."""

    name: str
    int_id: int
    path: str
    base_model_name: str | None = None

    @classmethod
    def of(cls, request: LoRARequest) -> LoRASpec:
        return cls(request.lora_name, request.lora_int_id, request.lora_path, request.base_model_name)

    def request(self) -> LoRARequest:
        return LoRARequest(self.name, self.int_id, self.path, self.base_model_name)


# ---------------------------------------------------------------------- front end -> core
class CoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine request (one prompt of a submission)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any] | None = None  # SamplingParams' constructor fields
    pooling: dict[str, Any] | None = None  # PoolingParams' (an embedding request)
    tenant: str | None = None
    lora: LoRASpec | None = None  # the adapter it runs with (None: the base model)


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """Queue these requests of ``model`` all or none; the core answers ``Added(submit_id)``."""

    submit_id: int
    model: str
    requests: list[CoreRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Abort a request (``index`` None: all its sequences; else only sequence ``index``, whose
    stop string the front end found)."""

    model: str
    request_id: str
    index: int | None = None


class SetTenants(msgspec.Struct, tag=True, array_like=True):
    """The schedulers share seats by these tenant weights (``Scheduler.set_tenants``)."""

    weights: dict[str, float]
    max_running: dict[str, int | None]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort everything, send the last outputs, answer ``Bye`` and exit."""


class LoRAControl(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """A runtime adapter change or query, executed once by the core, answered by ``LoRAState``
    with this ``control_id``. ``op``: "load" (``lora`` onto ``model``; the core picks its
    ``int_id``), "unload" (``lora_name``) or "list"."""

    control_id: int
    op: str
    model: str = ""
    lora: LoRASpec | None = None
    lora_name: str = ""


FrontendMessage = AddRequests | Abort | SetTenants | Shutdown | LoRAControl


# ---------------------------------------------------------------------- core -> front end
class ModelInfo(msgspec.Struct, array_like=True):
    """What the front end needs of one hosted model (sent once, in ``Ready``)."""

    name: str
    path: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    eos_token_ids: list[int]  # the engine's stop ids (config, tokenizer, family chat stops)
    max_queue: int | None
    cache_info: dict[str, Any]  # AsyncEngine.cache_info()'s entry


class Ready(msgspec.Struct, tag=True, array_like=True):
    models: list[ModelInfo]
    stats: dict[str, dict[str, int]]
    pid: int
    loras: list[LoRASpec] = []  # the adapters loaded (--lora-modules), base_model_name set
    lora_info: dict[str, dict[str, Any]] = {}  # per model with LoRA enabled: AsyncEngine.lora_info()'s entry


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    """Loading the models failed; ``user_error``: a ValueError / FileNotFoundError (bad input)."""

    message: str
    user_error: bool


class Added(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The answer to ``AddRequests``: ``error`` None (queued), or why nothing was queued."""

    submit_id: int
    error: str | None = None  # "value" | "queue_full" | "dead" | "model"
    message: str = ""
    retry_after_s: int = 1
    max_queue: int = 0
    num_adding: int = 1


class SequenceDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence gained in one step."""

    index: int
    token_ids: list[int]  # new ids
    logprobs: list[RawLogprobs] | None = None  # one entry per new id (when logprobs were asked)
    finish_reason: str | None = None  # as the core decided it (no stop strings: the front end checks them)
    stop_reason: int | str | None = None


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step."""

    request_id: str
    sequences: list[SequenceDelta]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[RawLogprobs | None] | None = None  # new prompt positions
    embedding: list[float] | None = None
    metrics: dict[str, float] | None = None  # on finish: arrival / first scheduled / queue time


class ModelOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    model: str
    outputs: list[RequestDelta]
    step_tokens: list[int] = []  # tokens (prompt and generated) of each step completed


class Outputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """One round of the core's loop: the outputs of every model it stepped (and, at most every
    ``STATS_INTERVAL_S``, the live numbers ``AsyncEngine.stats()`` gives)."""

    models: list[ModelOutputs]
    stats: dict[str, dict[str, int]] | None = None
    lora_info: dict[str, dict[str, Any]] | None = None  # with ``stats``: AsyncEngine.lora_info()'s numbers


class ModelFailed(msgspec.Struct, tag=True, array_like=True):
    """A step of ``model`` raised: its requests were aborted in the core and end with ``message``."""

    model: str
    request_ids: list[str]
    message: str


class Bye(msgspec.Struct, tag=True, array_like=True):
    """The core is exiting after a ``Shutdown`` (every output before it was sent)."""


class LoRAState(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The core's adapter list (every model's, ``base_model_name`` set): the answer to the
    ``LoRAControl`` ``control_id`` (``error`` set if it was refused: "value" for an adapter that
    cannot be served, "not_found" for unloading one that is not loaded, "internal" for a fault of
    the core; ``message`` says why), or,
    ``control_id`` None, the news of a change another front end asked for."""

    adapters: list[LoRASpec]
    control_id: int | None = None
    error: str | None = None
    message: str = ""


CoreMessage = Ready | StartupFailed | Added | Outputs | ModelFailed | Bye | LoRAState


# ---------------------------------------------------------------------- params
def params_fields(params: SamplingParams | PoolingParams) -> dict[str, Any]:
    """The constructor fields of a params object (nested structured outputs as a dict too)."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    constraint = values.get("structured_outputs")
    if constraint is not None:
        values["structured_outputs"] = {
            f.name: getattr(constraint, f.name) for f in dataclasses.fields(constraint) if f.init
        }
    return values


def sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` again from ``params_fields`` (validated, as any construction)."""
    values = dict(fields)
    constraint = values.get("structured_outputs")
    if constraint is not None:
        values["structured_outputs"] = StructuredOutputsParams(**constraint)
    if values.get("logit_bias") is not None:
        values["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()}
    return SamplingParams(**values)


def request_params(request: CoreRequest) -> SamplingParams | PoolingParams:
    if request.pooling is not None:
        return PoolingParams(**request.pooling)
    if request.sampling is None:
        raise ValueError(f"request {request.request_id!r} has neither sampling nor pooling params")
    return sampling_params(request.sampling)


# ---------------------------------------------------------------------- encoding
class Codec:
    """msgpack encoder plus typed decoders for both directions (one per socket owner)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._frontend = msgspec.msgpack.Decoder(FrontendMessage)
        self._core = msgspec.msgpack.Decoder(CoreMessage)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode_frontend(self, data: bytes) -> FrontendMessage:
        return self._frontend.decode(data)

    def decode_core(self, data: bytes) -> CoreMessage:
        return self._core.decode(data)
