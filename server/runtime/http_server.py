"""One serving process: Hypercorn serving create_app's app until a signal (exit 0) or the engine dies (exit 1).

`spindle serve` runs it in the process the user started; each API process of --api-server-count runs it
with its WorkerContext (server/runtime/api_process.py). SIGTERM drains: new requests get 503, in-flight ones
have --shutdown-timeout seconds to finish, the rest end with an error. A second SIGTERM, or a SIGINT, stops
at once (requests cut the same way).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
from hypercorn.asyncio import serve as hypercorn_asyncio_serve
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_trio_serve

from server.app import create_app
from server.app_load import EngineFactory
from server.config import ServerConfig
from server.fleet.front import create_models_app
from server.http import direct_body
from server.http.errors import describe_exception
from server.request.async_llm import AsyncLLM
from server.runtime.hypercorn_config import hypercorn_config
from server.runtime.logs import setup_logging
from server.worker_context import WorkerContext

log = logging.getLogger("spindle.server")


class _Serving(Protocol):
    """What the shutdown needs of the app's state: its AsyncLLM, once loaded (the routes stay out of runtime/)."""

    @property
    def llm(self) -> AsyncLLM | None: ...


class _Shutdown:
    """How the process stops: SIGTERM drains, then stops; a second SIGTERM or a SIGINT cuts; a death exits 1."""

    def __init__(self, config: ServerConfig, hc: Config) -> None:
        self.config, self.hc = config, hc
        self.stop = anyio.Event()  # Hypercorn's shutdown trigger
        self.code = 0
        self.state: _Serving | None = None  # the app's state (server/app_state.py AppState), once built
        self.listening = anyio.CancelScope()  # the signal watcher's own scope: cancelling it touches nothing else

    def fatal(self, why: str) -> None:
        """The app's on_fatal: the engine died (or the model did not load)."""
        self.code = 1
        self.stop.set()

    async def drain_then_stop(self) -> None:
        llm = self.state.llm if self.state is not None else None
        timeout = self.config.http.shutdown_timeout
        if llm is not None:
            log.info(
                "SIGTERM: refusing new requests; %d in flight get up to %g s (SIGTERM again: stop now)",
                llm.num_active,
                timeout,
            )
            cut = await llm.drain(timeout)
            if cut:
                log.warning("cut %d requests still running after --shutdown-timeout %g s", cut, timeout)
        self.stop.set()

    def stop_now(self) -> None:
        llm = self.state.llm if self.state is not None else None
        if llm is not None:
            llm.cut("The server was stopped before this request finished; retry against another instance.")
        self.hc.graceful_timeout = 0.3  # read when Hypercorn stops: cut streams need only their last write
        self.stop.set()

    async def watch_signals(self) -> None:
        with self.listening:
            async with anyio.create_task_group() as tg:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                    # blocked in an API process the launcher started (runtime/launcher.py): held ones arrive now
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
                    draining = False
                    async for signum in received:
                        if signum == signal.SIGTERM and not draining:
                            draining = True
                            tg.start_soon(self.drain_then_stop)
                        else:
                            log.info("stopping now")
                            self.stop_now()
                            return


class _RunningOnWhenReady(logging.Filter):
    """Hypercorn logs "Running on ..." once its listener is up, while the model may still be loading (/health
    answers 503 with the stage then): the line is held until the app serves, and dropped if the start failed."""

    def __init__(self, shutdown: _Shutdown) -> None:
        super().__init__()
        self.shutdown = shutdown
        self.ready = False
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Running on"):
            return True
        if self.shutdown.code:
            return False
        if not self.ready:
            self.held.append(record)
        return self.ready

    def release(self) -> None:
        """The app serves: the held line now (an AppState.on_ready hook)."""
        self.ready = True
        held, self.held = self.held, []
        for record in held:
            logging.getLogger(record.name).handle(record)


async def _hypercorn_serve(
    app: Any, hc: Config, worker_class: str, shutdown_trigger: Callable[[], Awaitable[Any]]
) -> None:
    if worker_class == "trio":
        await hypercorn_trio_serve(app, hc, shutdown_trigger=shutdown_trigger)
    else:
        await hypercorn_asyncio_serve(app, hc, shutdown_trigger=shutdown_trigger)


async def serve(
    config: ServerConfig, engine_factory: EngineFactory | None = None, worker: WorkerContext | None = None
) -> int:
    """Serve until a signal (exit 0) or the engine dies (exit 1).

    engine_factory: a stand-in for the engine subprocess (bench.frontend's fake engine); None: the real one.
    worker: this process's place under the --api-server-count launcher; None: a single server.
    """
    hc = hypercorn_config(config, worker)
    shutdown = _Shutdown(config, hc)
    make_app = create_models_app if config.models.models_dir is not None else create_app  # one model or a folder
    app = make_app(
        config, worker=worker, on_fatal=shutdown.fatal, load_in_background=True, engine_factory=engine_factory
    )
    shutdown.state = app.state_holder
    quiet, error_log = _RunningOnWhenReady(shutdown), logging.getLogger("hypercorn.error")  # hc.errorlog
    hooks = getattr(app.state_holder, "on_ready", None)  # --models-dir's front serves at once: nothing to wait for
    if hooks is None:
        quiet.ready = True
    else:
        hooks.append(quiet.release)
    error_log.addFilter(quiet)
    writes = direct_body.WriteBatch()  # the direct write path's writer task runs beside Hypercorn
    async with anyio.create_task_group() as tg:
        tg.start_soon(shutdown.watch_signals)
        # False (logged there): SPINDLE_DIRECT_WRITE=0 or an unknown layout
        if direct_body.install(config.http.worker_class, writes):
            tg.start_soon(writes.run)
        try:
            await _hypercorn_serve(app, hc, config.http.worker_class, shutdown.stop.wait)
        except Exception as e:  # the server itself failed (e.g. the port is taken): say why, exit non-zero
            log.error("server failed: %s", describe_exception(e))
            shutdown.code = shutdown.code or 1
        finally:
            shutdown.listening.cancel()
            writes.stop()
            error_log.removeFilter(quiet)
    return shutdown.code


def run_server(
    config: ServerConfig, engine_factory: EngineFactory | None = None, worker: WorkerContext | None = None
) -> int:
    """`serve` on the worker class's event loop, with this process's logging set up; the exit code."""
    setup_logging(config.outputs.log_level, tag=f"api-server {worker.index}" if worker is not None else "")
    if config.http.worker_class == "trio":
        return anyio.run(serve, config, engine_factory, worker, backend="trio")
    options = {"use_uvloop": config.http.worker_class == "uvloop"}
    return anyio.run(serve, config, engine_factory, worker, backend="asyncio", backend_options=options)
