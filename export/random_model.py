"""Random-weight model directories of the published shapes, for tests, benchmarks and the GPU check.

``python -m export.random_model --preset small --out DIR [--export]`` writes config.json + model.safetensors
(and with ``--export`` the verified model.onnx + onnx.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from elmo.checkpoint import save_model
from elmo.config import PRESETS
from elmo.model import BiLM


def random_bilm(preset: str = "tiny", seed: int = 0, scale: float | None = None, **overrides) -> BiLM:
    """A BiLM of a preset shape (``overrides`` replace config fields). ``scale`` replaces every weight by
    N(0, scale) so that gates and clips are exercised; None keeps PyTorch's initialisation."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    torch.manual_seed(seed)
    cfg = PRESETS[preset]()
    for name, value in overrides.items():
        setattr(cfg, name, value)
    model = BiLM(cfg)
    if scale is not None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0.0, scale)
            model.encoder.char_embedding.weight[0].zero_()  # the padding char stays zero, as trained models have it
    return model.eval()


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
        from export.onnx_export import export_model

        export_model(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=None)
    parser.add_argument("--export", action="store_true")
    args = parser.parse_args()
    print(write_random_model(args.out, args.preset, args.seed, args.scale, args.export))


if __name__ == "__main__":
    main()
