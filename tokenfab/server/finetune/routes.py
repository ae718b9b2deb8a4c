"""The ``/v1/fine_tuning/jobs`` routes and ``FineTuningService``, which shares the Files/Batches database and file
store (``BatchService``) and owns the job worker. A finished LoRA job's adapter is registered with the server's
LoRA registry (``--enable-lora``) under ``ft:<base>:<suffix>:<job id>``, so ``/v1/models`` lists it with
``parent`` = the base model and requests may name it at once."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, StrictInt

from tokenfab.server.batch.routes import BatchService
from tokenfab.server.finetune.config import FineTuningConfig
from tokenfab.server.finetune.jobs import JobStore
from tokenfab.server.finetune.worker import JobWorker
from tokenfab.server.responses import ErrorResponse
from tokenfab.server.serving import OpenAIServer


class CreateFineTuningJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    training_file: str
    validation_file: str | None = None
    method: dict[str, Any] | None = None
    hyperparameters: dict[str, Any] | None = None  # the legacy place of method.supervised.hyperparameters
    suffix: str | None = None
    seed: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    integrations: list[Any] | None = None  # accepted and ignored (no Weights & Biases here)


_DESCRIPTIONS = {400: "Invalid request (OpenAI error body; `param` names the field)", 401: "Missing or wrong API key",
                 404: "No such fine-tuning job or file", 409: "The job has finished"}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


class FineTuningService:
    def __init__(self, server: OpenAIServer, batches: BatchService, config: FineTuningConfig) -> None:
        self.server = server
        self.jobs = JobStore(batches.db, batches.files, server.model_name)
        self.worker = JobWorker(batches.db, batches.files, config, server.model_name, self.serve_adapter) \
            if config.worker else None

    def serve_adapter(self, name: str, path: str) -> str | None:
        """Serve a finished job's adapter under ``name``; None when served, else why not (for the job's event)."""
        loras = self.server.loras
        if not loras.enabled:
            return (f"The server runs without --enable-lora: the adapter is stored at {path} but not served; "
                    f"restart the server with --enable-lora to serve it as {name}")
        if name in loras.adapters:
            return None
        try:
            loras.add(name, path)
        except (ValueError, KeyError) as e:
            return f"The adapter at {path} could not be served: {e}"
        return None

    def start(self) -> None:
        if self.worker is not None and not self.worker.started:
            self.worker.start()

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()

    async def create(self, body: CreateFineTuningJobRequest) -> dict[str, Any]:
        self.start()
        job = await self.jobs.create(body.model_dump(exclude={"integrations"}))
        if self.worker is not None:
            self.worker.wake()
        return job


def add_routes(app: FastAPI, service: FineTuningService, auth: tuple[int, ...]) -> None:
    """Register /v1/fine_tuning/jobs (POST, GET), /{id} (GET), /{id}/cancel (POST), /{id}/events and
    /{id}/checkpoints (GET)."""

    @app.post("/v1/fine_tuning/jobs", responses=_errors(400, *auth, 404))
    async def create_job(body: CreateFineTuningJobRequest) -> dict[str, Any]:
        return await service.create(body)

    @app.get("/v1/fine_tuning/jobs", responses=_errors(400, *auth))
    async def list_jobs(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                        after: str | None = None) -> dict[str, Any]:
        service.start()
        metadata = {k[len("metadata["):-1]: v for k, v in request.query_params.items()
                    if k.startswith("metadata[") and k.endswith("]")}
        return await service.jobs.list_jobs(limit, after, metadata or None)

    @app.get("/v1/fine_tuning/jobs/{job_id}", responses=_errors(*auth, 404))
    async def retrieve_job(job_id: str) -> dict[str, Any]:
        service.start()
        return await service.jobs.retrieve(job_id)

    @app.post("/v1/fine_tuning/jobs/{job_id}/cancel", responses=_errors(*auth, 404, 409))
    async def cancel_job(job_id: str) -> dict[str, Any]:
        job = await service.jobs.cancel(job_id)
        if service.worker is not None:
            service.worker.wake()
        return job

    @app.get("/v1/fine_tuning/jobs/{job_id}/events", responses=_errors(400, *auth, 404))
    async def list_events(job_id: str, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                          after: str | None = None) -> dict[str, Any]:
        return await service.jobs.events(job_id, limit, after)

    @app.get("/v1/fine_tuning/jobs/{job_id}/checkpoints", responses=_errors(400, *auth, 404))
    async def list_checkpoints(job_id: str, limit: Annotated[int, Query(ge=1, le=100)] = 10,
                               after: str | None = None) -> dict[str, Any]:
        return await service.jobs.checkpoints(job_id, limit, after)

