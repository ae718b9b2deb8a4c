"""The ``/v1/files`` and ``/v1/batches`` routes and ``BatchService``, which owns their database, file store and
worker for the app's lifetime. Uploads bypass the app-wide body limit (``--max-request-bytes``) and have their own
(``--max-file-bytes``), counted on the bytes as they arrive: a 413 with OpenAI's error body."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile
from starlette.types import Message

from tokenfab.server.batch.batches import BatchStore
from tokenfab.server.batch.config import BatchConfig
from tokenfab.server.batch.db import Database
from tokenfab.server.batch.dispatch import LineRunner
from tokenfab.server.batch.files import PURPOSES, UPLOAD_PURPOSES, FileStore, file_object
from tokenfab.server.batch.worker import BatchWorker
from tokenfab.server.errors import APIError
from tokenfab.server.limits import DRAIN_LIMIT_BYTES
from tokenfab.server.responses import ErrorResponse
from tokenfab.server.responses_store import ResponseStore
from tokenfab.server.serving import OpenAIServer

MULTIPART_SLACK = 64 << 10  # boundaries and part headers around the file's own bytes
UPLOAD_PATH = "/v1/files"


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; result files are kept until deleted


_DESCRIPTIONS = {400: "Invalid request (OpenAI error body; `param` names the field)", 401: "Missing or wrong API key",
                 404: "No such file or batch", 409: "The file or batch is in a state that forbids this",
                 413: "File larger than --max-file-bytes"}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


class _TooLarge(Exception):
    pass


class BatchService:
    def __init__(self, server: OpenAIServer, config: BatchConfig, responses_store: ResponseStore | None) -> None:
        config.check()
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.db = Database(config.url)
        self.files = FileStore(self.db, config.data_dir)
        self.batches = BatchStore(self.db, self.files, server.model_name)
        runner = LineRunner(server, responses_store)
        self.worker = BatchWorker(self.db, self.files, runner, config) if config.worker else None

    def start(self) -> None:
        """Start the worker (the app's lifespan does, so that unfinished batches resume at once; an app served
        without its lifespan starts it at its first Files/Batches request)."""
        if self.worker is not None and not self.worker.started:
            self.worker.start()

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
        self.db.close()

    async def upload(self, request: Request) -> dict[str, Any]:
        self.start()
        limit = self.config.max_file_bytes
        declared = request.headers.get("content-length", "")
        too_large = APIError(413, f"The file is too large; this server accepts files of at most {limit} bytes "
                             "(--max-file-bytes)", param="file", code="file_too_large")
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await request.receive()
            received += len(message.get("body", b""))
            if received > limit + MULTIPART_SLACK:
                raise _TooLarge
            return message

        try:
            if declared.isdigit() and int(declared) > limit + MULTIPART_SLACK:
                raise _TooLarge
            form = await Request(request.scope, counted).form(max_files=1, max_fields=8)
        except _TooLarge:
            await _drain(request, received)
            raise too_large from None
        try:
            file, purpose = form.get("file"), form.get("purpose")
            if not isinstance(file, UploadFile):
                raise APIError(400, "a multipart/form-data body with a 'file' part is required", param="file")
            if purpose not in UPLOAD_PURPOSES:
                raise APIError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}", param="purpose")
            if file.size is not None and file.size > limit:
                raise too_large
            row = await self.files.add(file.file, file.filename or "upload", str(purpose))
        finally:
            await form.close()
        return file_object(row)

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        batch = await self.batches.in_use(file_id)
        if batch is not None:
            raise APIError(409, f"File {file_id} is the input of batch {batch}, which has not finished",
                           param="file_id", code="file_in_use")
        return await self.files.delete(file_id)

    async def create_batch(self, body: CreateBatchRequest) -> dict[str, Any]:
        self.start()
        batch = await self.batches.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
        if self.worker is not None:
            self.worker.wake()
        return batch

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        batch = await self.batches.cancel(batch_id)
        if self.worker is not None:
            self.worker.wake(cancelled=batch_id)
        return batch


async def _drain(request: Request, received: int) -> None:
    """Read and drop the rest of a refused upload (up to a bound), so the client sees the 413."""
    with_more = True
    while with_more and received <= DRAIN_LIMIT_BYTES:
        message = await request.receive()
        if message["type"] != "http.request":
            return
        received += len(message.get("body", b""))
        with_more = message.get("more_body", False)


def add_routes(app: FastAPI, service: BatchService, auth: tuple[int, ...]) -> None:
    """Register /v1/files (POST, GET, GET/DELETE {id}, GET {id}/content) and /v1/batches (POST, GET, GET {id},
    POST {id}/cancel)."""
    upload_doc = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"},
                       "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)}}}}}}}

    @app.post(UPLOAD_PATH, responses=_errors(400, *auth, 413), openapi_extra=upload_doc)
    async def upload_file(request: Request) -> dict[str, Any]:
        return await service.upload(request)

    @app.get("/v1/files", responses=_errors(400, *auth))
    async def list_files(purpose: Literal[PURPOSES] | None = None,  # type: ignore[valid-type]
                         limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
                         order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict[str, Any]:
        return await service.files.list_files(purpose, limit, order, after)

    @app.get("/v1/files/{file_id}", responses=_errors(*auth, 404))
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        return file_object(await service.files.get(file_id))

    @app.get("/v1/files/{file_id}/content", response_class=FileResponse, responses=_errors(*auth, 404))
    async def file_content(file_id: str) -> FileResponse:
        row = await service.files.get(file_id)
        return FileResponse(service.files.path_of(row), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", responses=_errors(*auth, 404, 409))
    async def delete_file(file_id: str) -> dict[str, Any]:
        return await service.delete_file(file_id)

    @app.post("/v1/batches", responses=_errors(400, *auth, 404))
    async def create_batch(body: CreateBatchRequest) -> dict[str, Any]:
        return await service.create_batch(body)

    @app.get("/v1/batches", responses=_errors(400, *auth))
    async def list_batches(limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           after: str | None = None) -> dict[str, Any]:
        return await service.batches.list_batches(limit, after)

    @app.get("/v1/batches/{batch_id}", responses=_errors(*auth, 404))
    async def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return await service.batches.retrieve(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", responses=_errors(*auth, 404, 409))
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return await service.cancel_batch(batch_id)
