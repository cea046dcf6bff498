"""Binding a port before the servers do: one clear error line instead of gRPC's, and a port held for a group.

``bind_port`` binds as gRPC does (SO_REUSEADDR, every address the host resolves to; one that binds is enough, as
for gRPC) and names the problem when none does; ``check_port_free`` is that check, the socket closed again.
"""

from __future__ import annotations

import errno
import socket

from elmo.errors import ConfigError

IN_USE = "the port is in use (stop what listens there or pick another port)"


def bind_port(host: str, port: int, what: str = "", reuse_port: bool = False) -> socket.socket:
    """A socket bound, not listening, on host:port (0 = any free port); ConfigError naming the address when none of
    the host's addresses binds. ``reuse_port``: SO_REUSEPORT, so that servers that set it too may share the port
    (``--processes``), and nothing else may."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen{what} on {host}:{port}: cannot resolve {host!r} ({exc.strerror})") from None
    failure: OSError | None = None
    for family, kind, protocol, _, sockaddr in addresses:
        bound = socket.socket(family, kind, protocol)
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            bound.bind(sockaddr)
            return bound
        except OSError as exc:
            bound.close()
            if failure is None or exc.errno == errno.EADDRINUSE:  # "in use" is the failure worth naming
                failure = exc
    why = IN_USE if failure is not None and failure.errno == errno.EADDRINUSE else getattr(failure, "strerror", None)
    raise ConfigError(f"cannot listen{what} on {host}:{port}: {why or 'no address to bind'}")


def check_port_free(host: str, port: int | None, what: str = "", reuse_port: bool = False) -> None:
    """ConfigError naming the address when nothing could listen on it (in use, not ours to take).

    Checked before gRPC binds, because gRPC's core logs its own ``E... add_port.cc`` line to stderr before it
    raises, and a user would see that instead of (or before) the one clear line. The port can still be taken
    between this check and gRPC's bind: then gRPC's line comes too, and the clear error still follows.
    """
    if not port:  # None: not asked for; 0: any free port
        return
    bind_port(host, port, what, reuse_port).close()


__all__ = ["bind_port", "check_port_free"]
