"""Hypercorn's config for `spindle serve`: where to listen, TLS (ALPN offers h2), timeouts, logs."""

from __future__ import annotations

import logging

from hypercorn.config import Config, Sockets

from server.config import ServerConfig
from server.runtime.sockets import set_send_buffer
from server.worker_context import WorkerContext


class _Config(Config):
    """Hypercorn's Config whose listeners get --socket-send-buffer (accepted connections inherit it)."""

    send_buffer = 0

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        set_send_buffer((*sockets.secure_sockets, *sockets.insecure_sockets), self.send_buffer)
        return sockets


def hypercorn_config(config: ServerConfig, worker: WorkerContext | None = None) -> Config:
    """worker: an API process of --api-server-count listens on the launcher's socket, shared."""
    hc = _Config()
    hc.send_buffer = config.http.socket_send_buffer
    host, port = config.http.host, config.http.port
    hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    if worker is not None:
        hc.bind = [f"fd://{worker.listen_fd}"]
    hc.graceful_timeout = 2.0  # requests were drained (or cut) before Hypercorn is told to stop
    hc.startup_timeout = config.engine.engine_ready_timeout + 120  # model load + demo build happen in the lifespan
    hc.shutdown_timeout = config.http.shutdown_timeout + 15  # the engine's own stop after requests drained
    hc.keep_alive_timeout = 75
    hc.accesslog = None  # server.http.access_log writes one line per request instead
    hc.errorlog = logging.getLogger("hypercorn.error")  # through the root handler: one line, one format
    hc.loglevel = config.outputs.log_level.upper()
    if config.http.ssl_certfile is not None:  # TLS: Hypercorn's own; ALPN offers h2, then http/1.1
        hc.certfile = config.http.ssl_certfile
        hc.keyfile = config.http.ssl_keyfile
    hc.alpn_protocols = ["h2", "http/1.1"]  # h2c needs nothing: Hypercorn speaks it
    return hc
