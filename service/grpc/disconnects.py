"""A gRPC client that goes away before its answer is sent is the client's doing: one INFO line, never an ERROR.

grpc.aio reports an answer it could not send (the connection closed, or was reset, while the answer waited for the
client's window) by logging an ERROR with a traceback on its own logger, after the servicer has returned, where no
handler of ours can catch it. :class:`ClientGoneFilter`, a ``logging.Filter`` on that logger, rewrites exactly that
record into one INFO line naming the method; every other record of gRPC's passes unchanged. The request itself is
counted as ``client_disconnected`` by the observer (service.grpc.interceptors)."""

from __future__ import annotations

import logging
import re

GRPC_LOGGER = "grpc._cython.cygrpc"  # the logger grpc.aio's server writes its handler errors to
UNDELIVERED = re.compile(r"^ExecuteBatchError raised in core by servicer method \[(?P<method>[^\]]*)\]")


class ClientGoneFilter(logging.Filter):
    """gRPC's 'ExecuteBatchError raised in core by servicer method [M]' ERROR -> one INFO line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = UNDELIVERED.match(record.getMessage())
        if found is not None:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "client disconnect: the answer to %s was not delivered", (found["method"],)
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def log_client_disconnects_as_info() -> None:
    """Install :class:`ClientGoneFilter` on gRPC's server logger, once."""
    logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in logger.filters):
        logger.addFilter(ClientGoneFilter())


__all__ = ["ClientGoneFilter", "log_client_disconnects_as_info"]
