"""Deployment options: TLS and HTTP/2 (Hypercorn's), CORS for browser clients, a proxy's path prefix.

- TLS: --ssl-keyfile / --ssl-certfile go to Hypercorn's own `keyfile` / `certfile`; it then offers h2 and
  http/1.1 by ALPN. Without TLS Hypercorn also speaks h2c (prior knowledge, or `Upgrade: h2c`).
  Streams over HTTP/2 go through ASGI: the direct write path (server/http/direct_body.py) declines for them.
- CORS: --allowed-origins (a JSON list, vLLM's format) turns on Starlette's CORSMiddleware outside the
  API-key check, so a browser's preflight OPTIONS is answered without a key and 401s carry CORS headers.
  Unset: no CORS headers at all (vLLM's default is ["*"]; here a browser origin must be named).
- --root-path: the prefix a path-prefix proxy serves us under. It becomes the ASGI `root_path`; routes
  match the path with the prefix taken off when the proxy kept it, and as is when the proxy stripped it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.config import ServerConfig


def check_deploy_config(config: ServerConfig) -> None:
    """ValueError naming the flag for a deployment setting that cannot work."""
    if (config.ssl_keyfile is None) != (config.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both, or neither")
    for name in ("ssl_keyfile", "ssl_certfile"):
        value = getattr(config, name)
        if value is not None and not Path(value).is_file():
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: no such file")
    root = config.root_path
    if root and (not root.startswith("/") or root.endswith("/")):
        raise ValueError(f"--root-path must start with / and not end with one (e.g. /llm), got {root!r}")
    if config.metrics_compat not in (None, "vllm"):
        raise ValueError(f"--metrics-compat must be vllm, got {config.metrics_compat!r}")


def wrap_app(router: Any, config: ServerConfig) -> Any:
    """The middleware around the router: [root path ->] access log -> [CORS ->] [API key ->] router."""
    from server.http.access_log import AccessLog
    from server.http.auth import APIKeyAuth
    from server.http.root_path import RootPath

    app: Any = router
    if config.api_keys:
        public = ("/health", "/metrics") if config.metrics_public else ("/health",)
        app = APIKeyAuth(app, config.api_keys, public_paths=public)
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=list(config.allowed_origins),
                             allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                             allow_credentials=config.allow_credentials)
    app = AccessLog(app, log_requests=config.log_requests)
    if config.root_path:
        app = RootPath(app, config.root_path)
    return app


def configure_hypercorn(hc: Any, config: ServerConfig) -> None:
    """TLS (ALPN offers h2, then http/1.1) on Hypercorn's config; h2c needs nothing: Hypercorn speaks it."""
    if config.ssl_certfile is not None:
        hc.certfile = config.ssl_certfile
        hc.keyfile = config.ssl_keyfile
    hc.alpn_protocols = ["h2", "http/1.1"]
