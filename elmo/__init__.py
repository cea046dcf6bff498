"""ELMo contextual embeddings: char-CNN + biLSTM language model, ONNX runtime, gRPC service."""

from pathlib import Path

__version__ = "0.1.0"

# The repository keeps the serving and export code in top-level folders (service/, export/), which an install maps
# to elmo.service and elmo.export (pyproject.toml; bench/, the benchmark lab, is not installed). A source checkout
# run without an install (PYTHONPATH=., as scripts/gpu-train.sh does on a borrowed machine) finds them here instead.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "service" / "server.py").is_file():
    __path__.append(str(_CHECKOUT))  # type: ignore[name-defined]  # noqa: F821
