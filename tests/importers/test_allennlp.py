"""elmo.importers.allennlp: AllenNLP / bilm-tf import, checked against the original implementation (bilm-tf
fixture) and against the independent float64 NumPy reference on random weights written in the hdf5 layout.

The translator hdf5 -> NumPy-reference layout below is written from the formulas in ../shared/reference/ELMO.md and
shares no code with elmo.importers.allennlp, so a wrong gate order, a missing forget bias, a wrong highway sign or a
wrong conv kernel layout in either one shows up as a mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo.cli import main as elmo_main
from elmo.errors import ConfigError, ElmoError, ModelFileError
from elmo.importers.allennlp import (
    build_model,
    compute_warm_state,
    import_allennlp,
    options_to_config,
    read_hdf5,
    read_options,
    with_warm_state,
)
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import load_model
from elmo.model.config import elmo_medium, elmo_original, elmo_small
from elmo.text.chars import batch_to_char_ids
from tests.numpy_reference import elmo_forward

torch.set_num_threads(1)

SENTENCES = [
    ["The", "cat", "sat", "on", "the", "mat", "."],
    ["a"],
    ["苹果", "公司", "😀", "naïve"],
    ["x" * 70, "Ok", "!"],
    ["<S>", "weird", "</S>", "tokens"],
]


# -- random models in the bilm-tf hdf5 layout --------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    filters: tuple[tuple[int, int], ...]
    n_highway: int
    activation: str
    dim: int  # LSTM cell
    proj: int
    skip: bool
    cell_clip: float | None = 3.0
    proj_clip: float | None = 3.0
    single_layer_names: bool = False  # a one-layer bilm-tf model without MultiRNNCell

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)

    def options(self) -> dict:
        return {
            "lstm": {
                "dim": self.dim,
                "projection_dim": self.proj,
                "n_layers": self.n_layers,
                "cell_clip": self.cell_clip,
                "proj_clip": self.proj_clip,
                "use_skip_connections": self.skip,
            },
            "char_cnn": {
                "embedding": {"dim": 4},
                "filters": [list(f) for f in self.filters],
                "n_highway": self.n_highway,
                "n_characters": 262,
                "max_characters_per_token": 50,
                "activation": self.activation,
            },
        }


SHAPES = [
    Shape("1 layer, no highway, relu", 1, ((1, 4), (2, 6)), 0, "relu", 16, 8, False),
    Shape("2 layers, 1 highway, tanh", 2, ((1, 4), (2, 8), (3, 16)), 1, "tanh", 12, 8, True),
    Shape("3 layers, 2 highway, no cell clip", 3, ((2, 5), (4, 7), (7, 3)), 2, "relu", 10, 6, True, None, 2.0),
    Shape("no CNN_proj, no W_P_0, single-layer names", 1, ((1, 3), (3, 5)), 1, "relu", 8, 8, True, 3.0, 3.0, True),
    Shape("2 layers without skip connections", 2, ((1, 6), (5, 10)), 2, "tanh", 20, 10, False, 1.0, 0.5),
]


def lstm_group(shape: Shape, direction: int, layer: int) -> str:
    if shape.single_layer_names:
        return f"RNN_{direction}/RNN/LSTMCell"
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


def random_hdf5_weights(shape: Shape, seed: int, lstm_scale: float = 0.6) -> dict[str, np.ndarray]:
    """Random weights named and shaped as bilm-tf's dump_weights writes them, large enough for clips and gates
    to matter. ``lstm_scale`` 0.6 makes the recurrence nearly chaotic (clips active); the export tests use a
    milder scale because over 200 steps such a random LSTM amplifies float32 rounding past the export's 1e-5 check."""
    rng = np.random.default_rng(seed)
    d, nf, p, c = 4, shape.n_filters, shape.proj, shape.dim

    def normal(*dims: int, scale: float) -> np.ndarray:
        return rng.normal(0.0, scale, size=dims).astype(np.float32)

    ds = {"char_embed": rng.uniform(-1, 1, size=(261, d)).astype(np.float32)}
    for i, (width, count) in enumerate(shape.filters):
        ds[f"CNN/W_cnn_{i}"] = normal(1, width, d, count, scale=0.5)
        ds[f"CNN/b_cnn_{i}"] = normal(count, scale=0.2)
    for k in range(shape.n_highway):
        ds[f"CNN_high_{k}/W_carry"] = normal(nf, nf, scale=1.0 / np.sqrt(nf))
        ds[f"CNN_high_{k}/b_carry"] = normal(nf, scale=1.0)
        ds[f"CNN_high_{k}/W_transform"] = normal(nf, nf, scale=1.0 / np.sqrt(nf))
        ds[f"CNN_high_{k}/b_transform"] = normal(nf, scale=0.2)
    if nf != p:
        ds["CNN_proj/W_proj"] = normal(nf, p, scale=1.5 / np.sqrt(nf))
        ds["CNN_proj/b_proj"] = normal(p, scale=0.2)
    for direction in (0, 1):
        for layer in range(shape.n_layers):
            group = lstm_group(shape, direction, layer)
            ds[f"{group}/W_0"] = normal(2 * p, 4 * c, scale=lstm_scale)
            ds[f"{group}/B"] = normal(4 * c, scale=0.5)
            if p != c:
                ds[f"{group}/W_P_0"] = normal(c, p, scale=lstm_scale / 0.6)
    return ds


def write_allennlp_files(directory: Path, options: dict, datasets: dict[str, np.ndarray]) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    options_path, weights_path = directory / "options.json", directory / "weights.hdf5"
    options_path.write_text(json.dumps(options))
    with h5py.File(weights_path, "w") as handle:
        for name, array in datasets.items():
            handle.create_dataset(name, data=array)
    return options_path, weights_path


# -- the independent translator: hdf5 layout -> tests/numpy_reference.py layout ----------------------------------
def reference_weights(options: dict, ds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """From ELMO.md: char_embed gets a zero row for id 0; W_cnn (1, width, d, n) is already (width, d, n) in x @ W
    form; AllenNLP gate = 1 - bilm-tf carry = σ(-(x W_carry + b_carry)); TF gate blocks (i, j, f, o) -> (i, f, g, o)
    and +1 on f; W_0 rows [:input] act on the input; no CNN_proj / W_P_0 means identity."""
    cnn, lstm = options["char_cnn"], options["lstm"]
    a = {k: v.astype(np.float64) for k, v in ds.items()}
    p, c = lstm["projection_dim"], lstm["dim"]
    w = {"char_embed": np.vstack([np.zeros((1, cnn["embedding"]["dim"])), a["char_embed"]])}
    for i in range(len(cnn["filters"])):
        w[f"conv_{i}.W"], w[f"conv_{i}.b"] = a[f"CNN/W_cnn_{i}"][0], a[f"CNN/b_cnn_{i}"]
    for k in range(cnn.get("n_highway", 0)):
        w[f"highway_{k}.W_nonlin"] = a[f"CNN_high_{k}/W_transform"]
        w[f"highway_{k}.b_nonlin"] = a[f"CNN_high_{k}/b_transform"]
        w[f"highway_{k}.W_gate"] = -a[f"CNN_high_{k}/W_carry"]
        w[f"highway_{k}.b_gate"] = -a[f"CNN_high_{k}/b_carry"]
    n_filters = sum(n for _, n in cnn["filters"])
    w["proj.W"] = a.get("CNN_proj/W_proj", np.eye(n_filters))
    w["proj.b"] = a.get("CNN_proj/b_proj", np.zeros(n_filters))
    for direction in (0, 1):
        for layer in range(lstm["n_layers"]):
            group = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            if group + "/W_0" not in a:
                group = f"RNN_{direction}/RNN/LSTMCell"
            i_, j_, f_, o_ = np.split(a[f"{group}/W_0"], 4, axis=1)
            bi, bj, bf, bo = np.split(a[f"{group}/B"], 4)
            key = f"lstm_{direction}_{layer}"
            w[f"{key}.W_in"] = np.concatenate([i_, f_, j_, o_], axis=1)[:p]
            w[f"{key}.W_rec"] = np.concatenate([i_, f_, j_, o_], axis=1)[p:]
            w[f"{key}.b"] = np.concatenate([bi, bf + 1.0, bj, bo])
            w[f"{key}.W_proj"] = a.get(f"{group}/W_P_0", np.eye(c))
    return w


def reference_config(options: dict) -> dict:
    cnn, lstm = options["char_cnn"], options["lstm"]
    has_projection = lstm["projection_dim"] < lstm["dim"]  # bilm-tf's LSTMCell has no num_proj (nor proj clip) else
    return {
        "filters": cnn["filters"],
        "n_highway": cnn.get("n_highway", 0),
        "activation": cnn["activation"],
        "n_layers": lstm["n_layers"],
        "cell_clip": lstm.get("cell_clip") or 0.0,
        "proj_clip": (lstm.get("proj_clip") or 0.0) if has_projection else 0.0,
        "residual": bool(lstm.get("use_skip_connections")),
    }


def embed(model: BiLM, sentences: list[list[str]], pad_to: int | None = None) -> np.ndarray:
    """-> layers (B, L+1, T, 2P) as numpy."""
    with torch.no_grad():
        layers, _ = model(torch.as_tensor(batch_to_char_ids(sentences, pad_to=pad_to)).long())
    return layers.numpy()


def max_error_vs_reference(model: BiLM, options: dict, ds: dict, sentences: list[list[str]]) -> float:
    """Max abs error of the model against the NumPy reference, over single-sentence calls and one padded batch."""
    weights, cfg = reference_weights(options, ds), reference_config(options)
    batch = embed(model, sentences)
    worst = 0.0
    for index, sentence in enumerate(sentences):
        expected = elmo_forward(weights, sentence, cfg)
        alone = embed(model, [sentence])[0]
        assert batch.shape[1] == expected.shape[0] == options["lstm"]["n_layers"] + 1
        worst = max(worst, np.abs(alone - expected).max(), np.abs(batch[index, :, : len(sentence)] - expected).max())
        assert (batch[index, :, len(sentence) :] == 0).all()
    return float(worst)


# -- parity with the original implementation (bilm-tf fixture) ---------------------------------------------------
def fixture_top_layer(fixture: Path, list_index: int, sentence_index: int) -> np.ndarray:
    """The fixture's top biLM layer for one sentence: (n_tokens, 2P) = [forward; backward]."""
    with h5py.File(fixture / f"lm_embeddings_{list_index}.hdf5", "r") as handle:
        both = handle[str(sentence_index)][...]
    return np.concatenate([both[0], both[1]], axis=-1)


def fixture_sentences(fixture: Path) -> list[list[list[str]]]:
    return [[s.split() for s in group] for group in json.loads((fixture / "sentences.json").read_text())]


@pytest.fixture(scope="module")
def fixture_model(bilm_tf_fixture) -> BiLM:
    cfg = read_options(bilm_tf_fixture / "options.json")
    return build_model(cfg, read_hdf5(bilm_tf_fixture / "lm_weights.hdf5", cfg))


def test_first_batch_of_the_bilm_tf_fixture_matches_from_a_zero_state(bilm_tf_fixture, fixture_model):
    # Batch 0 = sentence 0 of each list, the only one bilm-tf ran from a zero state; embedded as one padded batch.
    groups = fixture_sentences(bilm_tf_fixture)
    batch = [group[0] for group in groups]
    layers = embed(fixture_model, batch)
    for k, sentence in enumerate(batch):
        expected = fixture_top_layer(bilm_tf_fixture, k, 0)
        assert expected.shape == (len(sentence), 32)
        np.testing.assert_allclose(layers[k, -1, : len(sentence)], expected, atol=1e-5, rtol=0)
    # The later sentences were computed from carried states: a stateless model must differ there.
    later = embed(fixture_model, [groups[0][1]])[0, -1]
    assert np.abs(later - fixture_top_layer(bilm_tf_fixture, 0, 1)).max() > 0.1


def test_translator_of_this_test_file_matches_the_bilm_tf_fixture(bilm_tf_fixture):
    # Validates the independent hdf5 -> reference translation against the original implementation (float64).
    options = json.loads((bilm_tf_fixture / "options.json").read_text())
    ds: dict[str, np.ndarray] = {}
    with h5py.File(bilm_tf_fixture / "lm_weights.hdf5", "r") as handle:
        for group in ("CNN", "CNN_high_0", "CNN_high_1", "CNN_proj"):
            ds.update({f"{group}/{name}": item[...] for name, item in handle[group].items()})
        for direction in (0, 1):
            for layer in (0, 1):
                group = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
                ds.update({f"{group}/{name}": item[...] for name, item in handle[group].items()})
        ds["char_embed"] = handle["char_embed"][...]
    weights, cfg = reference_weights(options, ds), reference_config(options)
    sentence = fixture_sentences(bilm_tf_fixture)[1][0]
    expected = fixture_top_layer(bilm_tf_fixture, 1, 0)
    np.testing.assert_allclose(elmo_forward(weights, sentence, cfg)[-1], expected, atol=1e-5, rtol=0)


def test_warm_state_reproduces_bilm_tf_carried_states(bilm_tf_fixture, fixture_model):
    # bilm-tf carried each batch row's state to the next sentence of its list. Warming up with sentences 0..i-1 of a
    # list must reproduce what it computed for sentence i: this checks the warm-state streams and their direction.
    for k, group in enumerate(fixture_sentences(bilm_tf_fixture)):
        for i in (1, 2, 9):
            warm = with_warm_state(fixture_model, compute_warm_state(fixture_model, group[:i]))
            got = embed(warm, [group[i]])[0, -1]
            np.testing.assert_allclose(got, fixture_top_layer(bilm_tf_fixture, k, i), atol=1e-5, rtol=0)


# -- parity with the independent NumPy reference on random hdf5 weights -------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_random_weights_match_the_numpy_reference(tmp_path, shape):
    options, ds = shape.options(), random_hdf5_weights(shape, seed=len(shape.name))
    options_path, weights_path = write_allennlp_files(tmp_path, options, ds)
    cfg = read_options(options_path)
    model = build_model(cfg, read_hdf5(weights_path, cfg))
    assert max_error_vs_reference(model, options, ds, SENTENCES) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_clips_and_forget_bias_matter_in_the_random_comparison(shape):
    # The comparison above would not notice a wrong clip or forget bias if they never changed the output.
    options, ds = shape.options(), random_hdf5_weights(shape, seed=len(shape.name))
    base = embed(build_model(options_to_config(options), ds), SENTENCES)
    unclipped = {**options, "lstm": {**options["lstm"], "cell_clip": None, "proj_clip": None}}
    assert np.abs(embed(build_model(options_to_config(unclipped), ds), SENTENCES) - base).max() > 1e-3
    no_forget = {k: (v - 1.0 if k.endswith("/B") else v) for k, v in ds.items()}  # cancels the +1
    assert np.abs(embed(build_model(options_to_config(options), no_forget), SENTENCES) - base).max() > 1e-3


# -- the command and the model directory --------------------------------------------------------------------------
def test_cli_writes_a_model_directory_that_loads_like_any_other(tmp_path, capsys):
    shape = SHAPES[1]
    options, ds = shape.options(), random_hdf5_weights(shape, seed=7)
    options_path, weights_path = write_allennlp_files(tmp_path / "src", options, ds)
    out = tmp_path / "imported"
    code = elmo_main(
        ["import-allennlp", "--options", str(options_path), "--weights", str(weights_path), "--out", str(out)]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["dim"] == 2 * shape.proj and summary["warm_state"] is False
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 0 and config["warm_state"] is False and config["residual"] is True
    model = load_model(out)
    assert max_error_vs_reference(model, options, ds, SENTENCES[:3]) <= 1e-5


def test_warm_text_is_stored_with_the_model_and_used(tmp_path, bilm_tf_fixture):
    group = fixture_sentences(bilm_tf_fixture)[2]
    warm_text = tmp_path / "warm.txt"
    warm_text.write_text(" ".join(group[0]) + "\n\n")  # a blank line is skipped
    out = tmp_path / "warm"
    import_allennlp(
        bilm_tf_fixture / "options.json", bilm_tf_fixture / "lm_weights.hdf5", out, warm_text, warm_tokenized=True
    )
    model = load_model(out)
    assert model.cfg.warm_state is True
    np.testing.assert_allclose(embed(model, [group[1]])[0, -1], fixture_top_layer(bilm_tf_fixture, 2, 1), atol=1e-5)
    assert "warm initial state from warm.txt (1 sentences" in (out / "README.md").read_text()


def test_a_zero_warm_state_is_the_stateless_model(fixture_model):
    zero = {k: torch.zeros_like(v) for k, v in compute_warm_state(fixture_model, [["a"]]).items()}
    warm = with_warm_state(fixture_model, zero)
    assert np.array_equal(embed(warm, SENTENCES), embed(fixture_model, SENTENCES))


# -- bad input: one clear error naming the field or the dataset ---------------------------------------------------
def _mutated(path: str, value) -> dict:
    options = SHAPES[1].options()
    *parents, leaf = path.split(".")
    section = options
    for name in parents:
        section = section[name]
    if value is KeyError:
        del section[leaf]
    else:
        section[leaf] = value
    return options


@pytest.mark.parametrize(
    "path, value, field",
    [
        ("char_cnn.n_characters", 300, "char_cnn.n_characters"),
        ("char_cnn.max_characters_per_token", 40, "char_cnn.max_characters_per_token"),
        ("char_cnn.activation", "sigmoid", "char_cnn.activation"),
        ("char_cnn.filters", [[1, 4], [0, 8]], "char_cnn.filters"),
        ("char_cnn.filters", [], "char_cnn.filters"),
        ("char_cnn.embedding", {"dim": 4, "size": 2}, "char_cnn.embedding"),
        ("char_cnn.n_highway", -1, "char_cnn.n_highway"),
        ("char_cnn.peepholes", True, "char_cnn.peepholes"),
        ("lstm.dim", 4, "lstm.projection_dim"),
        ("lstm.dim", KeyError, "lstm.dim"),
        ("lstm.n_layers", 0, "lstm.n_layers"),
        ("lstm.cell_clip", 0, "lstm.cell_clip"),
        ("lstm.use_skip_connections", "yes", "lstm.use_skip_connections"),
        ("lstm.use_peepholes", True, "lstm.use_peepholes"),
        ("char_cnn", KeyError, "char_cnn"),
        ("bidirectional", False, "bidirectional"),
        ("softmax_temperature", 2.0, "softmax_temperature"),
    ],
)
def test_unknown_or_inconsistent_options_name_the_field(path, value, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        options_to_config(_mutated(path, value))


def published_options(cell: int, projection: int, n_highway: int) -> dict:
    """The published AllenNLP options.json files (elmo_2x{cell}_{projection}_2048cnn_{n}xhighway_options.json)."""
    return {
        "lstm": {
            "use_skip_connections": True,
            "projection_dim": projection,
            "cell_clip": 3,
            "proj_clip": 3,
            "dim": cell,
            "n_layers": 2,
        },
        "char_cnn": {
            "activation": "relu",
            "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]],
            "n_highway": n_highway,
            "embedding": {"dim": 16},
            "n_characters": 262,
            "max_characters_per_token": 50,
        },
    }


@pytest.mark.parametrize(
    "cell, projection, n_highway, preset",
    [(1024, 128, 1, elmo_small), (2048, 256, 1, elmo_medium), (4096, 512, 2, elmo_original)],
    ids=["small", "medium", "original / 5.5B"],
)
def test_published_options_give_the_published_shapes(cell, projection, n_highway, preset):
    cfg = options_to_config(published_options(cell, projection, n_highway))
    expected = preset()
    expected.dropout = 0.0  # imported models are for inference
    assert cfg == expected


def test_published_training_options_are_accepted():
    options = SHAPES[1].options()
    options["char_cnn"]["n_characters"] = 261  # as in bilm-tf's training options
    options.update({"bidirectional": True, "dropout": 0.1, "n_epochs": 10, "batch_size": 128, "unroll_steps": 20})
    options["lstm"].pop("use_skip_connections")  # optional in bilm-tf: no skip connections
    cfg = options_to_config(options)
    assert cfg.residual is False and cfg.dropout == 0.0 and cfg.vocab_size == 0


@pytest.mark.parametrize(
    "change, dataset",
    [
        ("lstm_dim", "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"),
        ("missing", "CNN_high_0/b_carry"),
        ("nan", "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0"),
        ("char_embed_rows", "char_embed"),
        ("filter", "CNN/W_cnn_2"),
    ],
)
def test_hdf5_that_disagrees_with_options_names_the_dataset(tmp_path, change, dataset):
    shape = SHAPES[1]
    options, ds = shape.options(), random_hdf5_weights(shape, seed=1)
    if change == "lstm_dim":
        options["lstm"]["dim"] = 24
    elif change == "missing":
        del ds[dataset]
    elif change == "nan":
        ds[dataset][0, 0] = np.nan
    elif change == "char_embed_rows":
        ds[dataset] = np.zeros((262, 4), np.float32)
    else:
        options["char_cnn"]["filters"][2] = [4, 16]
    options_path, weights_path = write_allennlp_files(tmp_path, options, ds)
    with pytest.raises(ModelFileError, match=f"'{dataset}'"):
        cfg = read_options(options_path)
        build_model(cfg, read_hdf5(weights_path, cfg), source=str(weights_path))


def test_cli_reports_bad_files_in_one_line(tmp_path, capsys):
    options_path = tmp_path / "options.json"
    options_path.write_text(json.dumps(_mutated("char_cnn.n_characters", 100)))
    (tmp_path / "weights.hdf5").write_bytes(b"not hdf5")
    args = ["import-allennlp", "--options", str(options_path), "--weights", str(tmp_path / "weights.hdf5")]
    assert elmo_main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elmo import-allennlp: error:") and "char_cnn.n_characters" in err and "\n" not in err
    options_path.write_text(json.dumps(SHAPES[1].options()))
    assert elmo_main([*args, "--out", str(tmp_path / "out")]) == 2
    assert "not a readable hdf5 file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _point_char_embed_elsewhere(handle, name: str, array: np.ndarray, outside: Path) -> None:
    """``name`` re-made so that its bytes live in ``outside`` (HDF5 external storage): h5py reads them transparently."""
    outside.write_bytes(array.astype(np.float32).tobytes())
    del handle[name]
    handle.create_dataset(name, shape=array.shape, dtype=np.float32, external=[(str(outside), 0, array.nbytes)])


def _virtual(handle, name: str, array: np.ndarray, outside: Path) -> None:
    with h5py.File(outside, "w") as source:
        source.create_dataset("data", data=array)
    layout = h5py.VirtualLayout(shape=array.shape, dtype=array.dtype)
    layout[...] = h5py.VirtualSource(str(outside), "data", shape=array.shape)
    del handle[name]
    handle.create_virtual_dataset(name, layout)


def _soft(handle, name: str, array: np.ndarray, outside: Path) -> None:
    handle["stash"] = array
    del handle[name]
    handle[name] = h5py.SoftLink("/stash")


def _external_link(handle, name: str, array: np.ndarray, outside: Path) -> None:
    with h5py.File(outside, "w") as source:
        source.create_dataset("data", data=array)
    del handle[name]
    handle[name] = h5py.ExternalLink(str(outside), "/data")


@pytest.mark.parametrize(
    "redirect, message",
    [
        (_point_char_embed_elsewhere, "keeps its data in external file(s)"),
        (_virtual, "is a virtual dataset"),
        (_soft, "is an HDF5 soft link to /stash"),
        (_external_link, "is an HDF5 external link to"),
    ],
    ids=["external-storage", "virtual", "soft-link", "external-link"],
)
def test_weights_whose_data_lives_elsewhere_are_refused_in_one_line(tmp_path, capsys, redirect, message):
    """An imported weight must come from the weights file itself, never from another file on the host."""
    shape = SHAPES[1]
    options, ds = shape.options(), random_hdf5_weights(shape, seed=7)
    options_path, weights_path = write_allennlp_files(tmp_path / "src", options, ds)
    name = "char_embed"
    with h5py.File(weights_path, "a") as handle:
        redirect(handle, name, ds[name], tmp_path / "outside.bin")
    out = tmp_path / "imported"
    argv = ["import-allennlp", "--options", str(options_path), "--weights", str(weights_path), "--out", str(out)]
    assert elmo_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elmo import-allennlp: error:") and "\n" not in err
    assert message in err and ("'char_embed'" in err) and "refused" in err
    assert not out.exists()


def test_missing_files_are_errors_not_tracebacks(tmp_path):
    with pytest.raises(ElmoError, match="options file not found"):
        read_options(tmp_path / "nope.json")
    with pytest.raises(ElmoError, match="weights file not found"):
        read_hdf5(tmp_path / "nope.hdf5", options_to_config(SHAPES[0].options()))


# -- determinism: a sentence's vectors do not depend on its batch -------------------------------------------------
def _compositions(sentences: list[list[str]], target: list[str]) -> list[tuple[list[list[str]], int, int | None]]:
    """(batch, index of target, pad_to): alone, with extra padding, with shorter and longer neighbours at other
    positions (some sharing one padded shape (2, T) so bit-identity can be checked), and in larger batches."""
    wide = max(len(s) for s in sentences) + 3
    return [
        ([target], 0, None),
        ([target], 0, len(target) + 9),
        ([target, sentences[0]], 0, wide),
        ([sentences[1], target], 1, wide),
        ([sentences[2][:3], target], 1, wide),
        ([sentences[2][:3], target, sentences[4]], 1, None),
        ([*sentences[5:9], target, sentences[0][:1]], 4, None),
        ([target] * 7, 6, None),
    ]


@pytest.mark.parametrize("warm", [False, True], ids=["zero state", "warm state"])
def test_a_sentence_gets_the_same_vectors_in_any_batch(bilm_tf_fixture, fixture_model, warm):
    sentences = fixture_sentences(bilm_tf_fixture)[0]
    model = fixture_model
    if warm:
        model = with_warm_state(fixture_model, compute_warm_state(fixture_model, sentences[:2]))
    target = sentences[3]
    alone = embed(model, [target])[0]
    by_shape: dict[tuple[int, ...], list[np.ndarray]] = {}
    for batch, index, pad_to in _compositions(sentences, target):
        layers = embed(model, batch, pad_to)
        got = layers[index, :, : len(target)]
        assert np.abs(got - alone).max() <= 1e-6
        by_shape.setdefault(layers.shape, []).append(got)
    # Bit-identical whenever the padded batch shape (B, T) is the same, whatever the neighbours and the position
    # (docs/how-to/pretrained.md); a different shape changes the GEMM blocking, hence float32 rounding (<= 1e-6).
    assert max(len(outputs) for outputs in by_shape.values()) == 3
    for outputs in by_shape.values():
        assert all(np.array_equal(outputs[0], other) for other in outputs[1:])


# -- through the exported ONNX graph and the torch-free runtime ----------------------------------------------------
ONNX_TOLERANCE = 1e-4
EXPORT_LSTM_SCALE = 0.3  # see random_hdf5_weights


def cpu_embedder(model_dir: Path, **kwargs):
    from elmo.runtime import CPU, Embedder

    return Embedder(model_dir, providers=[CPU], intra_op_threads=1, **kwargs)


@pytest.fixture(scope="module")
def imported_random_models(tmp_path_factory) -> dict[str, tuple[dict, dict, Path]]:
    """Every random shape imported with `elmo import-allennlp` and exported (verified) with `elmo export`."""
    from elmo.export.onnx_export import export_model

    models = {}
    for shape in SHAPES:
        root = tmp_path_factory.mktemp("allennlp")
        options, ds = shape.options(), random_hdf5_weights(shape, seed=len(shape.name), lstm_scale=EXPORT_LSTM_SCALE)
        options_path, weights_path = write_allennlp_files(root / "src", options, ds)
        import_allennlp(options_path, weights_path, root / "model")
        export_model(root / "model")
        models[shape.name] = (options, ds, root / "model")
    return models


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_exported_onnx_matches_the_numpy_reference(imported_random_models, shape):
    options, ds, model_dir = imported_random_models[shape.name]
    weights, cfg = reference_weights(options, ds), reference_config(options)
    embedder = cpu_embedder(model_dir)
    together = embedder.embed_tokens(SENTENCES)  # one padded batch
    for sentence, batched in zip(SENTENCES, together):
        expected = elmo_forward(weights, sentence, cfg)
        (alone,) = embedder.embed_tokens([sentence])
        assert np.abs(alone - expected).max() <= ONNX_TOLERANCE
        assert np.abs(batched - expected).max() <= ONNX_TOLERANCE


def test_import_export_embed_file_reproduces_the_reference(tmp_path):
    # The Must-show: `elmo import-allennlp` -> `elmo export` -> `elmo embed-file --tokenized --layers all`.
    shape = SHAPES[2]
    options, ds = shape.options(), random_hdf5_weights(shape, seed=11, lstm_scale=EXPORT_LSTM_SCALE)
    options_path, weights_path = write_allennlp_files(tmp_path / "src", options, ds)
    model_dir, text, output = tmp_path / "model", tmp_path / "input.txt", tmp_path / "vectors.hdf5"
    lines = [" ".join(s) for s in SENTENCES] + ["", "one more line"]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["--options", str(options_path), "--weights", str(weights_path), "--out", str(model_dir)]
    assert elmo_main(["import-allennlp", *args]) == 0
    assert elmo_main(["export", "--model", str(model_dir), "--threads", "1"]) == 0
    embed_args = [str(text), str(output), "--model", str(model_dir), "--tokenized", "--layers", "all"]
    assert elmo_main(["embed-file", *embed_args, "--threads", "1", "--no-progress"]) == 0

    weights, cfg = reference_weights(options, ds), reference_config(options)
    with h5py.File(output, "r") as handle:
        for index, line in enumerate(lines):
            tokens = line.split()
            vectors = handle[str(index)][...]
            assert vectors.shape == (shape.n_layers + 1, len(tokens), 2 * shape.proj)
            if tokens:
                assert np.abs(vectors - elmo_forward(weights, tokens, cfg)).max() <= ONNX_TOLERANCE


def test_exported_warm_state_reproduces_bilm_tf_carried_states(tmp_path, bilm_tf_fixture):
    from elmo.export.onnx_export import export_model

    group = fixture_sentences(bilm_tf_fixture)[0]
    warm_text = tmp_path / "warm.txt"
    warm_text.write_text("\n".join(" ".join(s) for s in group[:2]) + "\n")
    out = tmp_path / "warm"
    options, weights = bilm_tf_fixture / "options.json", bilm_tf_fixture / "lm_weights.hdf5"
    import_allennlp(options, weights, out, warm_text, warm_tokenized=True)
    export_model(out)
    (got,) = cpu_embedder(out).embed_tokens([group[2]])
    assert np.abs(got[-1] - fixture_top_layer(bilm_tf_fixture, 0, 2)).max() <= ONNX_TOLERANCE
    np.testing.assert_allclose(got, embed(load_model(out), [group[2]])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("warm", [False, True], ids=["zero state", "warm state"])
def test_runtime_gives_a_sentence_the_same_vectors_in_any_batch(tmp_path, bilm_tf_fixture, warm):
    from elmo.export.onnx_export import export_model

    sentences = fixture_sentences(bilm_tf_fixture)[1]
    warm_text = None
    if warm:
        warm_text = tmp_path / "warm.txt"
        warm_text.write_text(" ".join(sentences[0]) + "\n")
    out = tmp_path / "model"
    options, weights = bilm_tf_fixture / "options.json", bilm_tf_fixture / "lm_weights.hdf5"
    import_allennlp(options, weights, out, warm_text, warm_tokenized=True)
    export_model(out)
    embedder = cpu_embedder(out)
    target = sentences[3]
    (alone,) = embedder.embed_tokens([target])
    outputs = [embedder.embed_tokens(batch)[index] for batch, index, _ in _compositions(sentences, target)]
    # A small token budget splits the same request into other batches.
    outputs.append(cpu_embedder(out, max_batch_tokens=64).embed_tokens([*sentences, target])[-1])
    assert max(np.abs(got - alone).max() for got in outputs) <= 1e-6
    # onnxruntime's CPU kernels give each row the same arithmetic whatever the batch shape: bit-identical
    # (docs/how-to/pretrained.md states this guarantee for the CPU provider).
    assert all(np.array_equal(got, alone) for got in outputs)
