"""GET /metrics: Prometheus text exposition."""

from __future__ import annotations

from typing import Any

from server.http.asgi import Receive, Scope, Send


class MetricsRoute:
    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics  # server.metrics.ServerMetrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from server.metrics import CONTENT_TYPE

        body = self.metrics.render()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
