"""The transport: raw-ASGI helpers, errors in the API's shape, SSE framing, auth, the access log, and the
direct write path that frames streamed chunks straight onto the socket. Knows no routes and no engine."""
