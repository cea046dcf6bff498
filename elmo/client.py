"""Python client of the embedding service, returning numpy arrays; and ``elmo embed --server HOST:PORT TEXT...``.

    from elmo.client import EmbedderClient
    with EmbedderClient("127.0.0.1:50051") as client:
        vectors = client.embed_texts(["The cat sat .", "苹果很好吃"])   # per sentence float32 (n_layers, n_tokens, dim)
        results = client.embed(["Apple shares rose ."], task="ner_msra") # tokens, offsets, layers, mix

Inputs are ``str`` (raw text), ``bytes`` (UTF-8 text, checked here) or a list of tokens. Failures raise
:class:`RemoteError` (an ``ElmoError``) carrying the gRPC status code and the server's message. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from elmo.embedding import Embedding
from elmo.errors import ElmoError, InputError
from elmo.flags import add_alias
from elmo.text.overflow import Overflow
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from elmo.wire import DTYPE_NAMES, OVERFLOW_VALUES, from_tensor

AUTH_TOKEN_ENV = "ELMO_AUTH_TOKEN"
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# gRPC's own retries (gRFC A6), on by default: a call answered UNAVAILABLE (a replica warming up or draining, a
# connection refused or reset, a balancer with no healthy backend) is sent again after a random wait of up to 0.1,
# 0.2, 0.4, 0.8 s, at most 5 attempts in all. Nothing else is retried: an INVALID_ARGUMENT would fail again, and
# retrying RESOURCE_EXHAUSTED ("overloaded") would add load to a saturated fleet. docs/how-to/replicas.md gives the same
# service config for other clients (grpcurl, Go, Node) and the HTTP clients' equivalents.
RETRY_POLICY: dict = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
# gRPC keeps a call's request to send it again only up to this size (its default is 256 KiB): the server's default
# --max-message-bytes, so every request a server accepts can be retried.
RETRY_BUFFER_BYTES = 8 * 1024 * 1024

InputLike = str | bytes | Sequence[str]


def service_config(retry_policy: dict | None = RETRY_POLICY) -> str:
    """The gRPC service config (JSON) that applies ``retry_policy`` to every method of elmo.v1.Embedder."""
    method = {"name": [{"service": "elmo.v1.Embedder"}]}
    if retry_policy:
        method["retryPolicy"] = dict(retry_policy)
    return json.dumps({"methodConfig": [method]})


def channel_options(retry_policy: dict | None = RETRY_POLICY, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
    """The channel options EmbedderClient uses: message limits, and gRPC retries with ``retry_policy`` (None or
    an empty dict: retries off)."""
    options: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if retry_policy:
        options += [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", service_config(retry_policy)),
            ("grpc.service_config_disable_resolution", 1),  # ours, not one a DNS TXT record would bring
            ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES),
        ]
    else:
        options.append(("grpc.enable_retries", 0))
    return options


class RemoteError(ElmoError):
    """The server answered with an error status; ``code`` is the grpc.StatusCode, the message is the server's."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def to_input(item: InputLike, index: int = 0) -> pb.Input:
    """One sentence -> ``elmo.v1.Input``; bytes must be UTF-8 and strings encodable (no lone surrogates)."""
    if isinstance(item, bytes):
        try:
            item = item.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(
                f"inputs[{index}] is not valid UTF-8 (byte 0x{item[exc.start]:02x} at offset {exc.start})"
            ) from None
    if isinstance(item, str):
        _check_encodable(item, f"inputs[{index}]")
        return pb.Input(text=item)
    tokens = list(item)
    for j, token in enumerate(tokens):
        if not isinstance(token, str):
            raise InputError(f"inputs[{index}].tokens[{j}] is {type(token).__name__}, not str")
        _check_encodable(token, f"inputs[{index}].tokens[{j}]")
    return pb.Input(tokens=pb.Tokens(tokens=tokens))


def _check_encodable(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"{where} cannot be encoded as UTF-8 (character {exc.object[exc.start]!r} at {exc.start})"
        ) from None


class EmbedderClient:
    """A channel to one server. Thread-safe (gRPC channels are); use one per process and share it.

    ``retry_policy``: gRPC's retryPolicy for every call (default :data:`RETRY_POLICY`: UNAVAILABLE retried with
    exponential backoff, 5 attempts); pass another dict to change it, ``None`` to turn retries off."""

    def __init__(
        self,
        target: str,
        *,
        auth_token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retry_policy: dict | None = RETRY_POLICY,
    ):
        options = channel_options(retry_policy, max_message_bytes)
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_ca is not None:
            try:
                root = Path(tls_ca).read_bytes()
            except OSError as exc:
                raise InputError(f"{tls_ca}: cannot read the TLS root certificate ({exc.strerror})") from None
            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            self.channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.EmbedderStub(self.channel)
        self.timeout = timeout
        token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    # -- plumbing -------------------------------------------------------------------------------------------------
    def _call(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise RemoteError(exc.code(), exc.details() or "") from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> EmbedderClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (not until the model is warm: see :meth:`health`)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # -- API ------------------------------------------------------------------------------------------------------
    def request(
        self,
        inputs: Sequence[InputLike],
        layers: Sequence[int] | None = None,
        task: str = "",
        omit_layers: bool = False,
        dtype: str = "float32",
        model: str = "",
        overflow: str = "",
    ) -> pb.EmbedRequest:
        """The EmbedRequest :meth:`embed` would send (public: the load generator and the tests reuse it)."""
        if isinstance(inputs, (str, bytes)):
            raise InputError("inputs must be a list of sentences, not one string")
        if dtype not in DTYPE_NAMES:
            raise InputError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        policy = pb.OVERFLOW_DEFAULT if not overflow else OVERFLOW_VALUES[Overflow.parse(overflow).value]
        return pb.EmbedRequest(
            inputs=[to_input(item, i) for i, item in enumerate(inputs)],
            layers=list(layers or []),
            task=task,
            omit_layers=omit_layers,
            dtype=DTYPE_NAMES[dtype],
            model=model,
            overflow=policy,
        )

    def embed(self, inputs: Sequence[InputLike], timeout: float | None = None, **options) -> list[Embedding]:
        """Embed sentences. Options: layers, task, omit_layers, dtype ('float32'|'float16'), model, overflow
        ('reject'|'truncate'|'window'; empty = the server's --overflow)."""
        response = self._call(self.stub.Embed, self.request(inputs, **options), timeout)
        return decode_response(response)

    def embed_texts(self, texts: Sequence[str | bytes], **options) -> list[np.ndarray]:
        """Raw texts -> per text the layers array ``(n_layers, n_tokens, dim)``."""
        return [e.layers for e in self.embed(texts, **options)]

    def embed_tokens(self, sentences: Sequence[Sequence[str]], **options) -> list[np.ndarray]:
        """Tokenized sentences -> per sentence ``(n_layers, n_tokens, dim)``, exactly like Embedder.embed_tokens."""
        if any(isinstance(s, (str, bytes)) for s in sentences):
            raise InputError("embed_tokens takes lists of tokens; use embed_texts for raw text")
        return [e.layers for e in self.embed(sentences, **options)]

    def embed_stream(self, requests, timeout: float | None = None):
        """Iterate EmbedRequests (see :meth:`request`) -> decoded results per request, in order."""
        try:
            for response in self.stub.EmbedStream(iter(requests), timeout=timeout, metadata=self._metadata):
                yield decode_response(response)
        except grpc.RpcError as exc:
            raise RemoteError(exc.code(), exc.details() or "") from None

    def tokenize(self, texts: Sequence[str], model: str = "") -> list[tuple[list[str], list[tuple[int, int]]]]:
        response = self._call(self.stub.Tokenize, pb.TokenizeRequest(texts=list(texts), model=model))
        return [(list(t.tokens), [(s.start, s.end) for s in t.offsets]) for t in response.texts]

    def model_info(self, model: str = "") -> pb.ModelInfo:
        return self._call(self.stub.GetModelInfo, pb.GetModelInfoRequest(model=model))

    def list_models(self) -> list[str]:
        return list(self._call(self.stub.ListModels, pb.ListModelsRequest()).models)

    def health(self, service: str = "") -> str:
        """grpc.health.v1 status name: 'SERVING', 'NOT_SERVING', ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        response = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def decode_response(response: pb.EmbedResponse) -> list[Embedding]:
    out = []
    for e in response.embeddings:
        out.append(
            Embedding(
                tokens=list(e.tokens),
                offsets=[(s.start, s.end) for s in e.offsets] if e.offsets else None,
                layers=from_tensor(e.layers) if e.HasField("layers") else None,
                mix=from_tensor(e.mix) if e.HasField("mix") else None,
                truncated_tokens=e.truncated_tokens,
                model=response.model,
                model_version=response.model_version,
                task_stale=response.task_stale,
            )
        )
    return out


# -- command-line connection options (`elmo embed`, `elmo embed-file --server`) ---------------------------------
@dataclass(frozen=True)
class Connection:
    """How to reach a server besides its address: the TLS root to trust, the name its certificate must carry,
    the bearer token (None: env ELMO_AUTH_TOKEN, read by EmbedderClient). Every command that talks to a server
    takes these from :func:`add_connection_arguments`, so that the flags mean the same everywhere."""

    tls_ca: Path | None = None
    tls_server_name: str | None = None
    auth_token: str | None = field(default=None, repr=False)  # a secret: kept out of reprs and logs

    def client(self, target: str, **options) -> EmbedderClient:
        """An EmbedderClient for ``target`` over this connection; ``options`` as EmbedderClient's (timeout...)."""
        return EmbedderClient(
            target,
            auth_token=self.auth_token,
            tls_ca=self.tls_ca,
            tls_server_name=self.tls_server_name,
            **options,
        )

    def flags(self) -> list[str]:
        """The connection flags that were given (for commands where they only apply with --server)."""
        given = {"--tls-ca": self.tls_ca, "--tls-server-name": self.tls_server_name, "--auth-token": self.auth_token}
        return [flag for flag, value in given.items() if value is not None]


def add_connection_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--tls-ca, --tls-server-name, --auth-token; read them back with :func:`connection_from_args`."""
    parser.add_argument("--tls-ca", type=Path, default=None, help="PEM root certificate to trust (enables TLS)")
    parser.add_argument(
        "--tls-server-name",
        default=None,
        help="name the server's certificate must carry, when it is not the HOST of --server (needs --tls-ca)",
    )
    parser.add_argument("--auth-token", default=None, help=f"bearer token (default: env {AUTH_TOKEN_ENV})")


def connection_from_args(args: argparse.Namespace) -> Connection:
    if args.tls_server_name and args.tls_ca is None:
        # A plaintext channel checks no certificate, so the name would be silently ignored.
        raise InputError("--tls-server-name needs --tls-ca: it names the certificate that TLS checks")
    return Connection(args.tls_ca, args.tls_server_name or None, args.auth_token)


# -- `elmo embed` ------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("texts", nargs="+", help="sentences to embed (raw text; with --tokens: whitespace tokens)")
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of a running `elmo serve`")
    parser.add_argument("--tokens", action="store_true", help="the texts are whitespace-separated tokens")
    parser.add_argument("--layers", default="", help="comma-separated layer indices (default: all)")
    parser.add_argument("--task", default="", help="scalar-mix task name")
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPE_NAMES), help="vector number type (default float32)"
    )
    # --server-model, as in embed-file: --model names a model directory in every command that has it
    model = parser.add_argument(
        "--server-model",
        default="",
        dest="model",
        metavar="NAME",
        help="model name on the server (default: its default model)",
    )
    add_alias(parser, "--model", model)
    parser.add_argument(
        "--overflow",
        default=None,
        choices=list(OVERFLOW_VALUES),
        help="sentences over the server's limit: reject, truncate or window (default: the server's --overflow)",
    )
    add_connection_arguments(parser)
    timeout = parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="seconds the call may take (default 60)"
    )
    add_alias(parser, "--timeout", timeout)
    parser.add_argument("--show", type=int, default=4, help="numbers to print per layer (default 4)")


def run(args: argparse.Namespace) -> int:
    layers = [int(v) for v in args.layers.split(",") if v.strip()] if args.layers else None
    inputs = [t.split() for t in args.texts] if args.tokens else list(args.texts)
    with connection_from_args(args).client(args.server, timeout=args.timeout_s) as client:
        results = client.embed(
            inputs, layers=layers, task=args.task, dtype=args.dtype, model=args.model, overflow=args.overflow or ""
        )
    np.set_printoptions(precision=4, suppress=True)
    for text, result in zip(args.texts, results):
        cut = f" ({result.truncated_tokens} more cut off)" if result.truncated_tokens else ""
        print(f"{text!r}: {len(result.tokens)} tokens{cut} {result.tokens if len(result.tokens) <= 64 else '...'}")
        if result.layers is not None:
            print(f"  layers {result.layers.dtype} {tuple(result.layers.shape)}")
            for index, layer in zip(layers or range(result.layers.shape[0]), result.layers):
                print(f"    layer {index} token 0: {layer[0, : args.show]} ... |v|={np.linalg.norm(layer[0]):.4f}")
        if result.mix is not None:
            print(f"  mix[{args.task}] {tuple(result.mix.shape)} token 0: {result.mix[0, : args.show]}")
    return 0


__all__ = [
    "Connection",
    "Embedding",
    "EmbedderClient",
    "RETRY_POLICY",
    "RemoteError",
    "add_connection_arguments",
    "channel_options",
    "connection_from_args",
    "decode_response",
    "service_config",
    "to_input",
]
