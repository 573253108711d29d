"""/v1/files (upload, list, retrieve, content, delete) and /v1/batches (create, list, retrieve, cancel)."""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from starlette.datastructures import UploadFile
from starlette.requests import Request

from server.app_state import decode_body
from server.families.batch.disk import MAX_LIST, query_limit
from server.families.batch.protocol import create_decoder, query
from server.families.batch.runner import BatchRunner
from server.families.batch.store import new_batch
from server.http.asgi import Message, Receive, Scope, Send, header, read_json_body, send_error, send_json
from server.http.errors import APIError

MULTIPART_SLACK = 64 << 10  # the form's own bytes around the file: boundaries, headers, the purpose field


def _enc(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def _too_large(limit: int) -> APIError:
    return APIError(
        f"The file is larger than {limit} bytes (--batch-max-file-bytes); upload a smaller one.", status=413
    )


class FilesRoute:
    """POST /v1/files (multipart: `file`, `purpose`), GET /v1/files (purpose, after, limit, order)."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.limit = runner.state.config.batch.batch_max_file_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["method"] == "GET":
                q = query(scope)
                limit = query_limit(q, MAX_LIST, MAX_LIST)
                ascending = q.get("order", "desc") == "asc"
                page = await anyio.to_thread.run_sync(
                    self.runner.files.listing, q.get("purpose"), q.get("after"), limit, ascending
                )
                await send_json(send, 200, _enc(page))
                return
            await send_json(send, 200, _enc(await self._upload(scope, receive)))
        except APIError as e:
            await send_error(send, e)

    async def _upload(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit + MULTIPART_SLACK:
            raise _too_large(self.limit)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit + MULTIPART_SLACK:
                raise _too_large(self.limit)
            return message

        try:
            form = await Request(scope, counted).form()
        except APIError:
            raise
        except Exception as e:  # starlette's parser: a malformed form
            raise APIError(f"The upload must be a multipart form with `file` and `purpose`: {e}") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise APIError("The form has no `file` part.", param="file")
        if purpose != "batch":
            raise APIError(f"purpose must be 'batch'; got {purpose!r}", param="purpose")
        data = await upload.read()
        if len(data) > self.limit:
            raise _too_large(self.limit)
        return await anyio.to_thread.run_sync(self.runner.files.save, data, upload.filename or "upload.jsonl", purpose)


class FileRoute:
    """GET and DELETE /v1/files/{file_id}; GET /v1/files/{file_id}/content (`content`)."""

    def __init__(self, runner: BatchRunner, content: bool = False) -> None:
        self.runner, self.content = runner, content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        file_id = scope["path_params"]["file_id"]
        files = self.runner.files
        try:
            if self.content:
                data = await anyio.to_thread.run_sync(files.read, file_id)
                headers = [(b"content-type", b"application/jsonl"), (b"content-length", str(len(data)).encode())]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": data})
                return
            method = files.delete if scope["method"] == "DELETE" else files.get
            await send_json(send, 200, _enc(await anyio.to_thread.run_sync(method, file_id)))
        except APIError as e:
            await send_error(send, e)


class BatchesRoute:
    """POST /v1/batches (create), GET /v1/batches (after, limit)."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["method"] == "GET":
                q = query(scope)
                limit = query_limit(q, 20, 100)
                page = await anyio.to_thread.run_sync(self.runner.store.listing, q.get("after"), limit)
                await send_json(send, 200, _enc(page))
                return
            body = await read_json_body(scope, receive, self.runner.state.config.http.max_request_body)
            await send_json(send, 200, _enc(await self._create(body)))
        except APIError as e:
            await send_error(send, e)

    async def _create(self, body: bytes) -> dict[str, Any]:
        req = decode_body(create_decoder, body)
        req.check()
        runner = self.runner
        try:
            source = await anyio.to_thread.run_sync(runner.files.get, req.input_file_id)
        except APIError as e:
            raise APIError(e.message, status=400, param="input_file_id") from None
        if source["purpose"] != "batch":
            raise APIError(
                f"File {req.input_file_id} has purpose {source['purpose']!r}, not 'batch'.", param="input_file_id"
            )
        batch = new_batch(req.input_file_id, req.endpoint, req.completion_window, req.metadata)
        await anyio.to_thread.run_sync(runner.store.save, batch)
        runner.start(batch["id"])
        return batch


class BatchRoute:
    """GET /v1/batches/{batch_id}; POST /v1/batches/{batch_id}/cancel (`cancel`)."""

    def __init__(self, runner: BatchRunner, cancel: bool = False) -> None:
        self.runner, self.cancel = runner, cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        batch_id = scope["path_params"]["batch_id"]
        try:
            if self.cancel:
                batch = await self.runner.cancel(batch_id)
            else:
                batch = await anyio.to_thread.run_sync(self.runner.store.get, batch_id)
            await send_json(send, 200, _enc(batch))
        except APIError as e:
            await send_error(send, e)
