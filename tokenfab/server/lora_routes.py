"""vLLM's runtime LoRA endpoints, present when the server runs with ``--enable-lora``:

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: 200 with a plain-text "Success: ..." line;
  400 (OpenAI error body) for a missing field, a name already loaded, a path without a PEFT adapter, a
  rank above ``--max-lora-rank``.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 200 "Success: ..."; 404 for an unknown name. Requests
  already running with it finish with it; new ones get 400 model_not_found.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tokenfab.server.errors import APIError
from tokenfab.server.responses import error_responses
from tokenfab.server.serving import OpenAIServer


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


def add_routes(app: FastAPI, server: OpenAIServer) -> None:
    """The two endpoints, only under ``--enable-lora`` (without it they are 404, as in vLLM)."""
    if not server.loras.enabled:
        return
    loras = server.loras

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Any:
        if body.lora_name in loras.adapters:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name",
                           code="lora_adapter_exists")
        try:  # reads the adapter's config from disk: off the event loop
            await asyncio.to_thread(loras.check_adapter, body.lora_name, body.lora_path)
            loras.add(body.lora_name, body.lora_path)
        except KeyError:  # loaded meanwhile by a concurrent call
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name",
                           code="lora_adapter_exists") from None
        except ValueError as e:
            param = "lora_name" if str(e).startswith("lora_name") else "lora_path"
            raise APIError(400, f"Loading lora {body.lora_name!r} failed: {e}", param=param,
                           code="invalid_lora_adapter") from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 404))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Any:
        try:
            loras.remove(body.lora_name)
        except KeyError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="lora_adapter_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
