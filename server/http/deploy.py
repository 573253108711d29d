"""Deployment options: TLS and HTTP/2 (Hypercorn's), CORS for browser clients, a proxy's path prefix.

- TLS: --ssl-keyfile / --ssl-certfile go to Hypercorn's own `keyfile` / `certfile`
  (server/runtime/hypercorn_config.py); it then offers h2 and http/1.1 by ALPN. Without TLS Hypercorn also
  speaks h2c (prior knowledge, or `Upgrade: h2c`). Streams over HTTP/2 go through ASGI: the direct write
  path (server/http/direct_body.py) declines for them.
- CORS: --allowed-origins (a JSON list, vLLM's format) turns on Starlette's CORSMiddleware outside the
  API-key check, so a browser's preflight OPTIONS is answered without a key and 401s carry CORS headers.
  Unset: no CORS headers at all (vLLM's default is ["*"]; here a browser origin must be named).
- --root-path: the prefix a path-prefix proxy serves us under. It becomes the ASGI `root_path`; routes
  match the path with the prefix taken off when the proxy kept it, and as is when the proxy stripped it.

The settings are checked where every setting is (server/config/); this module only applies them.
"""

from __future__ import annotations

from typing import Any

from starlette.middleware.cors import CORSMiddleware

from server.config import ServerConfig
from server.http.access_log import AccessLog
from server.http.auth import APIKeyAuth
from server.http.root_path import RootPath


def wrap_app(router: Any, config: ServerConfig, public: tuple[str, ...] = ()) -> Any:
    """The middleware around the router: [root path ->] access log -> [CORS ->] [API key ->] router.
    `public`: more paths open without an API key (the chat page and its assets, which ask for the key)."""
    app: Any = router
    if config.http.api_keys:
        public = ("/health", "/metrics", *public) if config.http.metrics_public else ("/health", *public)
        app = APIKeyAuth(app, config.http.api_keys, public_paths=public)
    if config.http.allowed_origins:
        app = CORSMiddleware(
            app,
            allow_origins=list(config.http.allowed_origins),
            allow_methods=list(config.http.allowed_methods),
            allow_headers=list(config.http.allowed_headers),
            allow_credentials=config.http.allow_credentials,
        )
    app = AccessLog(app, log_requests=config.outputs.log_requests)
    if config.http.root_path:
        app = RootPath(app, config.http.root_path)
    return app
