"""Where vectors come from: the runtime in process (LocalBackend) or a running `elmo serve` (RemoteBackend,
with retries on UNAVAILABLE / RESOURCE_EXHAUSTED). Both take tokenized sentences and give per-sentence layers.
"""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from elmo.batch.layout import LayerSpec, load_task_mix, reduce_layers
from elmo.batch.options import JobOptions
from elmo.batch.plan import GROUP_BYTES
from elmo.errors import ElmoError, InputError

if TYPE_CHECKING:  # elmo.client (grpc) is imported only in remote mode
    from elmo.client import Connection

log = logging.getLogger("elmo.batch")


# A batch job embeds documents as they come: the serving limit (elmo.runtime's 1024) would fail a long line, and a
# line longer than a batch simply runs as a batch of its own.
LOCAL_MAX_TOKENS_PER_SENTENCE = 100_000
REMOTE_IN_FLIGHT = 4  # requests in flight to a server: its batcher fills while we write
REMOTE_ATTEMPTS = 10  # per request, for UNAVAILABLE / RESOURCE_EXHAUSTED / CANCELLED (0.1 s doubling to 10 s: 32.7 s)
REMOTE_BACKOFF_FIRST_S = 0.1
REMOTE_BACKOFF_MAX_S = 10.0
# A request's own bytes (token strings plus protobuf framing) stay under this share of the server's advertised
# max_message_bytes: gRPC refuses a larger message with a RESOURCE_EXHAUSTED that no retry can cure.
REQUEST_BYTES_SHARE = 0.8


# -- embedding backends --------------------------------------------------------------------------------------------
class Backend(Protocol):
    """Where vectors come from: the in-process runtime or a remote server. ``embed`` returns per sentence the
    output of ``layout.spec`` as float32 ((n_layers, n, dim) for ``all``, else (n, dim)), for one call group of
    sentences of about ``group_tokens`` tokens."""

    n_layers: int
    dim: int
    max_tokens_per_sentence: int
    group_tokens: int

    def identity(self) -> dict: ...

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]: ...

    def close(self) -> None: ...


def _model_identity(model_dir: Path) -> dict:
    """What makes the vectors what they are: the graphs, their weights and metadata (a re-export changes them)."""
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


class LocalBackend:
    """The in-process onnxruntime runtime (elmo.runtime.Embedder), one session."""

    def __init__(
        self, model_dir: str | Path, spec: LayerSpec, batch_tokens: int | None, threads: int | None = None
    ) -> None:
        from elmo.runtime import Embedder

        self.model_dir = Path(model_dir)
        # The job's fingerprint hashes the export (55 MB for the ELMo-small shape) while the sessions load: hashlib
        # and onnxruntime both give up the GIL, so the two overlap (0.36 -> 0.30 s before the first shard).
        with ThreadPoolExecutor(1, thread_name_prefix="model-identity") as pool:
            identity = pool.submit(_model_identity, self.model_dir)
            self.embedder = Embedder(
                self.model_dir,
                intra_op_threads=threads,
                max_batch_tokens=batch_tokens,
                max_tokens_per_sentence=LOCAL_MAX_TOKENS_PER_SENTENCE,
                wide_batches=True,  # calls of thousands of tokens: on CPU the in_step context graph, where there is one
            )
            self._model_identity = identity.result()
        self.n_layers, self.dim = self.embedder.info.n_layers, self.embedder.info.dim
        self.max_tokens_per_sentence = self.embedder.info.max_tokens_per_sentence
        vector_bytes = self.n_layers * self.dim * 4
        self.group_tokens = max(self.embedder.max_batch_tokens, GROUP_BYTES // vector_bytes)
        self.spec = spec
        self.mix = load_task_mix(self.model_dir, spec.task, self.n_layers, self.dim) if spec.kind == "mix" else None

    def identity(self) -> dict:
        identity = dict(self._model_identity)
        if self.spec.kind == "mix":
            task_file = self.model_dir / "tasks" / str(self.spec.task) / "task.json"
            identity["task_sha256"] = hashlib.sha256(task_file.read_bytes()).hexdigest()
        return identity

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]:
        return [reduce_layers(layers, self.spec, self.mix) for layers in self.embedder.embed_tokens(sentences)]

    def close(self) -> None:
        self.embedder = None  # frees the session (and its GPU memory) when the Ray actors take over


class RemoteBackend:
    """A running ``elmo serve`` through :class:`elmo.client.EmbedderClient` (the one client). Token lists go over
    the wire untouched; requests are cut to the server's advertised limits. ``top`` asks for the last layer only,
    ``mix:TASK`` for the server's task mix only; ``average`` is computed here from all layers, as locally."""

    def __init__(
        self,
        target: str,
        spec: LayerSpec,
        model: str = "",
        wait_s: float = 30.0,
        connection: Connection | None = None,
    ) -> None:
        from elmo.client import Connection

        # retries at one layer: the job's own (_call: 10 attempts over 32.7 s, UNAVAILABLE, RESOURCE_EXHAUSTED and
        # CANCELLED), not also the channel's gRPC retry policy (elmo.client's default, 5 attempts on UNAVAILABLE),
        # which would multiply them: up to 50 requests per call to a server that refuses
        self.client = (connection or Connection()).client(target, retry_policy=None)
        self.spec, self.model = spec, model
        try:
            self._wait_until_serving(target, wait_s)
            self.info = self._model_info(target)
            if spec.kind == "mix" and spec.task not in self.info.tasks:
                available = ", ".join(self.info.tasks) or "none"
                raise InputError(
                    f"--layers mix:{spec.task}: unknown task '{spec.task}' on server {target} "
                    f"(model {self.info.name}); available tasks: {available}"
                )
        except BaseException:
            self.client.close()  # the job never starts: nothing else will close the channel
            raise
        self.n_layers, self.dim = int(self.info.n_layers), int(self.info.dim)
        limits = self.info.limits
        self.max_tokens_per_sentence = int(limits.max_tokens_per_sentence or self.info.max_tokens_per_sentence)
        self.max_inputs = int(limits.max_inputs) or 256
        self.max_request_tokens = int(limits.max_tokens_per_request) or 8192
        self.max_response_bytes = int(limits.max_response_bytes) or 64 << 20
        self.max_message_bytes = int(limits.max_message_bytes) or 4 << 20  # gRPC's own default
        self.group_tokens = REMOTE_IN_FLIGHT * self.max_request_tokens
        self.pool = ThreadPoolExecutor(REMOTE_IN_FLIGHT, thread_name_prefix="embed-file-rpc")

    def _wait_until_serving(self, target: str, wait_s: float) -> None:
        """A server that is starting (or warming up) gets ``wait_s`` seconds to report SERVING on grpc.health."""
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
                raise ElmoError(f"server {target} is not serving after {wait_s:g} s ({problem})")
            time.sleep(0.2)

    def _model_info(self, target: str):
        """The first RPC that needs the token (health checks do not): a refusal here says which flag fixes it."""
        import grpc

        from elmo.client import AUTH_TOKEN_ENV, RemoteError

        try:
            return self.client.model_info(self.model)
        except RemoteError as exc:
            if exc.code == grpc.StatusCode.UNAUTHENTICATED:
                raise ElmoError(
                    f"server {target} refused the job: {exc} (pass --auth-token TOKEN or set {AUTH_TOKEN_ENV})"
                ) from None
            raise

    def identity(self) -> dict:
        return {"server_model": self.info.name, "server_model_version": self.info.version}

    def _call(self, sentences: list[list[str]]) -> list:
        """One Embed request; overload and short outages (a restart, a drain) are retried with backoff, so that
        a long job rides them out; any other status fails the job with the server's message. CANCELLED counts as
        an outage: the job never cancels its own calls, and a server that stops cancels those it is receiving."""
        import grpc

        from elmo.client import RemoteError

        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
        delay = REMOTE_BACKOFF_FIRST_S
        for attempt in range(REMOTE_ATTEMPTS):
            try:
                return self.client.embed(sentences, **self._request_options())
            except RemoteError as exc:
                if exc.code not in retryable or attempt == REMOTE_ATTEMPTS - 1:
                    raise
                log.warning("server: %s; retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, REMOTE_BACKOFF_MAX_S)
        raise AssertionError("unreachable")

    def _request_options(self) -> dict:
        if self.spec.kind == "mix":
            return {"task": self.spec.task, "omit_layers": True, "model": self.model}
        if self.spec.kind == "top":
            return {"layers": [self.n_layers - 1], "model": self.model}
        return {"model": self.model}

    def _response_bytes(self, tokens: list[str]) -> int:
        """A generous estimate of one sentence's share of a response (vectors, token strings, framing)."""
        layers = self.n_layers if self.spec.kind in ("all", "average") else 1
        return len(tokens) * (layers * self.dim * 4 + 16) + sum(len(t) for t in tokens) * 4 + 128

    @staticmethod
    def _request_bytes(tokens: list[str]) -> int:
        """An upper bound on one sentence's share of a request: UTF-8 token strings and protobuf framing."""
        return sum(len(t.encode("utf-8")) for t in tokens) + 6 * len(tokens) + 16

    def requests(self, sentences: list[list[str]]) -> list[list[int]]:
        """Positions cut into requests within max_inputs, max_tokens_per_request, ~80 % of max_response_bytes and
        ~80 % of max_message_bytes (the request itself). A sentence that alone exceeds the request limit is an
        InputError: no server with these limits can take it."""
        request_budget = REQUEST_BYTES_SHARE * self.max_message_bytes - 1024
        requests: list[list[int]] = []
        current: list[int] = []
        tokens = size = request_size = 0
        for position, sentence in enumerate(sentences):
            need, own = self._response_bytes(sentence), self._request_bytes(sentence)
            if own > request_budget:
                raise InputError(
                    f"a sentence of {len(sentence)} tokens needs a {own:,}-byte request, over what the server takes "
                    f"(its --max-message-bytes {self.max_message_bytes:,}; the sentence's first token: "
                    f"{sentence[0][:40]!r}...); a lower --max-sentence-tokens with --overflow window sends it in "
                    "smaller pieces"
                )
            full = len(current) >= self.max_inputs or tokens + len(sentence) > self.max_request_tokens
            over = size + need > 0.8 * self.max_response_bytes - 1024 or request_size + own > request_budget
            if current and (full or over):
                requests.append(current)
                current, tokens, size, request_size = [], 0, 0, 0
            current.append(position)
            tokens, size, request_size = tokens + len(sentence), size + need, request_size + own
        if current:
            requests.append(current)
        return requests

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]:
        """The call group cut into requests, REMOTE_IN_FLIGHT of them on the wire at once."""
        out: list[np.ndarray] = [np.empty(0)] * len(sentences)
        requests = self.requests(sentences)
        answers = self.pool.map(self._call, [[sentences[p] for p in positions] for positions in requests])
        for positions, results in zip(requests, answers):
            for position, result in zip(positions, results):
                if self.spec.kind == "mix":
                    out[position] = result.mix
                elif self.spec.kind == "top":
                    out[position] = result.layers[0]
                else:
                    out[position] = reduce_layers(result.layers, self.spec)
        return out

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


def make_backend(options: JobOptions) -> Backend:
    if options.server:
        return RemoteBackend(
            options.server, options.spec, options.server_model, options.server_wait, options.connection
        )
    return LocalBackend(options.model, options.spec, options.batch_tokens, options.threads)
