#!/usr/bin/env bash
# Builds .venv-allennlp: AllenNLP 2.10.1's own ELMo beside a current torch, for bench/runtime/allennlp_side_by_side.py.
# AllenNLP 2.10.1 pins torch<1.13, so it is installed with --no-deps; its ELMo forward pass needs only torch, h5py and
# numpy. The packages its __init__ files import but the ELMo path never calls get stand-in modules
# (bench/runtime/allennlp_stand_ins.py writes them into the venv's site-packages).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-allennlp}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet torch==2.13.0 h5py numpy
"$VENV/bin/pip" install --quiet --no-deps allennlp==2.10.1
"$VENV/bin/python" bench/runtime/allennlp_stand_ins.py
"$VENV/bin/python" -c "from allennlp.modules.elmo import _ElmoBiLm; import allennlp, torch; print('allennlp', allennlp.__version__, 'torch', torch.__version__)"
