"""One model version for every process of an ``elmo serve --processes N --model-root DIR`` group.

Each process has its own :class:`~elmo.service.models.versions.ModelManager`; what they load must not drift apart.
So the group shares, in the supervisor's work folder (``GROUP_DIR_ENV``):

- ``policy.json``: what the admin API asked for (versions loaded or unloaded by number, models unloaded whole) and a
  round number. Whoever changes it (a process answering an admin call; the supervisor when the repository on disk
  changed) bumps the round, under an exclusive lock (``flock``) on ``policy.lock``;
- ``status-I.json`` per process: the round it last reconciled to and the version of every model it serves.

The supervisor sends ``RECONCILE_SIGNAL`` to every warm process whose status is behind the round; each then reads the
policy and the disk and reconciles, as one process does (service.models.versions), and writes its status. The group
has swapped once every process's status reached the round: a process answering an admin call waits for that before
it answers, and the supervisor logs it (and exports it: ``elmo_group_model_version``). Each process decides alone from
the same policy and the same files, so they load the same versions; one that fails where the others do not (memory)
is named in the supervisor's log.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GROUP_DIR_ENV = "ELMO_SERVE_GROUP_DIR"  # the supervisor's work folder, in every process of a group
PROCESS_INDEX_ENV = "ELMO_SERVE_PROCESS_INDEX"  # this process's place in the group (0 .. N-1)
GROUP_SIZE_ENV = "ELMO_SERVE_GROUP_SIZE"
RECONCILE_SIGNAL = signal.SIGHUP  # from the supervisor: read the policy and the disk again


@dataclass
class Policy:
    """The admin API's choices (service.models.versions explains each) and the round they were last changed in."""

    pinned: dict[str, set[int]] = field(default_factory=dict)  # loaded by number: kept loaded
    excluded: dict[str, set[int]] = field(default_factory=dict)  # unloaded by number: not loaded again
    unwanted: set[str] = field(default_factory=set)  # unloaded whole: the poller leaves it alone
    round: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "round": self.round,
                "pinned": {name: sorted(v) for name, v in self.pinned.items()},
                "excluded": {name: sorted(v) for name, v in self.excluded.items()},
                "unwanted": sorted(self.unwanted),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Policy:
        data = json.loads(text) if text.strip() else {}
        return cls(
            pinned={name: set(v) for name, v in data.get("pinned", {}).items()},
            excluded={name: set(v) for name, v in data.get("excluded", {}).items()},
            unwanted=set(data.get("unwanted", [])),
            round=int(data.get("round", 0)),
        )


@dataclass(frozen=True)
class ProcessStatus:
    round: int
    serving: dict[str, int]  # model name -> the version that takes its new requests


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old text or the new, never half of one."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(text)
    os.replace(scratch, path)


class ModelGroup:
    """The shared policy and the processes' statuses, from either side (a process: ``index`` set; the supervisor)."""

    def __init__(self, directory: Path, size: int, index: int | None = None) -> None:
        self.directory = Path(directory)
        self.size = size
        self.index = index

    @classmethod
    def from_environment(cls) -> ModelGroup | None:
        """The group this process belongs to, as the supervisor described it; None outside a group."""
        directory = os.environ.get(GROUP_DIR_ENV)
        if not directory:
            return None
        return cls(Path(directory), int(os.environ[GROUP_SIZE_ENV]), int(os.environ[PROCESS_INDEX_ENV]))

    def environment(self, index: int) -> dict[str, str]:
        return {GROUP_DIR_ENV: str(self.directory), GROUP_SIZE_ENV: str(self.size), PROCESS_INDEX_ENV: str(index)}

    # -- the policy --------------------------------------------------------------------------------------------
    @property
    def _policy_path(self) -> Path:
        return self.directory / "policy.json"

    def policy(self) -> Policy:
        try:
            return Policy.from_json(self._policy_path.read_text())
        except FileNotFoundError:
            return Policy()

    def change(self, mutate: Callable[[Policy], None]) -> Policy:
        """Apply ``mutate`` to the policy and bump its round, under the group's lock; the new policy."""
        with open(self.directory / "policy.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                policy = self.policy()
                mutate(policy)
                policy.round += 1
                _write_atomically(self._policy_path, policy.to_json())
                return policy
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- the statuses ------------------------------------------------------------------------------------------
    def _status_path(self, index: int) -> Path:
        return self.directory / f"status-{index}.json"

    def report(self, status: ProcessStatus) -> None:
        """This process's status (a process of the group only)."""
        assert self.index is not None
        _write_atomically(self._status_path(self.index), json.dumps({"round": status.round, "serving": status.serving}))

    def status(self, index: int) -> ProcessStatus | None:
        try:
            data = json.loads(self._status_path(index).read_text())
        except (FileNotFoundError, ValueError):
            return None
        return ProcessStatus(int(data["round"]), {name: int(v) for name, v in data["serving"].items()})

    def forget(self, index: int) -> None:
        """A process replaced: its successor reports afresh."""
        self._status_path(index).unlink(missing_ok=True)

    def statuses(self) -> list[ProcessStatus | None]:
        return [self.status(i) for i in range(self.size)]

    def settled(self, round_: int) -> list[ProcessStatus] | None:
        """Every process's status once all reconciled to ``round_`` or later; None while one has not."""
        statuses = self.statuses()
        if any(s is None or s.round < round_ for s in statuses):
            return None
        return statuses  # type: ignore[return-value]


def describe(statuses: list[ProcessStatus]) -> tuple[dict[str, int], str | None]:
    """(the version every process serves of each model, or None where they differ: what each serves)."""
    names = sorted({name for s in statuses for name in s.serving})
    agreed: dict[str, int] = {}
    differing = []
    for name in names:
        versions = [s.serving.get(name, 0) for s in statuses]
        if len(set(versions)) == 1:
            agreed[name] = versions[0]
        else:
            differing.append(f"{name}: " + ", ".join(f"process {i} @{v or 'none'}" for i, v in enumerate(versions)))
    return agreed, "; ".join(differing) or None


__all__ = ["GROUP_DIR_ENV", "RECONCILE_SIGNAL", "ModelGroup", "Policy", "ProcessStatus", "describe"]
