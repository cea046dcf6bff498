"""The batch job's view of where vectors come from (elmo.backends: the runtime in process or a running
`elmo serve`): the job's --layers applied to each sentence's answer, and call groups sized for the backend.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from elmo.backends import IN_FLIGHT, JOB_RETRY, LocalBackend, RemoteBackend, model_identity
from elmo.batch.layout import LayerSpec, reduce_layers
from elmo.batch.options import JobOptions
from elmo.batch.plan import GROUP_BYTES
from elmo.errors import InputError

log = logging.getLogger("elmo.batch")


# A batch job embeds documents as they come: the serving limit (elmo.runtime's 1024) would fail a long line, and a
# line longer than a batch simply runs as a batch of its own.
LOCAL_MAX_TOKENS_PER_SENTENCE = 100_000


class Backend(Protocol):
    """What the job's loop needs: ``embed`` returns per sentence the output of ``layout.spec`` as float32
    ((n_layers, n, dim) for ``all``, else (n, dim)), for one call group of about ``group_tokens`` tokens."""

    n_layers: int
    dim: int
    max_tokens_per_sentence: int
    group_tokens: int

    def identity(self) -> dict: ...

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]: ...

    def close(self) -> None: ...


def local_backend(model_dir: str | Path, batch_tokens: int | None, threads: int | None = None) -> LocalBackend:
    """The in-process runtime as the job runs it: wide calls (on CPU the in_step context graph, where the export
    has one) and documents of any length."""
    return LocalBackend(
        model_dir,
        intra_op_threads=threads,
        max_batch_tokens=batch_tokens,
        max_tokens_per_sentence=LOCAL_MAX_TOKENS_PER_SENTENCE,
        wide_batches=True,
    )


class JobBackend:
    """A backend of elmo.backends with the job's --layers: ``top`` asks a server for the last layer only,
    ``mix:TASK`` for the task's mix only; ``average`` is computed here from all layers, as for ``all``."""

    def __init__(self, backend: LocalBackend | RemoteBackend, spec: LayerSpec, identity: dict) -> None:
        self.backend, self.spec, self._identity = backend, spec, identity
        self.n_layers, self.dim = backend.n_layers, backend.dim
        self.max_tokens_per_sentence = backend.max_tokens_per_sentence
        if isinstance(backend, LocalBackend):
            vector_bytes = self.n_layers * self.dim * 4
            self.group_tokens = max(backend.embedder.max_batch_tokens, GROUP_BYTES // vector_bytes)
        else:  # enough requests for every one of the backend's RPC threads
            self.group_tokens = IN_FLIGHT * backend.limits.max_tokens_per_request

    @property
    def embedder(self):
        """The in-process runtime (a local backend only)."""
        return self.backend.embedder

    def identity(self) -> dict:
        return dict(self._identity)

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]:
        if self.spec.kind == "mix":
            return [answer.mix for answer in self.backend.embed(sentences, task=self.spec.task, omit_layers=True)]
        if self.spec.kind == "top":
            return [answer.layers[-1] for answer in self.backend.embed(sentences, layers=[self.n_layers - 1])]
        return [reduce_layers(answer.layers, self.spec) for answer in self.backend.embed(sentences)]

    def close(self) -> None:
        self.backend.close()


def _local(options: JobOptions) -> JobBackend:
    model_dir = Path(options.model)
    # The job's fingerprint hashes the export (55 MB for the ELMo-small shape) while the sessions load: hashlib
    # and onnxruntime both give up the GIL, so the two overlap (0.36 -> 0.30 s before the first shard).
    with ThreadPoolExecutor(1, thread_name_prefix="model-identity") as pool:
        hashing = pool.submit(model_identity, model_dir)
        backend = local_backend(model_dir, options.batch_tokens, options.threads)
        identity = hashing.result()
    if options.spec.kind == "mix":
        backend.check_task(str(options.spec.task))  # UnknownTaskError naming the tasks there are
        task_file = model_dir / "tasks" / str(options.spec.task) / "task.json"
        identity["task_sha256"] = hashlib.sha256(task_file.read_bytes()).hexdigest()
    return JobBackend(backend, options.spec, identity)


def _remote(options: JobOptions) -> JobBackend:
    backend = RemoteBackend(
        options.server, options.server_model, connection=options.connection, wait_s=options.server_wait, retry=JOB_RETRY
    )
    spec = options.spec
    if spec.kind == "mix" and spec.task not in backend.tasks:
        backend.close()  # the job never starts: nothing else will close the channel
        raise InputError(
            f"--layers mix:{spec.task}: unknown task '{spec.task}' on server {options.server} "
            f"(model {backend.info.name}); available tasks: {', '.join(backend.tasks) or 'none'}"
        )
    return JobBackend(backend, spec, backend.identity())


def make_backend(options: JobOptions) -> JobBackend:
    return _remote(options) if options.server else _local(options)
