#!/usr/bin/env bash
# The Ray node-kill check in full (docs/how-to/batch.md#multi-node-ray): a head and two worker nodes started with
# `ray start` on 127.0.0.1 (each its own raylet, token authentication on), `elmo embed-file --engine ray` submitted to
# it with --ray-address; its driver SIGKILLed mid-job and the same command run again (it resumes); a worker node's
# raylet SIGKILLed while that run has shards in flight. Checks: the job finishes (Ray restarts the lost actor on
# another node and retries its shard), the output equals the local engine's (every vector, bit for bit), every
# shard committed once. Prints the figures as JSON. tests/batch/test_ray_cluster.py runs the same on 120 lines.
#
#   scripts/ray-cluster-check.sh                                   # tiny random model, 2000 lines, 100 shards
#   scripts/ray-cluster-check.sh --model models/default --lines 3000 --shard-lines 25 --out runs/ray-cluster.json
#
# Needs .venv (make dev or make test: ray[data] from the batch extra). Every Ray process it starts is stopped at the
# end, by process group, even on failure; `ray stop` (which stops every Ray on the machine) is never used.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m tests.batch.ray_cluster check "$@"
