"""Run one README client snippet in the clients' environment (.venv-clients), with the network shut off.

    .venv-clients/bin/python tests/clients/run_snippet.py SNIPPET.py DOCUMENTS.json OUT.npy

The snippet gets ``documents`` (the JSON list of strings) and must leave ``vectors``; they are saved as float32 to
OUT.npy. If the snippet raises, OUT.npy is not written and the exception's class (``module.QualName``), with its
base classes, is printed as the last line: ``{"error": ..., "bases": [...], "message": ...}``.

Every connection and name lookup outside the loopback is refused before it leaves the process, so a client that
would download something at run time (tiktoken's BPE file, litellm's price list, Chroma's telemetry) fails here.
Runs on the clients' own Python: only the standard library and numpy (every client brings it).
"""

from __future__ import annotations

import json
import socket
import sys
import traceback

import numpy as np

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _shut_off_the_network() -> None:
    connect, lookup = socket.socket.connect, socket.getaddrinfo

    def loopback_only(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in LOOPBACK:
            raise OSError(f"network access to {address!r} refused: the client tests run without a network")
        return connect(self, address)

    def loopback_lookup(host, *args, **kwargs):
        if host is not None and host not in LOOPBACK:
            raise socket.gaierror(f"name lookup of {host!r} refused: the client tests run without a network")
        return lookup(host, *args, **kwargs)

    socket.socket.connect = loopback_only
    socket.getaddrinfo = loopback_lookup


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def main(snippet: str, documents_path: str, out_path: str) -> int:
    _shut_off_the_network()
    namespace = {"documents": json.loads(open(documents_path, encoding="utf-8").read())}
    code = open(snippet, encoding="utf-8").read()
    try:
        exec(compile(code, snippet, "exec"), namespace)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which expects the client's own type
        traceback.print_exc()
        bases = [_class_name(cls) for cls in type(exc).__mro__[1:]]
        print(json.dumps({"error": _class_name(type(exc)), "bases": bases, "message": str(exc)[:2000]}))
        return 1
    np.save(out_path, np.asarray(namespace["vectors"], dtype=np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
