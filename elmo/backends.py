"""Where vectors come from: the runtime in process (:class:`LocalBackend`) or a running ``elmo serve``
(:class:`RemoteBackend`). The feature API (elmo.features), the spaCy component (elmo.spacy) and the batch job
(elmo.batch) all embed through this one pair; the same tokenized sentences give the same vectors either way.

A remote request is cut by one rule (:class:`RequestCutter`): within the server's advertised limits (GetModelInfo)
on sentences and tokens per request, and within :data:`BYTES_SHARE` of both its message limit (the request's own
bytes: gRPC refuses a larger message with a RESOURCE_EXHAUSTED that no retry can cure) and its answer limit (the
response's bytes). A refused request is sent again by one policy (:class:`RetryPolicy`): overload and short outages
with backoff, any other status at once to the caller. Torch-free; grpc is imported only for a remote backend.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from elmo.errors import ElmoError, InputError
from elmo.runtime.tasks import TaskStore, UnknownTaskError

if TYPE_CHECKING:  # elmo.client (grpc) is imported only for a remote backend
    from elmo.client import Connection

log = logging.getLogger("elmo.backends")

# Share of the server's message and answer limits one request may fill: the estimates below are upper bounds on
# the vectors and strings, and the rest is room for protobuf framing they do not count.
BYTES_SHARE = 0.8
FRAMING_BYTES = 1024  # a request's or answer's own fields (model name, options, version): kept out of the share
IN_FLIGHT = 4  # requests on the wire at once: the server's batcher fills while the caller works on the answers


class Vectors(NamedTuple):
    """One sentence's answer: its layers (n_selected_layers, n_tokens, dim), None when omitted; its task mix
    (n_tokens, dim), None without a task."""

    layers: np.ndarray | None
    mix: np.ndarray | None


class Backend(Protocol):
    """Tokenized sentences in, per sentence :class:`Vectors` out (float32)."""

    n_layers: int
    dim: int
    max_tokens_per_sentence: int

    def embed(
        self,
        sentences: list[list[str]],
        task: str | None = None,
        layers: Sequence[int] | None = None,
        omit_layers: bool = False,
    ) -> list[Vectors]: ...

    def embed_tokens(self, sentences: list[list[str]]) -> list[np.ndarray]: ...

    def mix(self, sentences: list[list[str]], task: str) -> list[np.ndarray]: ...

    def layers_and_mix(self, sentences: list[list[str]], task: str) -> list[tuple[np.ndarray, np.ndarray]]: ...

    def check_task(self, task: str) -> None: ...

    def identity(self) -> dict: ...

    def close(self) -> None: ...


class _Shortcuts:
    """The feature API's three calls, in terms of ``embed``."""

    def embed_tokens(self, sentences: list[list[str]]) -> list[np.ndarray]:
        """Per sentence float32 (n_layers, n_tokens, dim)."""
        return [answer.layers for answer in self.embed(sentences)]

    def mix(self, sentences: list[list[str]], task: str) -> list[np.ndarray]:
        """The stored task's mix per sentence, float32 (n_tokens, dim)."""
        return [answer.mix for answer in self.embed(sentences, task=task, omit_layers=True)]

    def layers_and_mix(self, sentences: list[list[str]], task: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """Both in one pass: per sentence (layers, the task's mix)."""
        return [(answer.layers, answer.mix) for answer in self.embed(sentences, task=task)]


def model_identity(model_dir: Path) -> dict:
    """What makes a model directory's vectors what they are: the graphs, their weights and metadata (a re-export
    changes them)."""
    digest = hashlib.sha256()
    graphs = sorted(p.name for p in model_dir.iterdir() if ".onnx" in p.name and p.is_file())
    for name in ["config.json", "onnx.json", *graphs]:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
    return {"model_sha256": digest.hexdigest()}


# -- in process ----------------------------------------------------------------------------------------------------
class LocalBackend(_Shortcuts):
    """The in-process onnxruntime runtime (:class:`elmo.runtime.Embedder`) and the model directory's tasks.
    ``runtime_options`` are the Embedder's (threads, batch size, ...); ``embedder`` reuses one already open."""

    def __init__(self, model: str | Path, embedder: Any = None, **runtime_options: Any) -> None:
        if embedder is None:
            from elmo.runtime import Embedder

            embedder = Embedder(model, **runtime_options)
        self.embedder = embedder
        self.model_dir = Path(embedder.model_dir)
        self.n_layers, self.dim = embedder.info.n_layers, embedder.info.dim
        self.max_tokens_per_sentence = embedder.info.max_tokens_per_sentence
        self.tasks = TaskStore(self.model_dir, n_layers=self.n_layers, dim=self.dim)

    def embed(
        self,
        sentences: list[list[str]],
        task: str | None = None,
        layers: Sequence[int] | None = None,
        omit_layers: bool = False,
    ) -> list[Vectors]:
        stored = self.tasks.get(task) if task else None
        out = []
        for computed in self.embedder.embed_tokens(sentences):
            mixed = stored.apply(computed) if stored is not None else None
            kept = None if omit_layers else (computed[list(layers)] if layers else computed)
            out.append(Vectors(kept, mixed))
        return out

    def check_task(self, task: str) -> None:
        self.tasks.get(task)

    def identity(self) -> dict:
        return model_identity(self.model_dir)

    def close(self) -> None:
        self.embedder = None  # frees the sessions (and their GPU memory) when the caller is done with them


# -- a server ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerLimits:
    """What one request to a server may hold, as its GetModelInfo advertises (a server that leaves a field out
    gets the service's default for it)."""

    max_inputs: int = 256
    max_tokens_per_request: int = 8192
    max_tokens_per_sentence: int = 512
    max_message_bytes: int = 8 << 20
    max_response_bytes: int = 64 << 20

    @classmethod
    def of(cls, info: Any) -> ServerLimits:
        """From a ModelInfo message."""
        limits = info.limits if info.HasField("limits") else None

        def advertised(name: str, default: int) -> int:
            return int(getattr(limits, name, 0) or 0) or default

        model_limit = int(info.max_tokens_per_sentence) or cls.max_tokens_per_sentence
        per_sentence = advertised("max_tokens_per_sentence", model_limit)
        return cls(
            max_inputs=advertised("max_inputs", cls.max_inputs),
            max_tokens_per_request=advertised("max_tokens_per_request", cls.max_tokens_per_request),
            max_tokens_per_sentence=per_sentence,
            max_message_bytes=advertised("max_message_bytes", cls.max_message_bytes),
            max_response_bytes=advertised("max_response_bytes", cls.max_response_bytes),
        )


class RequestCutter:
    """Cuts sentences into requests within a server's :class:`ServerLimits`: sentences and tokens per request, and
    :data:`BYTES_SHARE` of its message limit (the request) and of its answer limit (the response)."""

    def __init__(self, limits: ServerLimits, dim: int) -> None:
        self.limits, self.dim = limits, dim
        self.request_budget = BYTES_SHARE * limits.max_message_bytes - FRAMING_BYTES
        self.response_budget = BYTES_SHARE * limits.max_response_bytes - FRAMING_BYTES

    def response_bytes(self, tokens: list[str], vectors_per_token: int) -> int:
        """An upper bound on one sentence's share of an answer: its vectors, token strings, offsets, framing."""
        return len(tokens) * (vectors_per_token * self.dim * 4 + 16) + sum(len(t) for t in tokens) * 4 + 128

    @staticmethod
    def request_bytes(tokens: list[str]) -> int:
        """An upper bound on one sentence's share of a request: UTF-8 token strings and protobuf framing."""
        return sum(len(t.encode("utf-8")) for t in tokens) + 6 * len(tokens) + 16

    def max_tokens_per_sentence(self, vectors_per_token: int) -> int:
        """The longest sentence one request can carry: the server's own limits, and an answer within the server's
        answer limit (the share kept for packing several sentences does not bound one sentence alone)."""
        per_token = vectors_per_token * self.dim * 4 + 16 + 4 * 16  # vectors, offsets, a long token's string
        fits = max(1, (self.limits.max_response_bytes - FRAMING_BYTES - 128) // per_token)
        return min(self.limits.max_tokens_per_sentence, self.limits.max_tokens_per_request, fits)

    def cut(self, sentences: list[list[str]], vectors_per_token: int) -> list[list[int]]:
        """Positions cut into requests. A sentence whose request alone is over the message budget is an InputError:
        no server with these limits can take it."""
        requests: list[list[int]] = []
        current: list[int] = []
        tokens = answer = request = 0
        for position, sentence in enumerate(sentences):
            need, own = self.response_bytes(sentence, vectors_per_token), self.request_bytes(sentence)
            if own > self.request_budget:
                raise InputError(
                    f"a sentence of {len(sentence)} tokens needs a {own:,}-byte request, over what the server takes "
                    f"(its --max-message-bytes {self.limits.max_message_bytes:,}; the sentence's first token: "
                    f"{sentence[0][:40]!r}...); send it in smaller pieces (a lower --max-sentence-tokens with "
                    "--overflow window in a batch job)"
                )
            full = len(current) >= self.limits.max_inputs or tokens + len(sentence) > self.limits.max_tokens_per_request
            over = answer + need > self.response_budget or request + own > self.request_budget
            if current and (full or over):
                requests.append(current)
                current, tokens, answer, request = [], 0, 0, 0
            current.append(position)
            tokens, answer, request = tokens + len(sentence), answer + need, request + own
        if current:
            requests.append(current)
        return requests


@dataclass(frozen=True)
class RetryPolicy:
    """How a refused request is sent again: overload (RESOURCE_EXHAUSTED) and short outages (UNAVAILABLE: a
    restart, a drain; CANCELLED: a stopping server cancels the calls it is receiving) with backoff from
    ``first_s`` doubling to ``max_s``, ``attempts`` in all;
    any other status goes to the caller at once, with the server's message."""

    attempts: int = 5
    first_s: float = 0.1
    max_s: float = 10.0
    codes: tuple[str, ...] = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED")

    def delays(self) -> Iterator[float]:
        """The waits between attempts (``attempts - 1`` of them)."""
        delay = self.first_s
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * 2, self.max_s)


# One policy, two budgets: a call from the feature API or spaCy gives up after 1.5 s of waiting (a typo'd port or a
# stopped server is reported while the user waits); a batch job rides out a restart or a drain (32.7 s per request).
CALL_RETRY = RetryPolicy(attempts=5)
JOB_RETRY = RetryPolicy(attempts=10)


class RemoteBackend(_Shortcuts):
    """A running ``elmo serve`` through :class:`elmo.client.EmbedderClient` (the one client). Token lists go over
    the wire untouched, cut by :class:`RequestCutter` and retried by :class:`RetryPolicy`, :data:`IN_FLIGHT` on
    the wire at once; a stored task's mix is computed by the server.

    ``wait_s``: a server that is starting gets this long to report SERVING on grpc.health (0: not asked).
    ``connection``: TLS and token (elmo.client.Connection); ``client_options``: EmbedderClient's (auth_token,
    timeout, ...)."""

    def __init__(
        self,
        target: str,
        model_name: str = "",
        *,
        connection: Connection | None = None,
        wait_s: float = 0.0,
        retry: RetryPolicy | None = None,
        **client_options: Any,
    ) -> None:
        from elmo.client import Connection

        # retries at one layer, this module's: not also the channel's gRPC retry policy (elmo.client's default),
        # which would multiply them (up to 50 requests per call to a server that refuses)
        self.client = (connection or Connection()).client(target, retry_policy=None, **client_options)
        self.target, self.model_name, self.retry = target, model_name, retry or CALL_RETRY
        try:
            if wait_s > 0:
                self._wait_until_serving(wait_s)
            self.info = self._model_info()
        except BaseException:
            self.client.close()  # nothing else will close the channel
            raise
        self.n_layers, self.dim = int(self.info.n_layers), int(self.info.dim)
        self.tasks = list(self.info.tasks)
        self.limits = ServerLimits.of(self.info)
        self.cutter = RequestCutter(self.limits, self.dim)
        self.max_tokens_per_sentence = self.cutter.max_tokens_per_sentence(self.n_layers + 1)
        self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="embed-rpc")

    def _wait_until_serving(self, wait_s: float) -> None:
        from elmo.client import RemoteError

        deadline = time.monotonic() + wait_s
        while True:
            try:
                status = self.client.health()
                problem = f"health status {status}"
                if status == "SERVING":
                    return
            except RemoteError as exc:
                problem = str(exc)
            if time.monotonic() >= deadline:
                raise ElmoError(f"server {self.target} is not serving after {wait_s:g} s ({problem})")
            time.sleep(0.2)

    def _model_info(self):
        """The first RPC that needs the token (health checks do not): a refusal here says which flag fixes it."""
        from elmo.client import AUTH_TOKEN_ENV, RemoteError

        try:
            return self.client.model_info(self.model_name)
        except RemoteError as exc:
            if exc.code.name == "UNAUTHENTICATED":
                raise ElmoError(
                    f"server {self.target} refused: {exc} (pass --auth-token TOKEN or set {AUTH_TOKEN_ENV})"
                ) from None
            raise

    def _call(self, sentences: list[list[str]], options: dict) -> list:
        """One Embed request, sent again by the retry policy."""
        from elmo.client import RemoteError

        delays = self.retry.delays()
        while True:
            try:
                return self.client.embed(sentences, model=self.model_name, **options)
            except RemoteError as exc:
                delay = next(delays, None) if exc.code.name in self.retry.codes else None
                if delay is None:
                    raise
                log.warning("server: %s; retrying in %.1f s", exc, delay)
                time.sleep(delay)

    def embed(
        self,
        sentences: list[list[str]],
        task: str | None = None,
        layers: Sequence[int] | None = None,
        omit_layers: bool = False,
    ) -> list[Vectors]:
        options: dict[str, Any] = {"omit_layers": omit_layers}
        if task:
            options["task"] = task
        if layers:
            options["layers"] = list(layers)
        vectors_per_token = (0 if omit_layers else len(layers or range(self.n_layers))) + (1 if task else 0)
        requests = self.cutter.cut(sentences, vectors_per_token)
        answers = self.pool.map(lambda positions: self._call([sentences[p] for p in positions], options), requests)
        out: list[Vectors] = [Vectors(None, None)] * len(sentences)
        for positions, results in zip(requests, answers):
            for position, result in zip(positions, results):
                out[position] = Vectors(result.layers, result.mix)
        return out

    def check_task(self, task: str) -> None:
        if task not in self.tasks:
            raise UnknownTaskError(
                f"unknown task {task!r} on server {self.target} (model {self.info.name}); "
                f"available tasks: {', '.join(self.tasks) or 'none'}"
            )

    def identity(self) -> dict:
        return {"server_model": self.info.name, "server_model_version": self.info.version}

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


def connect(model: str | Path | None = None, server: str | None = None, **options: Any) -> LocalBackend | RemoteBackend:
    """A local model directory or a remote server (exactly one of them)."""
    if (model is None) == (server is None):
        raise InputError("give exactly one of model=DIR (local runtime) or server=HOST:PORT (gRPC service)")
    return LocalBackend(model, **options) if model is not None else RemoteBackend(server, **options)
