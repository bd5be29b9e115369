"""Request fields of OpenAI and vLLM that qserve accepts although they do not change sampling,
and what it does with each (docs/server.md, "Accepted fields", says the same for users).

Knows: which fields are honoured and how (``reasoning_effort`` -> the chat template's
thinking switch), and which are accepted and ignored, with the reason. Must not know: HTTP,
engines, tokenizers.

- ``reasoning_effort``: honoured for chat templates with a thinking switch (Qwen3 style):
  ``enable_thinking`` is ``False`` for ``"none"`` / ``"minimal"`` and ``True`` otherwise, and
  ``reasoning_effort`` itself is handed to the template too (templates that read it, such as
  gpt-oss's, use it). An ``enable_thinking`` in ``chat_template_kwargs`` wins.
- ``prompt_cache_key``: a routing hint for OpenAI's cache; ignored (prefix caching here is
  automatic, keyed by the prompt's tokens).
- ``modalities``: only ``["text"]`` is accepted (anything else is a 400 from the schema).
- ``priority`` (vLLM): ignored; the scheduler is first-come, first-served (with tenant weights).
- ``guided_decoding_backend`` (vLLM): ignored; qserve has one structured-output backend.
- ``store``, ``metadata``, ``service_tier``, ``verbosity``, ``safety_identifier``, ``user``:
  ignored (nothing is stored; there are no tiers; the length of an answer is the model's).
"""

from __future__ import annotations

from typing import Any

# reasoning_effort values that turn a template's thinking off.
NO_THINKING_EFFORTS = frozenset({"none", "minimal"})


def template_switches(request: Any) -> dict[str, Any]:
    """Chat-template variables implied by the request's accepted fields (``reasoning_effort``).
    The caller lets the request's own ``chat_template_kwargs`` override them."""
    effort = getattr(request, "reasoning_effort", None)
    if effort is None:
        return {}
    return {"enable_thinking": effort not in NO_THINKING_EFFORTS, "reasoning_effort": effort}
