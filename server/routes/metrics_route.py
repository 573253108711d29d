"""GET /metrics: Prometheus text exposition."""

from __future__ import annotations

from server.http.asgi import Receive, Scope, Send
from server.metrics.prometheus import CONTENT_TYPE, ServerMetrics


class MetricsRoute:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.metrics.render()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
