"""Running batches: one task per batch in the serving task group (AppState.tasks), started at create and, for the
batches a restart left unfinished, once the model serves. Its lines go through the online routes' endpoints
(call.py) at the lowest priority, at most --batch-max-in-flight at once over all batches, and a new line starts
only while no interactive request is in flight (batches use the idle time), so that interactive requests keep
their latency. Each answer is appended to the batch's results before the next count is saved, so a
restart runs only the lines not answered yet. A cancel stops the batch's task; what was answered is kept.

One process runs a folder's batches: the first to take its lock (disk.py claim) once its model serves. Other API
processes (--api-server-count) and other servers on the same folder store, list and cancel; the owner's watcher
picks their batches up."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from server.app_state import AppState
from server.families.batch.call import Endpoint, call
from server.families.batch.disk import claim, new_id
from server.families.batch.files import FileStore
from server.families.batch.lines import BadLine, Line, read_lines
from server.families.batch.store import FINAL, BatchStore
from server.http.errors import APIError

BATCH_PRIORITY = 1 << 30  # the engine runs lower values first (--scheduling-policy priority): batch lines last
WATCH_S = 1.0  # how often the folder's owner looks for batches other processes created or cancelled
QUIET_S = 0.05  # how often a line waiting for the interactive requests to end looks again


class BatchRunner:
    def __init__(self, state: AppState, root: Path, endpoints: dict[str, Endpoint]) -> None:
        self.state = state
        self.files, self.store = FileStore(root), BatchStore(root)
        self.endpoints = endpoints
        self.slots = anyio.Semaphore(state.config.batch.batch_max_in_flight)
        self.running = 0  # this runner's lines inside the online endpoints now
        self.lock = anyio.Lock()  # one read-modify-write of a batch object at a time
        self.scopes: dict[str, anyio.CancelScope] = {}  # this process's running batches by id
        self.root, self.owner = root, False  # owner: this process holds the folder's lock and runs its batches
        state.on_ready.append(self._on_ready)

    def _on_ready(self) -> None:
        if self.state.tasks is not None and claim(self.root):
            self.owner = True
            self.state.tasks.start_soon(self._watch)

    async def _watch(self) -> None:
        """The owner of the batch folder runs its unfinished batches: those a restart left, and those created or
        cancelled by another API process (--api-server-count), which it finds here within WATCH_S."""
        while True:
            for batch in await anyio.to_thread.run_sync(self.store.unfinished):
                scope = self.scopes.get(batch["id"])
                if scope is None:
                    self.start(batch["id"])
                elif batch["status"] == "cancelling":
                    scope.cancel()
            await anyio.sleep(WATCH_S)

    def start(self, batch_id: str) -> None:
        """Run the batch in the serving task group, in the process that owns the folder (else its watcher will)."""
        tasks = self.state.tasks
        if tasks is None or not self.owner or batch_id in self.scopes or self.state.stopping.is_set():
            return
        scope = self.scopes[batch_id] = anyio.CancelScope()
        tasks.start_soon(self._run, batch_id, scope)

    async def _run(self, batch_id: str, scope: anyio.CancelScope) -> None:
        try:
            with scope:
                await self._run_batch(batch_id)
            if scope.cancel_called:  # a cancel: keep what was answered
                await self._finalize(batch_id, "cancelled")
        finally:  # only now may the watcher start it again
            self.scopes.pop(batch_id, None)

    async def _run_batch(self, batch_id: str) -> None:
        batch = await self._read(batch_id)
        if batch["status"] == "cancelling":
            await self._finalize(batch_id, "cancelled")
            return
        try:
            data = await anyio.to_thread.run_sync(self.files.read, batch["input_file_id"])
        except APIError as e:
            await self._fail(batch_id, "invalid_file", e.message)
            return
        good, bad = await anyio.to_thread.run_sync(read_lines, data, batch["endpoint"])
        if batch["status"] == "validating":
            if not good and not bad:
                await self._fail(batch_id, "empty_file", "The input file has no requests.")
                return
            await self._start_lines(batch_id, good, bad)
        if (await self._read(batch_id))["status"] == "in_progress":
            await self._run_lines(batch_id, batch["endpoint"], good)
        if not self.state.stopping.is_set():
            await self._finalize(batch_id, "completed")

    async def _start_lines(self, batch_id: str, good: list[Line], bad: list[BadLine]) -> None:
        """validating -> in_progress: the bad lines written to the error results, the counts set."""

        def write() -> None:
            self.store.reset_results(batch_id)
            for line in bad:
                error = {"code": line.code, "message": line.message}
                record = {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None, "error": error}
                self.store.append(batch_id, True, record)

        await anyio.to_thread.run_sync(write)
        errors = {"object": "list", "data": [line.error() for line in bad]} if bad else None
        counts = {"total": len(good) + len(bad), "completed": 0, "failed": len(bad)}
        await self._update(
            batch_id, status="in_progress", in_progress_at=int(time.time()), request_counts=counts, errors=errors
        )

    async def _run_lines(self, batch_id: str, endpoint: str, lines: list[Line]) -> None:
        done, completed, failed = await anyio.to_thread.run_sync(self.store.answered, batch_id)
        async with self.lock:  # the results are the truth: a stop between an append and its count left it behind
            batch = await self._read(batch_id)
            batch["request_counts"].update(completed=completed, failed=failed)
            await anyio.to_thread.run_sync(self.store.save, batch)
        async with anyio.create_task_group() as tg:
            for line in lines:
                if line.custom_id in done:
                    continue
                await self.slots.acquire()
                await self._wait_for_quiet()
                if self.state.stopping.is_set():  # shutting down: the rest runs after the restart
                    self.slots.release()
                    break
                tg.start_soon(self._line, batch_id, endpoint, line)

    async def _wait_for_quiet(self) -> None:
        """Until no interactive request is in flight: every generate call in flight beyond this runner's lines is
        one (a line already running goes on; a new one waits)."""
        while (llm := self.state.llm) is not None and llm.num_active > self.running:
            if self.state.stopping.is_set():
                return
            await anyio.sleep(QUIET_S)

    async def _line(self, batch_id: str, endpoint: str, line: Line) -> None:
        self.running += 1
        try:
            body = line.body
            if self.state.config.scheduling.scheduling_policy == "priority" and "priority" not in body:
                body = {**body, "priority": BATCH_PRIORITY}
            request_id = new_id("batch_req_")
            status, answer = await call(self.endpoints[endpoint], endpoint, json.dumps(body).encode(), request_id)
        finally:
            self.running -= 1
            self.slots.release()
        if status != 200 and self.state.stopping.is_set():  # cut by the shutdown: it runs again after the restart
            return
        response = {"status_code": status, "request_id": request_id, "body": answer}
        record = {"id": request_id, "custom_id": line.custom_id, "response": response, "error": None}
        await anyio.to_thread.run_sync(self.store.append, batch_id, status != 200, record)
        async with self.lock:
            batch = await self._read(batch_id)
            batch["request_counts"]["completed" if status == 200 else "failed"] += 1
            await anyio.to_thread.run_sync(self.store.save, batch)

    async def _finalize(self, batch_id: str, final: str) -> None:
        """The results become files (purpose batch_output) and the batch `final`."""
        if final == "completed":
            await self._update(batch_id, status="finalizing", finalizing_at=int(time.time()))

        def adopt() -> dict[str, Any]:
            _done, completed, failed = self.store.answered(batch_id)
            ids: dict[str, Any] = {}
            for key, suffix in (("output_file_id", ".out.jsonl"), ("error_file_id", ".err.jsonl")):
                path = self.store.path(batch_id, suffix)
                if path.exists() and path.stat().st_size:
                    ids[key] = self.files.adopt(path, f"{batch_id}{suffix}", "batch_output")["id"]
                else:
                    path.unlink(missing_ok=True)
            return {"completed": completed, "failed": failed, **ids}

        with anyio.CancelScope(shield=True):  # the files moved must be named in the batch
            found = await anyio.to_thread.run_sync(adopt)
            batch = await self._read(batch_id)
            counts = {**batch["request_counts"], "completed": found.pop("completed"), "failed": found.pop("failed")}
            await self._update(
                batch_id, status=final, request_counts=counts, **{f"{final}_at": int(time.time())}, **found
            )

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": "input_file_id", "line": None}
        await self._update(
            batch_id, status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [error]}
        )

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        async with self.lock:
            batch = await self._read(batch_id)
            if batch["status"] in FINAL or batch["status"] == "cancelling":
                if batch["status"] in ("cancelled", "cancelling"):
                    return batch
                raise APIError(f"Cannot cancel a batch with status {batch['status']}.", status=400)
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            await anyio.to_thread.run_sync(self.store.save, batch)
        scope = self.scopes.get(batch_id)
        if scope is not None:
            scope.cancel()
        else:
            self.start(batch_id)  # not running here: its task only finalizes it
        return batch

    async def _read(self, batch_id: str) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(self.store.get, batch_id)

    async def _update(self, batch_id: str, **fields: Any) -> None:
        async with self.lock:
            batch = await self._read(batch_id)
            batch.update(fields)
            await anyio.to_thread.run_sync(self.store.save, batch)
