"""``elmo embed-file --engine ray``: the batch job's shards embedded on a Ray cluster with Ray Data.

The driver (:func:`elmo.batch.run_job`) scans the input, resumes the committed-shards log and finishes the output
exactly as in the local engine; only the loop over pending shards moves here. Each pending shard is one row of a
Ray dataset; ``map_batches`` hands rows to a pool of actors built from the callable class :class:`ShardEmbedder`,
which holds one runtime session per actor (created once, in ``__init__``) and runs the same
:func:`elmo.batch.write_shard` as the local engine: read the shard's lines, embed, write the shard file under a
temporary name, rename. The driver commits each shard to the log as its result streams back, so a killed Ray job
resumes like a local one. Actors ask for one GPU each when the cluster has GPUs, else ``--threads`` CPUs.

Fault tolerance is Ray's own, configured here (:func:`restart_policy`), never re-implemented. On a cluster of two or
more nodes an actor whose node is lost is restarted by Ray on another node (``max_restarts=ACTOR_RESTARTS``) and the
shard it held is retried there (``max_task_retries=TASK_RETRIES``, bounded by the restarts); the driver commits each
shard once, whichever attempt wrote it. On a single node nothing else could take the actor over: it is not
restarted (``max_restarts=0``). Ray Data's default (actors restarted forever) is used nowhere: it loops on a shard
that kills its actor (out of memory), and on one node it only makes the driver's core worker print an
``E ... core_worker.cc`` line on every job (an actor restartable with constructor arguments in the object store,
ray#53727). Once the budget is spent, a dead actor ends the job with one line; the committed shards stay, and the
same command resumes from them.

Paths must be visible to every node (a shared filesystem), as for any Ray Data file source. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from pathlib import Path

import numpy as np

from elmo import errors
from elmo.batch.engines import Backend, make_backend
from elmo.batch.jobdir import JobDirectory
from elmo.batch.layout import Layout
from elmo.batch.options import JobOptions
from elmo.batch.pipeline import Progress, write_shard
from elmo.batch.plan import InputPlan, ShardSpec
from elmo.errors import ElmoError

log = logging.getLogger("elmo.batch")

# A lost node (multi-node clusters only): Ray restarts each actor up to ACTOR_RESTARTS times, elsewhere, and resubmits
# the shard that was running on it until the restarted actor answers. The retries are unbounded (-1) because they
# are spent in a burst while the node is not yet declared dead (its actors "temporarily unavailable": 3 retries were
# gone in under a second, ActorUnavailableError, in a run here); the restarts bound them: an actor out of restarts is
# dead, and its shards fail with ActorDiedError. So a shard that kills every actor it meets (out of memory) ends the
# job after ACTOR_RESTARTS restarts instead of looping.
ACTOR_RESTARTS = 3
TASK_RETRIES = -1

_SHARD_FIELDS = [f.name for f in dataclasses.fields(ShardSpec)]
_ENTRY_FIELDS = ("shard", "file", "first_line", "n_lines", "blank", "tokens", "bytes")


class ShardEmbedder:
    """Ray Data callable class: one actor = one runtime session (local model or remote client)."""

    def __init__(self, plan: InputPlan, options: JobOptions, layout: Layout, directory: str) -> None:
        self.plan, self.options, self.layout = plan, options, layout
        self.directory = Path(directory)
        self.backend: Backend = make_backend(options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows of ShardSpec fields -> rows of manifest entries (one per shard written). A user-facing error (a bad
        line, a server's refusal) comes back as data in ``error``, so that the driver can report it as the one line
        it is instead of Ray's remote traceback."""
        entries = []
        for row in range(len(batch["number"])):
            shard = ShardSpec(**{name: int(batch[name][row]) for name in _SHARD_FIELDS})
            try:
                entry = write_shard(self.plan, shard, self.options, self.backend, self.layout, self.directory)
                entry["error"] = ""
            except ElmoError as exc:
                entry = {name: 0 for name in _ENTRY_FIELDS} | {"file": "", "error": f"{type(exc).__name__}\t{exc}"}
            entries.append(entry)
        return {name: np.array([entry[name] for entry in entries]) for name in (*_ENTRY_FIELDS, "error")}


def _absolute(options: JobOptions) -> JobOptions:
    """Actors may start in another working directory: give them absolute paths."""
    return dataclasses.replace(
        options,
        input=options.input.resolve(),
        output=options.output.resolve(),
        model=options.model.resolve() if options.model is not None else None,
    )


def _actor_resources(options: JobOptions, cluster: dict) -> tuple[int, dict]:
    """(number of actors, resources per actor): one GPU each when the cluster has GPUs, else ``threads`` CPUs."""
    gpus = int(cluster.get("GPU", 0))
    threads = max(1, options.threads or 1)
    if gpus:
        return options.workers or gpus, {"num_gpus": 1, "num_cpus": 1}
    cpus = int(cluster.get("CPU", 1))
    return options.workers or max(1, cpus // threads), {"num_gpus": 0, "num_cpus": threads}


def restart_policy(alive_nodes: int) -> dict:
    """Ray's actor options for a cluster of ``alive_nodes`` nodes: restarts and retries where another node can take
    a dead actor's place; none on a single node (where a restart would only bring back ray#53727's error line)."""
    if alive_nodes > 1:
        return {"max_restarts": ACTOR_RESTARTS, "max_task_retries": TASK_RETRIES}
    return {"max_restarts": 0}


def embed_shards_on_ray(
    plan: InputPlan,
    pending: list[ShardSpec],
    options: JobOptions,
    layout: Layout,
    job: JobDirectory,
    progress: Progress,
) -> None:
    """Embed ``pending`` shards on Ray actors, committing each one as its result arrives."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise ElmoError("--engine ray needs Ray Data: pip install 'elmo-service[batch]' (ray[data])") from None
    started_here = not ray.is_initialized()
    if started_here:
        began = time.perf_counter()  # seconds of silence otherwise (4 to 15 s for a local instance on 2 cores)
        where = options.ray_address or os.environ.get("RAY_ADDRESS") or "a new local instance"
        log.info("ray: connecting to %s ...", where)
        _connect(ray, options.ray_address, where)
        log.info("ray: connected in %.1f s (%s)", time.perf_counter() - began, ray.cluster_resources())
    try:
        _quiet_ray_data(ray.data.DataContext.get_current())
        workers, resources = _actor_resources(options, ray.cluster_resources())
        workers = min(workers, len(pending))
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        policy = restart_policy(nodes)
        log.info(
            "ray: %d shards on %d actors, %s each; %d nodes: %s",
            len(pending),
            workers,
            resources,
            nodes,
            ", ".join(f"{key}={value}" for key, value in policy.items()),
        )
        options = _absolute(options)
        light_plan = dataclasses.replace(plan, path=plan.path.resolve(), shards=[])
        rows = [dataclasses.asdict(shard) for shard in pending]
        with warnings.catch_warnings():
            # Ray 2.60 has no named parameter for max_restarts / max_task_retries yet and calls the generic way
            # deprecated; the pinned ray[data]==2.60.0 takes it (Ray Data's own comment names
            # map_batches(..., max_restarts=0)).
            warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated", DeprecationWarning)
            results = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
                ShardEmbedder,
                fn_constructor_kwargs={
                    "plan": light_plan,
                    "options": options,
                    "layout": layout,
                    "directory": str(job.path.resolve()),
                },
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=workers),
                **policy,  # see the module's docstring: Ray restarts and retries across nodes, never for ever
                **resources,
            )
        _commit_rows(results, job, progress)
    finally:
        if started_here:
            ray.shutdown()


def _connect(ray, address: str | None, where: str) -> None:
    """``ray.init``; a cluster that refuses the driver (token authentication, Ray 2.52+) or cannot be reached is one
    line, not Ray's two chained tracebacks."""
    from ray.exceptions import AuthenticationError

    # Ray 2.60 turns token authentication on for a new local instance (and makes the token) and then warns that it
    # did, "Set RAY_AUTH_MODE=disabled to opt out", on every job. Its secure default stays; that one notice is dropped
    # (setting RAY_AUTH_MODE=token ourselves would silence it too, but then Ray makes no token and its GCS aborts).
    logging.getLogger(TOKEN_NOTICE_LOGGER).addFilter(_not_the_default_notice)
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, AuthenticationError) as exc:
        chain, cause = [], exc
        while cause is not None and len(chain) < 10:  # Ray chains it, or quotes it in the text of a RuntimeError
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if any(isinstance(c, AuthenticationError) or "InvalidAuthToken" in str(c) for c in chain):
            raise ElmoError(
                f"the Ray cluster at {where} refused this driver: token authentication is on and this process has "
                "not the cluster's token; run with RAY_AUTH_MODE=token and the token in RAY_AUTH_TOKEN_PATH (a "
                "file) or RAY_AUTH_TOKEN, as on the cluster's nodes (docs/how-to/batch.md#multi-node-ray)"
            ) from None
        if isinstance(exc, ConnectionError):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ElmoError(f"cannot connect to the Ray cluster at {where}: {first[:300]}") from None
        raise


TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def _not_the_default_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster.")


def _quiet_ray_data(context) -> None:
    """Ray Data's own progress output off: ours (tqdm, in the driver) already counts sentences. Ray Data warns that
    its bars are off, advice for a choice made here on purpose: that one warning is dropped, nothing else."""
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data._internal.progress").addFilter(
        lambda record: not record.getMessage().startswith("Progress bars disabled")
    )


def _commit_rows(results, job: JobDirectory, progress: Progress) -> None:
    """Commit each shard as its row streams back; a user error from an actor, or an actor that died (out of
    memory, a lost node), ends the job with one line."""
    import ray.exceptions

    died = (
        ray.exceptions.ActorDiedError,
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.OutOfMemoryError,
    )
    try:
        for row in results.iter_rows():
            if row["error"]:
                kind, _, message = str(row["error"]).partition("\t")
                raise getattr(errors, kind, ElmoError)(message)
            entry = {name: (str(row[name]) if name == "file" else int(row[name])) for name in _ENTRY_FIELDS}
            if entry["shard"] in job.committed:  # Ray delivers each row once; a retry must never commit twice
                log.warning("ray: shard %d came back a second time; it is committed once", entry["shard"])
                continue
            job.commit(entry)
            progress(entry["n_lines"], entry["tokens"])
    except died as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ElmoError(
            f"a Ray actor died ({type(exc).__name__}: {first[:300]}); {len(job.committed)} shards are committed in "
            f"{job.path}: run the same command again to resume"
        ) from None
