"""service.common.collector: the serving process's heap frozen once it is warm, and thawed for every release."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import REPO

# In a child process: freezing the test runner's own heap would keep every later test's cycles alive.
CYCLE_SCRIPT = """
import gc, weakref
from elmo.service.common.collector import freeze_long_lived, frozen_objects, settle

class Version:  # a model version that holds a reference cycle
    pass

def version() -> Version:
    made = Version()
    made.itself = made
    return made

garbage = weakref.ref(version())
served = version()
alive = weakref.ref(served)
freeze_long_lived()  # the garbage is collected; the served version is frozen with the heap
print(garbage() is None, alive() is not None, frozen_objects() > 0)
del served  # released: only its own cycle holds it now
gc.collect()
print(alive() is not None)  # a plain collection never scans the frozen heap
settle()
print(alive() is None, frozen_objects() > 0)
"""


def test_a_frozen_cycle_outlives_a_collection_and_not_a_settle() -> None:
    result = subprocess.run([sys.executable, "-c", CYCLE_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"] * 6, result.stdout


def _frozen_gauge(metrics_port: int) -> float:
    from bench.kit.serve import metric_samples

    (sample,) = metric_samples(metrics_port, "elmo_gc_frozen_objects")
    return sample.value


def test_a_warm_server_has_frozen_its_heap(tiny_model_dir) -> None:
    from bench.kit.serve import start_server

    server = start_server(tiny_model_dir, threads=1, http=False, serve_args=["--metrics-port", "0"])
    try:
        deadline = time.monotonic() + 30  # the freeze follows SERVING by the time one line takes
        while (frozen := _frozen_gauge(server.metrics_port)) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
    assert frozen > 10_000  # modules, grpc, onnxruntime and the model: the whole heap, not a handful
