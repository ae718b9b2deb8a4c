"""Request fields that the fleet's routers add to every request they forward, and what each one does here.

``vllm-router`` and ``sglang-router`` (the Rust routers from PyPI) build their own request objects and send every
field of them to the worker, SGLang's extensions included, with their default values. A server that refuses unknown
fields (ours does: a typo such as ``max_token`` is a 400, never silently ignored) would then refuse every request
behind a router. So these fields are known here, each with its type checked strictly like any other field, and
each decided on its own:

- ``no_stop_trim`` (both routers): honoured; true keeps the matched stop string in the output (SGLang's meaning,
  the same as ``include_stop_str_in_output``).
- ``return_hidden_states`` (both): false accepted; true is a 400 (this server returns no hidden states, and a
  client that asks for them must not get a silent nothing).
- ``separate_reasoning`` (both, chat): honoured; false leaves the reasoning inline in ``content`` (no parser).
- ``stream_reasoning`` (both, chat): accepted; reasoning is always streamed as it comes (false is logged and
  ignored: the text is the same, only its chunking differs).
- ``include_reasoning`` (vllm-router, chat): honoured; false drops ``reasoning_content`` / ``reasoning``.
- ``kv_transfer_params`` (vllm-router's ``--vllm-pd-disaggregation``, vLLM's field): honoured by an instance started
  with ``--kv-transfer-config`` (prefill/decode disaggregation); others refuse it with a 400.

Any other unknown field is still a 400 that names it (``protocol.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

logger = logging.getLogger("tokenfab.server")


class RouterFields(BaseModel):
    """The router-added fields of every generation request (completions and chat)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    no_stop_trim: bool = Field(default=False, description="router/SGLang extra: keep the matched stop string in "
                               "the output (the same as include_stop_str_in_output)")
    return_hidden_states: bool = Field(default=False, description="router/SGLang extra: must be false (hidden "
                                       "states are not returned)")
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, description="vllm-router --vllm-pd-disaggregation / vLLM: prefill/decode disaggregation "
        "(docs/fleet.md); checked by the engine, refused by an instance started without --kv-transfer-config")

    @field_validator("return_hidden_states")
    @classmethod
    def _no_hidden_states(cls, value: bool) -> bool:
        if value:
            raise ValueError("this server does not return hidden states: return_hidden_states must be false")
        return value


class ChatRouterFields(RouterFields):
    """The router-added fields of chat requests (reasoning output)."""

    separate_reasoning: bool = Field(default=True, description="router/SGLang extra: false leaves the reasoning "
                                     "inline in content")
    stream_reasoning: bool = Field(default=True, description="router/SGLang extra: accepted; reasoning is always "
                                   "streamed incrementally")
    include_reasoning: bool = Field(default=True, description="router/vLLM extra: false drops reasoning_content "
                                    "from the answer")

    @field_validator("stream_reasoning")
    @classmethod
    def _log_stream_reasoning(cls, value: bool) -> bool:
        if not value:
            logger.info("stream_reasoning=false ignored: reasoning is streamed incrementally")
        return value


REASONING_KEYS = ("reasoning_content", "reasoning")


def without_reasoning(message: dict) -> dict:
    """``message`` (a chat message or a stream delta) without its reasoning keys (``include_reasoning`` false)."""
    return {k: v for k, v in message.items() if k not in REASONING_KEYS}
