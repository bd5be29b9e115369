"""The app's state: what every route needs once the models are loaded (the engine host, the
OpenAI serving layer, metrics, the request log, the drain, tenants).

Knows: which objects make up a serving app and how they are tied together when the engine
host is attached. Must not know: routes, paths, HTTP bodies (each surface's module), how the
app is built (``app``).
"""

from __future__ import annotations

import asyncio

from qserve.engine.async_engine import AsyncEngine, Listeners
from qserve.server.drain import DrainState
from qserve.server.generation_config import apply_sampling_defaults
from qserve.server.metrics import ServerMetrics
from qserve.server.protocol import ChatCompletionRequest, CompletionRequest
from qserve.server.request_log import RequestLog
from qserve.server.serving import OpenAIServing
from qserve.server.tenancy import TenantGate
from qserve.tenants import Tenants


class AppState:
    """What the routes need; filled in when the models are loaded."""

    def __init__(
        self,
        api_key: str | None,
        tenants: Tenants | None = None,
        *,
        log_requests: bool = True,
        metrics_dir: str | None = None,
    ) -> None:
        self.api_key = api_key
        self.host: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: str | None = None
        self.metrics = ServerMetrics(lambda: self.host, multiprocess_dir=metrics_dir)
        self.request_log = RequestLog(log_requests=log_requests)
        self.drain = DrainState()
        self.tool_call_parser: str | None = None  # None: from each model's chat template
        # Tenants (API key -> tenant, admission, per-tenant metrics); None: no tenants.
        self.tenants = tenants
        self.tenant_gate = TenantGate(tenants, self.metrics.registry) if tenants is not None else None

    def attach(self, host: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        host.listener = Listeners(self.metrics, self.request_log)
        host.start(loop)
        if self.tenants is not None:  # the schedulers share seats by tenant weight
            for hosted in host.models.values():
                hosted.engine.scheduler.set_tenants(self.tenants.weights, self.tenants.max_running)
        self.serving = OpenAIServing(host, self.tool_call_parser, tenant_gate=self.tenant_gate)
        self.host = host

    def apply_sampling_defaults(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        name = body.model
        if self.serving is not None:
            self.serving.sync_lora_models()  # an engine core's news of another front end's change
        if self.serving is not None and name in self.serving.lora_models:  # an adapter: its base's defaults
            name = self.serving.lora_models[name].host_name
        hosted = self.host.models.get(name) if self.host is not None else None
        if hosted is not None and hosted.sampling_defaults:
            apply_sampling_defaults(body, hosted.sampling_defaults)

    @property
    def ready(self) -> bool:
        return self.host is not None and self.serving is not None and self.host.is_running

    @property
    def not_ready_reason(self) -> str | None:
        """Why the server cannot serve, when it is known: the models did not load, or the engine
        died (``dead_reason``: the engine core's own process is gone)."""
        return self.load_error or getattr(self.host, "dead_reason", None)
