"""Random-weight models of the published shapes, for `elmo bench`, the tests, the development benchmarks and the GPU
check.

Two forms:
- a model directory (config.json + model.safetensors, optionally exported):
  ``python -m elmo.bench.random_model --preset small --out DIR [--export]``;
- AllenNLP / bilm-tf files (options.json + weights.hdf5, bilm-tf's dump_weights layout), what a user of the
  published models holds, to feed ``elmo import-allennlp``:
  ``python -m elmo.bench.random_model --preset original --bilm-tf --out DIR``.

The bilm-tf weights are drawn at the scales of a trained model's recurrence rather than PyTorch's initialisation:
LSTM input/recurrent kernels N(0, 1.5/√fan_in), the recurrent projection N(0, 2/√cell). Over hundreds of steps such
an LSTM drives its cell states into the clips and amplifies float32 rounding, which is what an export check meets
on real published weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from elmo.model.bilm import BiLM
from elmo.model.checkpoint import save_model
from elmo.model.config import PRESETS, ModelConfig

OPTIONS_FILE = "options.json"
HDF5_FILE = "weights.hdf5"
LSTM_INPUT_SCALE = 1.5  # × 1/√fan_in for W_0 (input and recurrent rows stacked, as bilm-tf stores them)
PROJECTION_SCALE = 2.0  # × 1/√cell for W_P_0


def random_bilm(preset: str = "tiny", seed: int = 0, scale: float | None = None, **overrides) -> BiLM:
    """A BiLM of a preset shape (``overrides`` replace config fields). ``scale`` replaces every weight by
    N(0, scale) so that gates and clips are exercised; None keeps PyTorch's initialisation."""
    torch.manual_seed(seed)
    model = BiLM(preset_config(preset, **overrides))
    if scale is not None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0.0, scale)
            model.encoder.char_embedding.weight[0].zero_()  # the padding char stays zero, as trained models have it
    return model.eval()


def preset_config(preset: str, **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    cfg = PRESETS[preset]()
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


def write_random_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    scale: float | None = None,
    export: bool = False,
    **overrides,
) -> Path:
    """Write a random model directory; with ``export`` also run (and verify) ``elmo export`` on it."""
    out = Path(out_dir)
    save_model(random_bilm(preset, seed, scale, **overrides), out)
    if export:
        from elmo.export.onnx_export import export_model

        export_model(out)
    return out


EXPORTER_STAMP = "exporter.sha256"


def exporter_digest() -> str:
    """sha256 over the exporter's sources (export/*.py, wherever elmo.export is installed): what a cached export was
    made by."""
    import elmo.export

    digest = hashlib.sha256()
    for path in sorted(Path(elmo.export.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cached_random_model(directory: Path, preset: str) -> Path:
    """``directory`` with random weights of ``preset`` (seed 0), exported by this exporter: written once, and again
    when it is absent, unreadable or exported by other exporter sources (benchmarks must time today's graphs)."""
    from elmo.errors import ModelFileError
    from elmo.runtime.modeldir import read_onnx_metadata

    stamp = directory / EXPORTER_STAMP
    try:
        read_onnx_metadata(directory)
        current = stamp.is_file() and stamp.read_text() == exporter_digest()
    except ModelFileError:
        current = False
    if not current:
        print(f"writing and exporting a random-weight {preset} model into {directory}", flush=True)
        shutil.rmtree(directory, ignore_errors=True)
        write_random_model(directory, preset, seed=0, export=True)
        stamp.write_text(exporter_digest())
    return directory


# -- AllenNLP / bilm-tf files ------------------------------------------------------------------------------------
def bilm_tf_options(cfg: ModelConfig) -> dict:
    """The options.json AllenNLP publishes beside its weights, for a model of ``cfg``'s shape."""
    return {
        "lstm": {
            "use_skip_connections": cfg.residual,
            "projection_dim": cfg.projection_dim,
            "cell_clip": cfg.cell_clip,
            "proj_clip": cfg.proj_clip,
            "dim": cfg.cell_dim,
            "n_layers": cfg.n_layers,
        },
        "char_cnn": {
            "activation": cfg.activation,
            "filters": [list(pair) for pair in cfg.filters],
            "n_highway": cfg.n_highway,
            "embedding": {"dim": cfg.char_dim},
            "n_characters": 262,
            "max_characters_per_token": cfg.max_chars,
        },
    }


def bilm_tf_datasets(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights named and shaped as bilm-tf's dump_weights writes them (x @ W, gates i, j, f, o)."""
    rng = np.random.default_rng(seed)
    d, nf, p, c = cfg.char_dim, cfg.n_filters, cfg.projection_dim, cfg.cell_dim

    def normal(*dims: int, scale: float) -> np.ndarray:
        return rng.normal(0.0, scale, size=dims).astype(np.float32)

    ds = {"char_embed": normal(261, d, scale=1.0)}
    for i, (width, count) in enumerate(cfg.filters):
        ds[f"CNN/W_cnn_{i}"] = normal(1, width, d, count, scale=1.0 / np.sqrt(width * d))
        ds[f"CNN/b_cnn_{i}"] = normal(count, scale=0.1)
    for k in range(cfg.n_highway):
        ds[f"CNN_high_{k}/W_carry"] = normal(nf, nf, scale=1.0 / np.sqrt(nf))
        ds[f"CNN_high_{k}/b_carry"] = normal(nf, scale=0.5)
        ds[f"CNN_high_{k}/W_transform"] = normal(nf, nf, scale=1.0 / np.sqrt(nf))
        ds[f"CNN_high_{k}/b_transform"] = normal(nf, scale=0.1)
    if nf != p:
        ds["CNN_proj/W_proj"] = normal(nf, p, scale=1.0 / np.sqrt(nf))
        ds["CNN_proj/b_proj"] = normal(p, scale=0.1)
    for direction in (0, 1):
        for layer in range(cfg.n_layers):
            group = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            ds[f"{group}/W_0"] = normal(2 * p, 4 * c, scale=LSTM_INPUT_SCALE / np.sqrt(2 * p))
            ds[f"{group}/B"] = normal(4 * c, scale=0.1)
            if p != c:
                ds[f"{group}/W_P_0"] = normal(c, p, scale=PROJECTION_SCALE / np.sqrt(c))
    return ds


def write_bilm_tf_files(out_dir: str | Path, preset: str = "small", seed: int = 0, **overrides) -> tuple[Path, Path]:
    """options.json + weights.hdf5 of a random ``preset``-shape model into ``out_dir``; returns both paths."""
    import h5py

    cfg = preset_config(preset, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options, weights = out / OPTIONS_FILE, out / HDF5_FILE
    options.write_text(json.dumps(bilm_tf_options(cfg), indent=2) + "\n")
    with h5py.File(weights, "w") as handle:
        for name, array in bilm_tf_datasets(cfg, seed).items():
            handle.create_dataset(name, data=array)
    return options, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=None, help="model directory: every weight N(0, scale)")
    parser.add_argument("--export", action="store_true", help="model directory: also export and verify it")
    parser.add_argument("--bilm-tf", action="store_true", help="write options.json + weights.hdf5 instead")
    args = parser.parse_args()
    if args.bilm_tf:
        print(*write_bilm_tf_files(args.out, args.preset, args.seed))
    else:
        print(write_random_model(args.out, args.preset, args.seed, args.scale, args.export))


if __name__ == "__main__":
    main()
