"""How torch's OpenMP threads wait between parallel regions, chosen by ``elmo`` before torch is imported.

torch's CPU kernels run on GNU OpenMP (libgomp). Left alone, libgomp lets a thread that has finished its share spin
for a while (about 3 ms) before it sleeps. The biLM's LSTM runs a few small parallel regions per time step, so its
threads wait often: on an idle machine the spinning is harmless, but on a busy one a spinning thread burns the time
slice that the thread it waits for needs, and training crawls (154 tokens/s with libgomp's default, 1,915 with
``OMP_WAIT_POLICY=PASSIVE``, on the same busy 2-core machine). bench/notes/thread-policy.md holds the variants
measured side by side, idle and busy: the figures behind the choice below.

libgomp reads the variables once, when it is loaded (the first ``import torch``), so ``elmo`` sets them before it
imports the command's module; a value the user set wins. Torch-free, so that ``elmo`` itself stays torch-free.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"  # libgomp's own knob: set by the user, it decides the spinning whatever the policy
# Measured (docs/how-to/train.md, "Threads on a busy machine", 2 cores): with a busy-looping process per core, PASSIVE
# made `elmo train` 1.95x and `elmo adapt` 3.1x faster than libgomp's default, and 5-11 % slower on an idle machine;
# shorter spins (GOMP_SPINCOUNT 1,000 / 10,000) cost as much idle and recovered less when busy.
CHOSEN: dict[str, str] = {WAIT_POLICY: "PASSIVE"}


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put the chosen wait policy into ``environ`` (the process environment by default, so that child processes such
    as torchrun's workers inherit it) unless the user chose one; returns what this call set (empty when nothing).

    Must run before torch is imported: once libgomp is loaded the variables change nothing."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in (WAIT_POLICY, SPIN_COUNT)):
        return {}  # the user's own choice (even one we would not make) is kept
    environ.update(CHOSEN)
    return dict(CHOSEN)


def policy_in_force(environ: MutableMapping[str, str] | None = None) -> str:
    """One word for logs and benchmarks: the wait policy libgomp will see, ``default`` when none is set."""
    environ = os.environ if environ is None else environ
    parts = [f"{name}={environ[name]}" for name in (WAIT_POLICY, SPIN_COUNT) if name in environ]
    return " ".join(parts) or "default"


def torch_already_loaded() -> bool:
    """True when torch (and so libgomp) is already in this process: setting the variables now would change nothing."""
    return "torch" in sys.modules


__all__ = ["CHOSEN", "SPIN_COUNT", "WAIT_POLICY", "apply_wait_policy", "policy_in_force", "torch_already_loaded"]
