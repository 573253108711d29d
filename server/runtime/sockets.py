"""The listening socket's set-up: the launcher's one shared socket, and the send buffer of every listener."""

from __future__ import annotations

import socket
from collections.abc import Iterable

from server.config import ServerConfig


def set_send_buffer(listeners: Iterable[socket.socket], size: int) -> None:
    """SO_SNDBUF on listening sockets: accepted connections inherit it (0: leave the OS default)."""
    if size:
        for sock in listeners:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


def listen(config: ServerConfig) -> socket.socket:
    """The launcher's one listening socket (as Hypercorn would make it), inherited by every API process."""
    host = config.http.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_send_buffer([sock], config.http.socket_send_buffer)
    sock.bind((host, config.http.port))
    sock.listen(1024)
    return sock
