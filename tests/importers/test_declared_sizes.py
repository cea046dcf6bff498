"""Hostile weight files: a few KB that declare gigabytes. Every importer checks each declared shape and dtype against
what the config implies, and the total against the byte budget, before it reads anything; datasets it does not use
stay unread. The refusals are one line, and the peak memory of the import (a child process, `elmo import-...`) stays
near the interpreter's own (torch alone is ~220 MiB, the importer's modules ~255 MiB: the 300 MiB bound leaves room
for a small model, not for one declared gigabyte).
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import random
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo.cli import main as elmo_main
from elmo.errors import ElmoError
from elmo.importers.allennlp import read_hdf5, read_options
from elmo.importers.manylangs import import_manylangs
from elmo.importers.torch_state import read_declarations
from tests.conftest import FUZZ_SEED
from tests.importers.test_allennlp import SHAPES, random_hdf5_weights, write_allennlp_files
from tests.importers.test_manylangs import write_synthetic_folder

REPO = Path(__file__).resolve().parents[2]
ELMO = Path(sys.executable).with_name("elmo")
PEAK_RSS_LIMIT_MIB = 300
SHAPE = SHAPES[1]  # 2 layers, 1 highway: every kind of dataset


# The child is started by a small Python process that reports its peak: a child forked straight from this test
# process would inherit the test process's own peak (Linux carries the high-water mark of the memory it replaced
# through exec), and pytest with torch loaded is itself near the bound.
MEASURE = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "_, status, usage = os.wait4(child.pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def run_import(tmp_path: Path, *argv: str) -> tuple[int, str, float]:
    """``elmo ARGV`` in a child process -> (exit status, stderr, its peak RSS in MiB)."""
    report = tmp_path / "peak_rss_kib"
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(report), str(ELMO), *argv],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stderr, int(report.read_text()) / 1024  # ru_maxrss: KiB on Linux


def declare(weights: Path, name: str, shape: tuple[int, ...], dtype=np.float32) -> None:
    """Replace (or add) ``name`` with a dataset declaring ``shape`` and no stored bytes (chunked, never written)."""
    with h5py.File(weights, "a") as handle:
        if name in handle:
            del handle[name]
        chunk = tuple(min(n, 1024) for n in shape)
        handle.create_dataset(name, shape=shape, dtype=dtype, chunks=chunk)


def valid_files(directory: Path, options: dict | None = None) -> tuple[Path, Path]:
    return write_allennlp_files(directory, options or SHAPE.options(), random_hdf5_weights(SHAPE, seed=3))


def import_argv(options: Path, weights: Path, out: Path, *extra: str) -> list[str]:
    return ["import-allennlp", "--options", str(options), "--weights", str(weights), "--out", str(out), *extra]


def one_error_line(err: str, command: str = "import-allennlp") -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err  # no traceback, no second line
    assert lines[0].startswith(f"elmo {command}: error:"), err
    return lines[0]


# -- in process: what is refused, and how it is said -------------------------------------------------------------
CHAR_EMBED_SHAPE = (261, 4)  # SHAPE's char_cnn.embedding.dim is 4


@pytest.mark.parametrize(
    "name, shape, dtype, says",
    [
        ("char_embed", (1 << 18, 1 << 10), np.float32, "is declared (262144, 1024) float32"),
        ("char_embed", (1 << 24, 1 << 10), np.float32, "is declared (16777216, 1024) float32"),  # 64 GiB
        ("char_embed", CHAR_EMBED_SHAPE, np.float64, "is declared (261, 4) float64"),
        ("char_embed", CHAR_EMBED_SHAPE, np.int32, "is declared (261, 4) int32"),
        ("RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0", (16, 48, 1), np.float32, "is declared (16, 48, 1) float32"),
    ],
    ids=["1-GiB-wrong-shape", "64-GiB", "float64", "int32", "extra-axis"],
)
def test_a_declaration_unlike_the_options_is_refused_naming_both(tmp_path, capsys, name, shape, dtype, says):
    options, weights = valid_files(tmp_path / "src")
    declare(weights, name, shape, dtype)
    out = tmp_path / "out"
    assert elmo_main(import_argv(options, weights, out)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(weights) in line and f"'{name}'" in line and says in line and "refused before reading" in line
    assert "options.json implies" in line and "float32" in line
    assert not out.exists()


def test_options_that_imply_more_than_the_budget_are_refused_before_the_file_is_read(tmp_path, capsys):
    options = SHAPE.options()
    options["char_cnn"]["embedding"]["dim"] = 1 << 28  # char_embed alone: 261 x 2^28 float32 = 261 GiB
    options_path, weights = valid_files(tmp_path / "src", options)
    assert elmo_main(import_argv(options_path, weights, tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "options.json implies" in line and "over the 2,147,483,648-byte budget (--max-weight-bytes)" in line

    # the flag moves the bound: the valid small model is refused under a 1 KB budget, imported under the default
    options_path, weights = valid_files(tmp_path / "small")
    assert elmo_main(import_argv(options_path, weights, tmp_path / "out", "--max-weight-bytes", "1000")) == 2
    assert "over the 1,000-byte budget" in one_error_line(capsys.readouterr().err)
    assert elmo_main(import_argv(options_path, weights, tmp_path / "out")) == 0
    assert elmo_main(import_argv(options_path, weights, tmp_path / "o2", "--max-weight-bytes", "0")) == 2
    assert "--max-weight-bytes must be at least 1" in capsys.readouterr().err


def test_a_dataset_the_import_does_not_use_is_never_read(tmp_path, capsys):
    options, weights = valid_files(tmp_path / "src")
    declare(weights, "softmax/W", (1 << 19, 1 << 10))  # 2 GiB declared, no bytes stored
    declare(weights, "junk/float64", (1 << 20, 1 << 10), np.float64)
    assert weights.stat().st_size < 64 << 10
    out = tmp_path / "out"
    assert elmo_main(import_argv(options, weights, out)) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["n_layers"] == SHAPE.n_layers
    assert "ignored 2 dataset(s) not used for embedding (not read)" in captured.err
    assert (out / "model.safetensors").is_file()


# -- in a child process: the peak memory ------------------------------------------------------------------------
@pytest.mark.slow  # four imports in child processes, ~3 s each (torch's import)
def test_kb_files_declaring_gigabytes_stay_under_the_memory_bound(tmp_path):
    cases = {
        "wrong-shape-1GiB": ("char_embed", (1 << 18, 1 << 10), np.float32, 2),
        "float64": ("char_embed", CHAR_EMBED_SHAPE, np.float64, 2),
        "64GiB": ("char_embed", (1 << 24, 1 << 10), np.float32, 2),
        "unused-2GiB": ("softmax/W", (1 << 19, 1 << 10), np.float32, 0),
    }
    peaks = {}
    for case, (name, shape, dtype, status) in cases.items():
        options, weights = valid_files(tmp_path / case)
        if case == "float64":  # right shape, wrong type, and a gigabyte of it: embedding dim 2^20
            big = SHAPE.options()
            big["char_cnn"]["embedding"]["dim"] = 1 << 20
            options.write_text(json.dumps(big))
            shape = (261, 1 << 20)
        declare(weights, name, shape, dtype)
        assert weights.stat().st_size < 64 << 10
        rc, err, peak = run_import(tmp_path / case, *import_argv(options, weights, tmp_path / case / "out"))
        assert rc == status, err
        if status:
            assert f"'{name}'" in one_error_line(err)
        peaks[case] = peak
    assert all(peak < PEAK_RSS_LIMIT_MIB for peak in peaks.values()), peaks


# -- ELMoForManyLangs: torch state dict files, read without unpickling -------------------------------------------
class _Storage:
    """Pickled as torch.save pickles a storage: a persistent id naming its type, key and element count."""

    def __init__(self, key: str, numel: int, kind=torch.FloatStorage) -> None:
        self.key, self.numel, self.kind = key, numel, kind


class _Tensor:
    """Pickled as torch.save pickles a tensor: torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> None:
        self.storage, self.shape, self.stride, self.offset = storage, shape, stride, offset

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (
            self.storage,
            self.offset,
            self.shape,
            self.stride,
            False,
            collections.OrderedDict(),
        )


class _StatePickler(pickle.Pickler):
    legacy = False

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):  # the legacy layout adds a view (None: the whole storage)
            return ("storage", obj.kind, obj.key, "cpu", obj.numel, *((None,) if self.legacy else ()))
        return None


def forge_state_file(path: Path, tensors: dict[str, _Tensor], data: dict[str, bytes], legacy: bool) -> None:
    """A state dict file in torch.save's layout (zip or legacy) that declares whatever ``tensors`` say, holding the
    storage bytes ``data``: the declarations a hostile file can make, without torch checking them on the way."""
    pickled = io.BytesIO()
    pickler = _StatePickler(pickled, protocol=2)
    pickler.legacy = legacy
    pickler.dump(collections.OrderedDict(tensors))
    if legacy:
        with open(path, "wb") as handle:
            for header in (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True, "protocol_version": 1001}):
                pickle.dump(header, handle, protocol=2)
            handle.write(pickled.getvalue())
            pickle.dump(sorted(data), handle, protocol=2)
            for key in sorted(data):
                numel = next(t.storage.numel for t in tensors.values() if t.storage.key == key)
                handle.write(struct.pack("<q", numel) + data[key])
        return
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickled.getvalue())
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/byteorder", "little")
        for key, blob in data.items():
            archive.writestr(f"archive/data/{key}", blob)


def resave(path: Path, legacy: bool, edit=None) -> None:
    """Re-write ``path`` (a state dict) in the zip or the legacy layout, after ``edit(state)``."""
    state = torch.load(path, weights_only=True)
    if edit:
        edit(state)
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)


def import_manylangs_argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["import-manylangs", "--model", str(folder), "--out", str(out), *extra]


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_both_torch_layouts_import_to_the_same_model(tmp_path, legacy):
    """ELMoForManyLangs' published .pkl files are torch's legacy layout; the reader reads it and the zip layout
    alike, with numpy, and the result is what torch itself loads."""
    folder = write_synthetic_folder(tmp_path / "peer")
    for name in ("token_embedder.pkl", "encoder.pkl"):
        resave(folder / name, legacy)
        assert zipfile.is_zipfile(folder / name) is not legacy
    model = import_manylangs(folder, tmp_path / "ours")
    state = model.state_dict()
    token = torch.load(folder / "token_embedder.pkl", weights_only=True)
    torch.testing.assert_close(state["encoder.projection.weight"], token["projection.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["encoder.char_embedding.weight"][1:], token["char_emb_layer.embedding.weight"])
    encoder = torch.load(folder / "encoder.pkl", weights_only=True)
    torch.testing.assert_close(
        state["backward_layers.1.state_projection.weight"],
        encoder["backward_layer_1.state_projection.weight"],
        rtol=0,
        atol=0,
    )


def _declare_in_token_embedder(
    folder: Path, legacy: bool, name: str, shape, stride, numel: int, data: bytes, kind=torch.FloatStorage
) -> None:
    """token_embedder.pkl re-forged: its real tensors, and ``name`` declared as given (storage key "x")."""
    state = torch.load(folder / "token_embedder.pkl", weights_only=True)
    tensors, blobs = {}, {}
    for index, (key, tensor) in enumerate(state.items()):
        if key == name:
            continue
        tensor = tensor.contiguous()
        storage = _Storage(str(index), tensor.numel())
        tensors[key] = _Tensor(storage, tuple(tensor.shape), tuple(tensor.stride()))
        blobs[storage.key] = tensor.numpy().astype("<f4").tobytes()
    tensors[name] = _Tensor(_Storage("x", numel, kind), shape, stride)
    blobs["x"] = data
    forge_state_file(folder / "token_embedder.pkl", tensors, blobs, legacy)


PROJECTION = "projection.weight"  # (8, 34) in the synthetic network: P x (n_filters + word_dim)
MANYLANGS_CASES = {
    # a 2^40-element view of one stored float (stride 0): 4 TiB if anything materialised it
    "4TiB-view": (PROJECTION, (1 << 20, 1 << 20), (0, 0), 1, b"\0" * 4, "is declared (1048576, 1048576) float32"),
    # a storage that declares 64 GiB, stored as 4 bytes
    "64GiB-storage": (PROJECTION, (8, 34), (34, 1), 1 << 34, b"\0" * 4, "68,719,476,736"),
    "float64": (PROJECTION, (8, 34), (34, 1), 8 * 34, b"\0" * 8 * 8 * 34, "is declared (8, 34) float64"),
}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("case", list(MANYLANGS_CASES))
def test_a_manylangs_declaration_unlike_the_config_is_refused(tmp_path, capsys, case, legacy):
    name, shape, stride, numel, data, says = MANYLANGS_CASES[case]
    folder = write_synthetic_folder(tmp_path / "peer")
    kind = torch.DoubleStorage if case == "float64" else torch.FloatStorage
    _declare_in_token_embedder(folder, legacy, name, shape, stride, numel, data, kind)
    assert (folder / "token_embedder.pkl").stat().st_size < 64 << 10
    out = tmp_path / "out"
    assert elmo_main(import_manylangs_argv(folder, out)) == 2
    line = one_error_line(capsys.readouterr().err, "import-manylangs")
    assert "token_embedder.pkl" in line and says in line
    assert not out.exists()


def test_a_manylangs_config_over_the_budget_is_refused_before_reading(tmp_path, capsys):
    folder = write_synthetic_folder(tmp_path / "peer")
    net = json.loads((folder / "net.json").read_text())
    net["encoder"]["dim"] = 1 << 24  # four LSTMs of 4 x 2^24 x 8 floats each, and more: ~ 9 GiB
    (folder / "net.json").write_text(json.dumps(net))
    assert elmo_main(import_manylangs_argv(folder, tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err, "import-manylangs")
    assert "the network config with the vocabularies implies" in line and "(--max-weight-bytes)" in line
    folder = write_synthetic_folder(tmp_path / "small")
    assert elmo_main(import_manylangs_argv(folder, tmp_path / "out", "--max-weight-bytes", "1000")) == 2
    assert "over the 1,000-byte budget" in one_error_line(capsys.readouterr().err, "import-manylangs")


def test_nothing_in_a_state_dict_file_is_unpickled(tmp_path, capsys):
    """A pickle that would write a file when unpickled: the reader never calls what a pickle names."""
    folder = write_synthetic_folder(tmp_path / "peer")
    marker = tmp_path / "written-by-the-pickle"

    class WritesAFile:
        def __reduce__(self):
            return open, (str(marker), "w")

    with open(folder / "encoder.pkl", "wb") as handle:
        pickle.dump(collections.OrderedDict({"forward_layer_0.input_linearity.weight": WritesAFile()}), handle, 2)
    assert elmo_main(import_manylangs_argv(folder, tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err, "import-manylangs")
    assert "encoder.pkl" in line and not marker.exists()


@pytest.mark.slow  # three imports in child processes, ~3 s each (torch's import)
def test_manylangs_files_declaring_gigabytes_stay_under_the_memory_bound(tmp_path):
    peaks = {}
    for case in ("4TiB-view", "64GiB-storage"):
        for legacy in (False, True):
            name, shape, stride, numel, data, says = MANYLANGS_CASES[case]
            folder = write_synthetic_folder(tmp_path / f"{case}-{legacy}" / "peer")
            _declare_in_token_embedder(folder, legacy, name, shape, stride, numel, data)
            rc, err, peak = run_import(folder.parent, *import_manylangs_argv(folder, folder.parent / "out"))
            assert rc == 2 and says in one_error_line(err, "import-manylangs")
            peaks[f"{case}-{'legacy' if legacy else 'zip'}"] = peak
    assert all(peak < PEAK_RSS_LIMIT_MIB for peak in peaks.values()), peaks


@pytest.mark.parametrize("word_dim", [0, 6])
def test_the_shapes_checked_are_the_models_own(word_dim):
    """The ManyLangs importer checks declarations against shapes worked out from the config (no model is built
    before the files pass): they are exactly the float parameters of the BiLM that config builds."""
    from elmo.importers.manylangs import expected_shapes, network_to_config
    from elmo.model.bilm import BiLM
    from tests.importers.test_manylangs import network

    cfg = network_to_config(network(word_dim), "net.json", 30, 40)
    model_shapes = {k: tuple(v.shape) for k, v in BiLM(cfg).state_dict().items() if v.is_floating_point()}
    assert expected_shapes(cfg) == model_shapes


def test_text_files_over_their_bound_are_refused_unread(tmp_path, capsys, monkeypatch):
    from elmo.importers import manylangs

    folder = write_synthetic_folder(tmp_path / "peer")
    size = (folder / "char.dic").stat().st_size
    monkeypatch.setattr(manylangs, "MAX_DIC_BYTES", size - 1)
    assert elmo_main(import_manylangs_argv(folder, tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err, "import-manylangs")
    assert "char.dic" in line and f"{size:,} bytes, over the {size - 1:,} this file may have (a .dic file)" in line
    monkeypatch.setattr(manylangs, "MAX_DIC_BYTES", 1 << 27)
    (folder / "net.json").write_bytes(b" " * (2 << 20))  # a 2 MiB "config"
    assert elmo_main(import_manylangs_argv(folder, tmp_path / "out")) == 2
    assert "net.json" in one_error_line(capsys.readouterr().err, "import-manylangs")


@pytest.mark.parametrize(
    "pickled",
    [
        b"\x80\x02" + b")" + b"\x85" * 200_000 + b".",  # a tuple nested 200,000 deep
        b"\x80\x02}X" + struct.pack("<I", 1 << 30) + b"x" * 10 + b".",  # a string declaring 1 GiB, 10 bytes there
        b"\x80\x02}(X" + struct.pack("<I", 5000) + b"n" * 5000 + b"K\x01u.",  # a 5,000-character entry name
        b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.",  # os.system("true"): named, never called
    ],
    ids=["deep-nesting", "short-string", "long-name", "os.system"],
)
@pytest.mark.parametrize("layout", ["zip", "raw"])
def test_a_malformed_pickle_is_one_short_line(tmp_path, capsys, pickled, layout):
    folder = write_synthetic_folder(tmp_path / "peer")
    if layout == "zip":
        with zipfile.ZipFile(folder / "encoder.pkl", "w") as archive:
            archive.writestr("archive/data.pkl", pickled)
    else:
        (folder / "encoder.pkl").write_bytes(pickled)
    assert elmo_main(import_manylangs_argv(folder, tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err, "import-manylangs")
    assert "encoder.pkl" in line and len(line) < 600


# -- corrupted files: whatever the bytes, one line or an import, never a traceback -------------------------------
def _mutated(data: bytes, rng: random.Random, head: int) -> bytes:
    """``data`` with 1-16 bytes overwritten, mostly in its first ``head`` bytes (headers, pickles, B-trees)."""
    mutated = bytearray(data)
    for _ in range(rng.choice([1, 2, 4, 16])):
        at = rng.randrange(min(len(mutated), head) if rng.random() < 0.8 else len(mutated))
        mutated[at] = rng.randrange(256)
    return bytes(mutated)


def test_corrupted_weights_files_are_one_error_or_an_import(tmp_path):
    """Random byte changes to a valid weights.hdf5 and to both torch layouts of a ManyLangs state dict (seeded by the
    session's fuzz seed): every outcome is an import or an ElmoError, never another exception."""
    rng = random.Random(FUZZ_SEED)
    options, weights = valid_files(tmp_path / "src")
    cfg, whole = read_options(options), weights.read_bytes()
    for _ in range(60):
        weights.write_bytes(_mutated(whole, rng, 4096))
        try:
            read_hdf5(weights, cfg)
        except ElmoError:
            pass
    for legacy in (False, True):
        folder = write_synthetic_folder(tmp_path / f"peer-{legacy}")
        resave(folder / "encoder.pkl", legacy)
        encoder = (folder / "encoder.pkl").read_bytes()
        for _ in range(30):
            (folder / "encoder.pkl").write_bytes(_mutated(encoder, rng, 2048))
            try:
                state = read_declarations(folder / "encoder.pkl")
                state.read(list(state.tensors))
            except ElmoError:
                pass
