"""OpenAI requests in, engine requests out; engine outputs in, OpenAI responses / SSE chunks out.

Knows: how ``CompletionRequest`` / ``ChatCompletionRequest`` become ``SamplingParams`` and
token-id prompts (chat template, echo, logprobs, n, batches of prompts), how cumulative
``RequestOutput``s become OpenAI responses, streaming deltas and usage, and which
``ServingError`` (status, type, param) each failure is. Must not know: routes, auth,
uvicorn, Prometheus, or how engines are stepped (``AsyncEngine`` does that).

Tokenizers: each model gets a front-end copy of its tokenizer, used only on the event loop
thread (the engine's own one belongs to the step thread), and a ``PromptTokenizer`` that
tokenizes prompts and renders chat templates in a worker thread, so the loop keeps answering.
Before any work, a request's text and caps are checked (``request_limits``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from qserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestItem
from qserve.outputs import PositionLogprobs, RequestOutput
from qserve.sampling_params import SamplingParams
from qserve.server.accepted_fields import template_switches
from qserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    UsageInfo,
)
from qserve.server.request_limits import (
    DEFAULT_LIMITS,
    RequestLimitError,
    RequestLimits,
    check_limits,
    check_text,
    clip,
)
from qserve.server.structured import ConstraintError, constraint_off_loop
from qserve.server.tokenizing import PromptTokenizer
from qserve.server.tools import (
    KEEP_SPECIAL_TOKENS,
    ForcedCallStreamer,
    ToolCallStreamer,
    ToolPlan,
    new_call_id,
    parse_forced,
    parse_tool_calls,
    plan_tools,
    template_message,
)
from qserve.structured.gate import RETRY_AFTER_S, GrammarBusy, GrammarGate
from qserve.structured.grammar import GrammarError
from qserve.structured.limits import LimitError, check_logit_bias
from qserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# chat_template_kwargs keys that would replace the template or change how it is applied.
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools",
     "documents", "padding", "truncation", "max_length"}
)  # fmt: skip

# Fields copied from the request into SamplingParams when the client set them.
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class ServingError(Exception):
    """A failure with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "BadRequestError",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers or {}

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status))


def bad_request(message: str, param: str | None = None) -> ServingError:
    return ServingError(400, message, type="BadRequestError", param=param)


def _param_of(message: str, names: Sequence[str], rename: dict[str, str]) -> str | None:
    """The request field a ValueError message is about (its first known word)."""
    quoted = re.search(r"unknown sampling parameter '(\w+)'", message)
    if quoted:
        return quoted.group(1)
    match = re.match(r"(\w+)", message)
    if match and match.group(1) in names:
        return rename.get(match.group(1), match.group(1))
    return None


@dataclass(eq=False)
class ServedModel:
    """What the front end needs of one hosted model."""

    name: str
    path: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # front-end copy: loop thread only
    prompts: PromptTokenizer | None = None  # encode / chat template in a worker thread
    grammar_compiler: Any = None  # the engine's GrammarCompiler (thread-safe): validates + warms its cache
    grammar_gate: GrammarGate | None = None  # limits, time-limited compiles in a child process, then the cache
    tool_parser: str = "hermes"  # the auto-mode tool-call format (qserve.server.tools.PARSERS)
    # A LoRA adapter served under its own name: the hosted (base) model that runs it, and the adapter.
    base: str | None = None
    lora_request: Any = None  # qserve.lora.request.LoRARequest

    @property
    def host_name(self) -> str:
        """The hosted model that runs it (the base model for an adapter)."""
        return self.base or self.name


class ClosingStream:
    """An SSE body that always runs ``on_close`` when closed: the generator's own ``finally``
    does not run if the response is closed before the generator ever started (a client that
    leaves before the first byte), and the engine request must be aborted then too."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self._chunks = chunks
        self._on_close = on_close

    def __aiter__(self) -> ClosingStream:
        return self

    async def __anext__(self) -> str:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._on_close()


@dataclass(eq=False)
class _Prompt:
    token_ids: list[int]
    text: str | None  # None until decoded (token-id prompts)


@dataclass(eq=False)
class _ChoiceState:
    """Streaming progress of one choice."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False


@dataclass(eq=False)
class _Submission:
    request_ids: list[str]
    prompts: list[_Prompt]
    params: SamplingParams
    index_of: dict[str, int] = field(default_factory=dict)


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event carrying ``payload`` as JSON (or a raw string such as [DONE])."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    elif isinstance(payload, dict):
        data = json.dumps(payload, ensure_ascii=False)
    else:
        data = payload
    return f"data: {data}\n\n"


class OpenAIServing:
    """The endpoints' logic, independent of the web framework."""

    def __init__(
        self,
        host: AsyncEngine,
        tool_call_parser: str | None = None,
        limits: RequestLimits = DEFAULT_LIMITS,
        *,
        tenant_gate: Any | None = None,
    ) -> None:
        from qserve.server.tools import detect_parser

        self.host = host
        self.limits = limits
        self.tenant_gate = tenant_gate  # qserve.server.tenancy.TenantGate when tenants are configured
        self.models: dict[str, ServedModel] = {}
        for name, hosted in host.models.items():
            engine = hosted.engine
            self.models[name] = ServedModel(
                name=name,
                path=str(engine.config.model),
                max_model_len=engine.max_model_len,
                vocab_size=engine.model_config.vocab_size,
                tokenizer=copy.deepcopy(engine.tokenizer),
                prompts=PromptTokenizer(engine.tokenizer, engine.max_model_len, name),
                grammar_compiler=getattr(engine, "grammar_compiler", None),
                grammar_gate=_grammar_gate(engine),
                tool_parser=tool_call_parser or detect_parser(getattr(engine.tokenizer, "chat_template", None)),
            )
        # LoRA adapters by name (qserve.server.lora_routes keeps it current): name -> its ServedModel.
        self.lora_models: dict[str, ServedModel] = {}
        for name, hosted in host.models.items():
            manager = getattr(hosted.engine, "lora_manager", None)
            for adapter in [] if manager is None else manager.names():
                self.add_lora_model(name, manager.request_of(adapter))
        # An engine core in its own process keeps the adapter list, which any front end may change:
        # the host's lora_version says when to rebuild lora_models from it (None: an in-process host).
        self._lora_version = getattr(host, "lora_version", None)

    def add_lora_model(self, base: str, lora_request: Any) -> None:
        """Serve an adapter of the hosted model ``base`` under its own name (the base's front end)."""
        self.lora_models[lora_request.lora_name] = dataclasses.replace(
            self.models[base], name=lora_request.lora_name, base=base, lora_request=lora_request
        )

    def sync_lora_models(self) -> None:
        """Follow the engine core's adapter list (a host in its own process; in-process hosts are
        changed only through this front end, which updates ``lora_models`` itself)."""
        version = getattr(self.host, "lora_version", None)
        if version is None or version == self._lora_version:
            return
        self.lora_models = {}
        for request in self.host.lora_adapters():
            if request.base_model_name in self.models:
                self.add_lora_model(request.base_model_name, request)
        self._lora_version = version

    async def refresh_lora_models(self, name: str | None = None) -> None:
        """Ask the engine core for its adapter list (another front end may have changed it) and
        follow it; ``name``: only if that name is not served here as far as this front end knows."""
        if not hasattr(self.host, "refresh_loras"):
            return
        self.sync_lora_models()
        if name is not None and (name in self.models or name in self.lora_models):
            return
        try:
            await self.host.refresh_loras()
        except EngineDeadError:
            return  # what this front end knows; a submission then answers 503
        self.sync_lora_models()

    # ------------------------------------------------------------------ models
    def list_models(self) -> ModelList:
        self.sync_lora_models()
        return ModelList(
            # root is the served name, never the checkpoint's filesystem path (it tells clients
            # nothing they can use and tells attackers about the host). An adapter's parent is its base.
            data=[ModelCard(id=m.name, root=m.name, max_model_len=m.max_model_len) for m in self.models.values()]
            + [
                ModelCard(id=m.name, root=m.name, parent=m.base, max_model_len=m.max_model_len)
                for m in self.lora_models.values()
            ]
        )

    def _model(self, name: str) -> ServedModel:
        self.sync_lora_models()
        model = self.models.get(name) or self.lora_models.get(name)
        if model is None:
            served = ", ".join([*self.models, *self.lora_models])  # the names a client can use instead
            message = f"The model `{clip(name)}` does not exist. Served models: {served}."
            raise ServingError(404, message, type="NotFoundError", param="model")
        return model

    # ------------------------------------------------------------------ shared helpers
    def _check_request(self, request: SamplingFields) -> int:
        """Text and caps, before anything else; returns the sequences it would queue."""
        try:
            check_text(request)
            return check_limits(request, self.limits)
        except RequestLimitError as err:
            raise bad_request(str(err), err.param) from err

    def _check_prompt_chars(self, model: ServedModel, num_chars: int, param: str) -> None:
        if model.prompts is not None and model.prompts.too_long(num_chars):
            raise bad_request(
                f"This model's maximum context length is {model.max_model_len} tokens. However, your prompt is "
                f"{num_chars} characters long, more than {model.max_model_len} tokens can hold.",
                param,
            )

    async def _encode(self, model: ServedModel, text: str, param: str, **kwargs: Any) -> list[int]:
        self._check_prompt_chars(model, len(text), param)
        if model.prompts is None:
            return model.tokenizer.encode(text, **kwargs)
        return await model.prompts.encode(text, **kwargs)

    @staticmethod
    def _sampling_params(
        request: SamplingFields,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        rename: dict[str, str] | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": request.n,
            "max_tokens": max_tokens,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "seed": request.seed,
            "ignore_eos": request.ignore_eos,
            "min_tokens": request.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": request.skip_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "logit_bias": _logit_bias(request.logit_bias),
            "structured_outputs": structured_outputs,
        }
        for name in _OPTIONAL_SAMPLING_FIELDS:
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as err:
            raise bad_request(str(err), _param_of(str(err), SamplingParams.field_names(), rename or {})) from err

    # ------------------------------------------------------------------ structured outputs
    @staticmethod
    def _refuse_unimplemented(request: SamplingFields) -> None:
        """Fields the schema accepts but qserve does not act on: refused, never ignored."""
        if request.stream_options is not None and request.stream_options.continuous_usage_stats:
            raise bad_request(
                "stream_options.continuous_usage_stats is not supported (use include_usage)",
                "stream_options.continuous_usage_stats",
            )

    @staticmethod
    async def _constraint(request: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
        OpenAIServing._refuse_unimplemented(request)
        try:
            return await constraint_off_loop(request)
        except ConstraintError as err:
            raise bad_request(str(err), err.field) from err

    @staticmethod
    async def _compile(model: ServedModel, constraint: StructuredOutputsParams | None, field: str | None) -> None:
        """Compile the grammar off the event loop (a 400 naming ``field`` if it does not
        compile); the engine then finds it in the cache."""
        if constraint is None or model.grammar_gate is None:
            return
        try:
            await model.grammar_gate.compile(constraint, field or "structured_outputs")
        except GrammarError as err:
            raise bad_request(str(err), err.field) from err
        except GrammarBusy as err:  # not the request's fault: tell the client when to come back
            retry = {"Retry-After": str(RETRY_AFTER_S)}
            raise ServingError(503, str(err), type="ServiceUnavailableError", param=field, headers=retry) from err

    def close(self) -> None:
        """Shutdown: kill running grammar compiles (requests waiting on them get 503)."""
        for model in self.models.values():
            if model.grammar_gate is not None:
                model.grammar_gate.close()

    def _check_length(self, model: ServedModel, prompt: _Prompt, param: str) -> None:
        if len(prompt.token_ids) >= model.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {model.max_model_len} tokens. However, your prompt is "
                f"{len(prompt.token_ids)} tokens long, which leaves no room to generate.",
                param,
            )
        if not prompt.token_ids:
            raise bad_request("the prompt is empty: at least one token is needed", param)

    @staticmethod
    def _check_vocab(model: ServedModel, prompt: _Prompt, param: str) -> None:
        vocab = model.vocab_size
        bad = next((t for t in prompt.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"prompt contains token id {bad}, outside the vocabulary [0, {vocab})", param)

    @staticmethod
    def _chat_template_kwargs(request: Any) -> dict[str, Any]:
        """Extra variables for the model's chat template (e.g. ``enable_thinking``). Keys that
        would replace the template or change how it is applied are refused: a client-supplied
        template would run arbitrary Jinja in the server."""
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_CHAT_TEMPLATE_KWARGS)
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}; they are reserved "
                f"({', '.join(sorted(RESERVED_CHAT_TEMPLATE_KWARGS))})",
                "chat_template_kwargs",
            )
        return kwargs

    @staticmethod
    def _check_total_length(model: ServedModel, prompts: list[_Prompt], params: SamplingParams, param: str) -> None:
        """Like vLLM and OpenAI: refuse prompt + max_tokens beyond the context instead of cutting it."""
        if params.max_tokens is None:
            return
        for prompt in prompts:
            total = len(prompt.token_ids) + params.max_tokens
            if total > model.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {model.max_model_len} tokens. However, you requested "
                    f"{total} tokens ({len(prompt.token_ids)} in the prompt, {params.max_tokens} in the completion). "
                    "Please reduce the length of the prompt or the completion.",
                    param,
                )

    async def _submit(
        self, model: ServedModel, submission: _Submission, prompt_param: str, tenant: str | None = None
    ) -> Any:
        items = [
            RequestItem(rid, {"prompt_token_ids": p.token_ids, "prompt": p.text}, submission.params, tenant)
            for rid, p in zip(submission.request_ids, submission.prompts)
        ]
        if tenant is not None and self.tenant_gate is not None:
            return await self._submit_for_tenant(model, submission, prompt_param, tenant, items)
        return await self._submit_items(model, items, prompt_param)

    async def _submit_items(self, model: ServedModel, items: list[RequestItem], prompt_param: str) -> Any:
        if model.lora_request is not None:  # an adapter: its base model runs it
            items = [dataclasses.replace(item, lora_request=model.lora_request) for item in items]
        try:
            return await self.host.submit(model.host_name, items)
        except QueueFullError as err:
            raise ServingError(
                429,
                str(err),
                type="RateLimitError",
                headers={"Retry-After": str(err.retry_after_s)},
            ) from err
        except EngineDeadError as err:
            raise ServingError(503, str(err), type="ServiceUnavailableError") from err
        except ValueError as err:
            message = str(err)
            param = _param_of(message, SamplingParams.field_names(), {})
            raise bad_request(message, param or prompt_param) from err

    async def _submit_for_tenant(
        self, model: ServedModel, submission: _Submission, prompt_param: str, tenant: str, items: list[RequestItem]
    ) -> Any:
        """Tenant admission (429 with Retry-After over a limit) around the engine submission."""
        from qserve.tenants import TenantLimitError

        gate = self.tenant_gate
        params = submission.params
        lens = [len(p.token_ids) for p in submission.prompts]
        try:
            admission = gate.admit(tenant, lens, params.max_tokens, params.n, model.max_model_len)
        except TenantLimitError as err:
            raise ServingError(
                429, str(err), type="RateLimitError", headers={"Retry-After": str(err.retry_after_s)}
            ) from err
        try:
            stream = await self._submit_items(model, items, prompt_param)
        except BaseException:
            gate.tenants.release(admission, 0)
            raise
        return gate.wrap(stream, admission)

    @staticmethod
    async def _collect(stream: Any) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        try:
            async for request_id, output in stream:
                if output.finished:
                    final[request_id] = output
        finally:
            stream.abort()  # no-op once everything finished; frees pages if we were cancelled
        return final

    # ------------------------------------------------------------------ completions
    async def _completion_prompts(self, model: ServedModel, request: CompletionRequest) -> list[_Prompt]:
        raw = request.prompt
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise bad_request("prompt is empty", "prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompt = _Prompt(await self._encode(model, item, "prompt"), item)
            else:
                prompt = _Prompt(list(item), None)
            self._check_length(model, prompt, "prompt")
            prompts.append(prompt)
        return prompts

    async def create_completion(
        self, request: CompletionRequest, tenant: str | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        num_sequences = self._check_request(request)
        await self.refresh_lora_models(request.model)  # an adapter loaded through another front end
        model = self._model(request.model)
        if request.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")
        # max_tokens=0 with echo scores the prompt (eval harnesses): one token is generated
        # for the engine's sake and dropped from the answer.
        prompt_only = request.max_tokens == 0
        if prompt_only and not request.echo:
            raise bad_request("max_tokens must be >= 1 (0 is allowed only with echo=true)", "max_tokens")
        if prompt_only and request.stream:
            raise bad_request("max_tokens=0 (echo only) is not supported with stream=true", "stream")
        self._check_queue(model.host_name, num_sequences)
        prompts = await self._completion_prompts(model, request)
        logprobs = request.logprobs
        constraint, constraint_field = await self._constraint(request)
        if prompt_only and constraint is not None:
            raise bad_request("max_tokens=0 generates nothing to constrain", constraint_field)
        params = self._sampling_params(
            request,
            max_tokens=1 if prompt_only else request.max_tokens,
            logprobs=logprobs,
            prompt_logprobs=logprobs if request.echo and logprobs is not None else None,
            structured_outputs=constraint,
        )
        await self._compile(model, constraint, constraint_field)
        self._check_total_length(model, prompts, params, "max_tokens")
        if request.echo:
            for prompt in prompts:
                if prompt.text is None:
                    # Decoding trusts the ids: check them first (an id past the vocabulary used to
                    # overflow inside the tokenizer: a 500 instead of a 400).
                    self._check_vocab(model, prompt, "prompt")
                    prompt.text = model.tokenizer.decode(prompt.token_ids)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        submission = _Submission(request_ids, prompts, params, {rid: i for i, rid in enumerate(request_ids)})
        stream = await self._submit(model, submission, "prompt", tenant)
        if request.stream:
            return ClosingStream(self._completion_stream(model, request, submission, stream, base_id), stream.abort)
        final = await self._collect(stream)
        choices: list[CompletionChoice] = []
        for rid in request_ids:
            output = final[rid]
            i = submission.index_of[rid]
            prompt = prompts[i]
            for completion in output.outputs:
                text = completion.text
                token_ids = list(completion.token_ids)
                positions: list[PositionLogprobs | None] = list(completion.logprobs or [])
                if prompt_only:
                    text, token_ids, positions = "", [], []
                if request.echo:
                    text = (prompt.text or "") + text
                    if logprobs is not None:
                        token_ids = list(prompt.token_ids) + token_ids
                        positions = list(output.prompt_logprobs or [None] * len(prompt.token_ids)) + positions
                choices.append(
                    CompletionChoice(
                        index=i * request.n + completion.index,
                        text=text,
                        logprobs=self._completion_logprobs(model, token_ids, positions, 0)
                        if logprobs is not None
                        else None,
                        finish_reason="length" if prompt_only else completion.finish_reason,
                        stop_reason=None if prompt_only else completion.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        usage = _usage(final.values())
        if prompt_only:
            usage = UsageInfo(prompt_tokens=usage.prompt_tokens, total_tokens=usage.prompt_tokens)
        return CompletionResponse(id=base_id, model=model.name, choices=choices, usage=usage)

    def _check_queue(self, name: str, num_sequences: int = 1) -> None:
        try:
            self.host.check_queue(name, num_sequences)
        except ValueError as err:
            raise bad_request(str(err), "n") from err
        except QueueFullError as err:
            raise ServingError(
                429, str(err), type="RateLimitError", headers={"Retry-After": str(err.retry_after_s)}
            ) from err

    @staticmethod
    def _completion_logprobs(
        model: ServedModel,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None],
        initial_offset: int,
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = initial_offset
        for token_id, position in zip(token_ids, positions):
            if position is None:
                token = model.tokenizer.decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = position.get(token_id)
                token = chosen.decoded_token if chosen and chosen.decoded_token is not None else ""
                result.token_logprobs.append(chosen.logprob if chosen else None)
                ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)
                result.top_logprobs.append({lp.decoded_token or "": lp.logprob for _, lp in ranked})
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    async def _completion_stream(
        self,
        model: ServedModel,
        request: CompletionRequest,
        submission: _Submission,
        stream: Any,
        base_id: str,
    ) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        created = int(time.time())
        states: dict[int, _ChoiceState] = {}
        final: dict[str, RequestOutput] = {}
        try:
            async for rid, output in stream:
                i = submission.index_of[rid]
                prompt = submission.prompts[i]
                for completion in output.outputs:
                    index = i * request.n + completion.index
                    state = states.setdefault(index, _ChoiceState())
                    if state.finished:
                        continue
                    text = completion.text[state.text_len :] if len(completion.text) >= state.text_len else ""
                    new_ids = list(completion.token_ids[state.num_tokens :])
                    positions: list[PositionLogprobs | None] = list((completion.logprobs or [])[state.num_tokens :])
                    if request.echo and not state.started:
                        text = (prompt.text or "") + text
                        if request.logprobs is not None:
                            new_ids = list(prompt.token_ids) + new_ids
                            prompt_positions = output.prompt_logprobs or [None] * len(prompt.token_ids)
                            positions = list(prompt_positions) + positions
                    finishing = completion.finish_reason is not None
                    if not text and not finishing and not new_ids:
                        continue  # no new token (e.g. a prefill chunk); a token with no text still goes out
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._completion_logprobs(model, new_ids, positions, state.text_offset)
                        state.text_offset += sum(len(t) for t in logprobs.tokens)
                    state.started = True
                    state.text_len = len(completion.text)
                    state.num_tokens = len(completion.token_ids)
                    state.finished = finishing
                    chunk = CompletionResponse(
                        id=base_id,
                        created=created,
                        model=model.name,
                        choices=[
                            CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason,
                            )
                        ],
                    )
                    yield sse(_dump(chunk, include_usage))
                if output.finished:
                    final[rid] = output
            if include_usage:
                usage_chunk = CompletionResponse(
                    id=base_id, created=created, model=model.name, choices=[], usage=_usage(final.values())
                )
                yield sse(usage_chunk)
        except Exception as err:  # noqa: BLE001 - report in-stream; the HTTP status is already sent
            logger.exception("completion stream %s failed", base_id)
            yield sse(_stream_error(err).to_response())
        finally:
            stream.abort()
        yield sse("[DONE]")

    # ------------------------------------------------------------------ chat
    async def _chat_prompt(
        self, model: ServedModel, request: ChatCompletionRequest, tools: ToolPlan | None = None
    ) -> _Prompt:
        for i, message in enumerate(request.messages):
            unknown = sorted(k for k, v in (message.model_extra or {}).items() if v is not None)
            if unknown:
                raise bad_request(f"unsupported message field '{unknown[0]}'", f"messages.{i}.{unknown[0]}")
        messages = [template_message(m) for m in request.messages]
        tokenizer = model.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request(f"model {model.name!r} has no chat template; use /v1/completions", "messages")
        num_chars = sum(len(str(m.get("content") or "")) for m in messages)
        self._check_prompt_chars(model, num_chars, "messages")
        # reasoning_effort's thinking switch; the request's own chat_template_kwargs win
        template_kwargs = {**template_switches(request), **self._chat_template_kwargs(request)}
        render = model.prompts.apply_chat_template if model.prompts is not None else tokenizer.apply_chat_template
        try:
            if tools is not None and tools.template_tools:
                template_kwargs["tools"] = tools.template_tools
            text = render(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
            if model.prompts is not None:
                text = await text
        except Exception as err:  # noqa: BLE001 - template errors are the request's fault
            raise bad_request(
                f"the chat template could not render these messages: {clip(str(err), 200)}", "messages"
            ) from err
        prompt = _Prompt(await self._encode(model, text, "messages", add_special_tokens=False), text)
        self._check_length(model, prompt, "messages")
        return prompt

    async def create_chat_completion(
        self, request: ChatCompletionRequest, tenant: str | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        num_sequences = self._check_request(request)
        await self.refresh_lora_models(request.model)  # an adapter loaded through another front end
        model = self._model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self._check_queue(model.host_name, num_sequences)
        try:
            tools = plan_tools(request)
        except ConstraintError as err:
            raise bad_request(str(err), err.field) from err
        if tools.mode == "auto" and model.tool_parser in KEEP_SPECIAL_TOKENS:
            request.skip_special_tokens = False  # the call marker is a special token (as vLLM does)
        constraint, constraint_field = await self._constraint(request)
        if tools.constraint is not None:
            if constraint is not None:
                raise bad_request(
                    f"tool_choice={tools.mode!r} forces a tool call; it cannot be combined with {constraint_field}",
                    constraint_field,
                )
            constraint, constraint_field = tools.constraint, "tools"
        prompt = await self._chat_prompt(model, request, tools)
        max_tokens = request.max_completion_tokens or request.max_tokens
        rename = {"max_tokens": "max_completion_tokens" if request.max_completion_tokens else "max_tokens"}
        rename["logprobs"] = "top_logprobs"
        params = self._sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            rename=rename,
            structured_outputs=constraint,
        )
        self._check_total_length(model, [prompt], params, rename["max_tokens"])
        await self._compile(model, constraint, constraint_field)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        submission = _Submission([base_id], [prompt], params, {base_id: 0})
        stream = await self._submit(model, submission, "messages", tenant)
        if request.stream:
            return ClosingStream(self._chat_stream(model, request, stream, base_id, tools), stream.abort)
        final = await self._collect(stream)
        output = final[base_id]
        top = request.top_logprobs or 0
        choices = []
        for c in output.outputs:
            message, finish_reason = self._chat_message(model, tools, c.text, c.finish_reason)
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=_chat_logprobs(c.token_ids, c.logprobs or [], top) if request.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(id=base_id, model=model.name, choices=choices, usage=_usage([output]))

    @staticmethod
    def _chat_message(
        model: ServedModel, tools: ToolPlan, text: str, finish_reason: str | None
    ) -> tuple[ChatResponseMessage, str | None]:
        """The assistant message of a finished choice, with its tool calls parsed out."""
        if tools.mode == "auto":
            content, calls = parse_tool_calls(text, model.tool_parser, tools.template_tools)
        elif tools.mode in ("required", "named"):
            # Only complete calls; forced output cut by max_tokens before any call was complete is
            # finish_reason "length" with neither calls nor the half-written JSON as content.
            content, calls = None, parse_forced(text, tools)
            if not calls:
                return ChatResponseMessage(content=None), finish_reason
        else:
            return ChatResponseMessage(content=text), finish_reason
        if not calls:
            return ChatResponseMessage(content=text), finish_reason
        if not tools.parallel:
            calls = calls[:1]
        # OpenAI: "tool_calls" when the model chose to call; a named (forced) call ends with "stop".
        if finish_reason == "stop" and tools.mode != "named":
            finish_reason = "tool_calls"
        return ChatResponseMessage(content=content, tool_calls=calls), finish_reason

    async def _chat_stream(
        self,
        model: ServedModel,
        request: ChatCompletionRequest,
        stream: Any,
        base_id: str,
        tools: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        created = int(time.time())
        top = request.top_logprobs or 0

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(
                _dump(
                    ChatCompletionChunk(id=base_id, created=created, model=model.name, choices=[choice]), include_usage
                )
            )

        states: dict[int, _ChoiceState] = {}
        tool_streams = {i: _ToolStream(tools, model.tool_parser) for i in range(request.n)} if tools else {}
        last: RequestOutput | None = None
        try:
            for index in range(request.n):
                states[index] = _ChoiceState(started=True)
                yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            async for _, output in stream:
                last = output
                for completion in output.outputs:
                    state = states[completion.index]
                    if state.finished:
                        continue
                    text = completion.text[state.text_len :] if len(completion.text) >= state.text_len else ""
                    new_ids = list(completion.token_ids[state.num_tokens :])
                    positions = list((completion.logprobs or [])[state.num_tokens :])
                    finishing = completion.finish_reason is not None
                    if not text and not finishing and not new_ids:
                        continue  # no new token (e.g. a prefill chunk); a token with no text still goes out
                    state.text_len = len(completion.text)
                    state.num_tokens = len(completion.token_ids)
                    state.finished = finishing
                    finish_reason = completion.finish_reason
                    tool_stream = tool_streams.get(completion.index)
                    if tool_stream is not None and tool_stream.active:
                        text, tool_deltas = tool_stream.feed(text, finishing)
                        for tool_delta in tool_deltas:  # each call: id + name first, then its arguments
                            yield chunk(
                                ChatCompletionStreamChoice(
                                    index=completion.index, delta=DeltaMessage(tool_calls=[tool_delta])
                                )
                            )
                        if finishing and tool_stream.num_calls and finish_reason == "stop":
                            finish_reason = "tool_calls" if tool_stream.plan.mode != "named" else "stop"
                        if not text and not finishing and not request.logprobs:
                            continue
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=completion.index,
                            delta=DeltaMessage(content=text) if text or not finishing else DeltaMessage(),
                            logprobs=_chat_logprobs(new_ids, positions, top) if request.logprobs else None,
                            finish_reason=finish_reason,
                            stop_reason=completion.stop_reason,
                        )
                    )
            if include_usage and last is not None:
                yield sse(
                    ChatCompletionChunk(id=base_id, created=created, model=model.name, choices=[], usage=_usage([last]))
                )
        except Exception as err:  # noqa: BLE001 - report in-stream; the HTTP status is already sent
            logger.exception("chat stream %s failed", base_id)
            yield sse(_stream_error(err).to_response())
        finally:
            stream.abort()
        yield sse("[DONE]")


# ---------------------------------------------------------------------- helpers
class _ToolStream:
    """Tool calls of one streaming choice: turns its text deltas into content plus OpenAI's
    ``tool_calls`` deltas (a call's id, type and name first, then its arguments)."""

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan = plan
        self.active = plan.parses_calls
        self._auto = ToolCallStreamer(parser, plan.template_tools) if plan.mode == "auto" else None
        self._forced = ForcedCallStreamer() if plan.mode == "required" else None
        self.num_calls = 0

    def _deltas(self, calls: Sequence[Any]) -> list[DeltaToolCall]:
        deltas = []
        if not self.plan.parallel:
            calls = list(calls)[: max(0, 1 - self.num_calls)]
        for call in calls:
            index = self.num_calls
            self.num_calls += 1
            deltas.append(
                DeltaToolCall(
                    index=index,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(name=call.function.name, arguments=""),
                )
            )
            deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.function.arguments)))
        return deltas

    def feed(self, text: str, finishing: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content to stream now, tool-call deltas to send first)."""
        if self._auto is not None:
            event = self._auto.feed(text)
            content, calls = event.content, list(event.calls)
            if finishing:
                tail = self._auto.finish()
                content += tail.content
                calls += tail.calls
            return content, self._deltas(calls)
        if self.plan.mode == "named":  # the output is the arguments: stream them as they come
            deltas = []
            if self.num_calls == 0:
                self.num_calls = 1
                deltas.append(
                    DeltaToolCall(
                        index=0,
                        id=new_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=self.plan.named, arguments=""),
                    )
                )
            if text:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text)))
            return "", deltas
        return "", self._forced_deltas(text)

    def _forced_deltas(self, text: str) -> list[DeltaToolCall]:
        """required: each call's id and name once its name is complete, then its arguments as
        they are generated."""
        assert self._forced is not None
        deltas = []
        for index, name, arguments in self._forced.feed(text):
            if not self.plan.parallel and index > 0:
                break
            if name is not None:
                self.num_calls = index + 1
                function = DeltaFunctionCall(name=name, arguments="")
                deltas.append(DeltaToolCall(index=index, id=new_call_id(), type="function", function=function))
            if arguments:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))
        return deltas


def _stream_error(err: Exception) -> ServingError:
    """The error event that ends a stream: 503 if the engine is gone (its core process died),
    else 500."""
    if isinstance(err, EngineDeadError):
        return ServingError(503, str(err), type="ServiceUnavailableError")
    return ServingError(500, str(err), type="InternalServerError")


def _grammar_gate(engine: Any) -> GrammarGate | None:
    compiler = getattr(engine, "grammar_compiler", None)
    return GrammarGate(compiler) if compiler is not None and compiler.tokenizer is not None else None


def _logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if value is None:
        return None
    try:
        check_logit_bias(len(value))
    except LimitError as err:
        raise bad_request(str(err), "logit_bias") from None
    out = {}
    for key, bias in value.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def _dump(model: BaseModel, include_usage: bool) -> dict[str, Any]:
    """A chunk as JSON; ``usage`` appears (as null) only when the client asked for usage."""
    data = model.model_dump(mode="json")
    if not include_usage:
        data.pop("usage", None)
    for choice in data.get("choices", []):
        if "delta" in choice:  # OpenAI omits unset delta fields
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return data


def _usage(outputs: Any) -> UsageInfo:
    prompt_tokens = 0
    completion_tokens = 0
    for output in outputs:
        prompt_tokens += len(output.prompt_token_ids)
        completion_tokens += sum(len(c.token_ids) for c in output.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top: int) -> ChatChoiceLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        token = (chosen.decoded_token if chosen else None) or ""
        ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top), key=_rank)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=chosen.logprob if chosen else float("-inf"),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    ChatTopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode("utf-8")),
                    )
                    for lp in ranked
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)


def _rank(lp: Any) -> int:
    return lp.rank or 0
