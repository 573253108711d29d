"""Listening and deployment: the address, the HTTP worker, TLS, CORS, a proxy's root path, API keys and the UI
(server/runtime/hypercorn_config.py and server/http/deploy.py apply them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from server.config.values import check_at_least_one, check_positive

WorkerClass = Literal["trio", "asyncio", "uvloop"]


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    worker_class: WorkerClass = "trio"
    shutdown_timeout: float = 10.0  # seconds for in-flight requests and the engine to stop
    max_request_body: int = 32 << 20  # bytes
    # Per-connection kernel send buffer (bytes; 0: the OS default, which grows to MBs). Small, so a slow
    # SSE reader makes sends block within ~100 events and its outputs merge instead of piling up in buffers.
    socket_send_buffer: int = 16 << 10
    api_keys: tuple[str, ...] = ()  # also SPINDLE_API_KEY (one key, or several separated by commas)
    metrics_public: bool = False  # with api_keys: /metrics stays open for scrapers
    disable_ui: bool = False  # no chat page at / and /ui (server/routes/ui.py); `spindle render` never has one
    # Deployment (server/http/deploy.py): TLS through Hypercorn, CORS (vLLM's flags, JSON lists), a proxy's path prefix
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers (vLLM's default is ["*"])
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # the prefix a path-prefix proxy serves this server under, e.g. /llm

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        check_at_least_one(self, ("max_request_body",))
        if self.socket_send_buffer < 0:
            raise ValueError(f"--socket-send-buffer must be 0 (OS default) or positive, got {self.socket_send_buffer}")
        check_positive(self, ("shutdown_timeout",))
        if self.worker_class not in get_args(WorkerClass):
            raise ValueError(f"--worker-class must be one of trio, asyncio, uvloop; got {self.worker_class!r}")
        if any(not k for k in self.api_keys):
            raise ValueError("--api-key must not be empty")
        self._check_deploy()

    def _check_deploy(self) -> None:
        """TLS files and the root path (server/http/deploy.py applies them)."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both, or neither")
        for name in ("ssl_keyfile", "ssl_certfile"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise ValueError(f"--{name.replace('_', '-')} {value!r}: no such file")
        root = self.root_path
        if root and (not root.startswith("/") or root.endswith("/")):
            raise ValueError(f"--root-path must start with / and not end with one (e.g. /llm), got {root!r}")
