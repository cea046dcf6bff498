"""elmo.importers.manylangs: ELMoForManyLangs import, checked against the peer's own code.

Parity: tiny random models are built with ELMoForManyLangs' own classes (``frontend.Model`` with its
``EmbeddingLayer``s), saved as its training code saves them (state dicts of ``token_embedder`` and ``encoder``,
char.dic / word.dic, config.json naming the network JSON), loaded back through its ``Embedder`` and run with
``sents2elmo(..., output_layer=-2)`` on a fresh instance (its biLSTM is stateful: the first call starts from zero,
as ours always does). The same folder goes ``import-manylangs -> export -> elmo.runtime.Embedder.embed_tokens``.
Those tests need the ``manylangs-parity`` extra and are skipped without it; the malformed-folder tests do not.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from elmo.cli import main as elmo_main
from elmo.errors import ConfigError, ElmoError, ModelFileError
from elmo.importers.manylangs import import_manylangs, read_dic
from elmo.model.checkpoint import load_model
from elmo.text.chars import CHAR_VOCAB_FILE, WORD_VOCAB_FILE, VocabScheme, load_char_scheme

torch.set_num_threads(1)

HAVE_PEER = importlib.util.find_spec("elmoformanylangs") is not None
needs_peer = pytest.mark.skipif(
    not HAVE_PEER,
    reason="parity reference not installed: pip install -e '.[manylangs-parity]' "
    "(or .venv/bin/pip install --no-deps elmoformanylangs==0.0.4.post2 overrides==3.1.0)",
)

TRAIN = ["the cat sat on the mat .", "a dog ran", "我们 喜欢 自然 语言 处理", "北京 是 中国 的 首都"]
ENGLISH = [
    ["The", "cat", "sat", "on", "the", "mat", "."],
    ["a"],
    ["unseen", "words", "Zebra", "x" * 70, "naïve", "😀"],
    ["<bos>", "dog", "<eos>", "ran"],
]
CHINESE = [
    ["我们", "喜欢", "自然", "语言", "处理"],
    ["北京", "是", "中国", "的", "首都", "。"],
    ["未登录词", "我们", "龘" * 60],
    ["中"],
]


def network(word_dim: int) -> dict:
    return {
        "encoder": {"name": "elmo", "projection_dim": 8, "cell_clip": 3, "proj_clip": 3, "dim": 16, "n_layers": 2},
        "token_embedder": {
            "name": "cnn",
            "activation": "relu",
            "filters": [[1, 4], [2, 8], [3, 16]],
            "n_highway": 2,
            "word_dim": word_dim,
            "char_dim": 5,
            "max_characters_per_token": 50,
        },
        "classifier": {"name": "sampled_softmax", "n_samples": 8192},
        "dropout": 0.1,
    }


def lexicons() -> tuple[dict[str, int], dict[str, int]]:
    """As ELMoForManyLangs' biLM.py builds them: words with the specials first, chars in order of appearance then
    the specials."""
    words: dict[str, int] = {}
    for special in ["<oov>", "<bos>", "<eos>", "<pad>"]:
        words[special] = len(words)
    chars: dict[str, int] = {}
    for line in TRAIN:
        for word in line.split():
            words.setdefault(word, len(words))
            for ch in word:
                chars.setdefault(ch, len(chars))
    for special in ["<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"]:
        chars.setdefault(special, len(chars))
    return chars, words


def write_peer_folder(directory: Path, word_dim: int, seed: int = 0) -> Path:
    """A tiny random ELMoForManyLangs model folder, made with its own classes and saved as its training saves."""
    from elmoformanylangs.frontend import Model
    from elmoformanylangs.modules.embedding_layer import EmbeddingLayer

    torch.manual_seed(seed)
    config = network(word_dim)
    chars, words = lexicons()
    char_layer = EmbeddingLayer(config["token_embedder"]["char_dim"], chars, fix_emb=False)
    word_layer = EmbeddingLayer(word_dim, words, fix_emb=False) if word_dim else None
    model = Model(config, word_layer, char_layer, use_cuda=False)
    with torch.no_grad():  # random everything (biases included): LSTMs at a scale that makes the clips matter,
        # token vectors of a few units (like a trained model's), so that float32 rounding stays well under 1e-5
        for name, parameter in model.named_parameters():
            parameter.add_(torch.randn_like(parameter) * (0.3 if name.startswith("encoder.") else 0.1))
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.token_embedder.state_dict(), directory / "token_embedder.pkl")
    torch.save(model.encoder.state_dict(), directory / "encoder.pkl")
    (directory / "char.dic").write_text("".join(f"{c}\t{i}\n" for c, i in chars.items()), encoding="utf-8")
    (directory / "word.dic").write_text("".join(f"{w}\t{i}\n" for w, i in words.items()), encoding="utf-8")
    (directory / "cnn_tiny.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"config_path": "cnn_tiny.json", "batch_size": 32, "seed": 1}))
    return directory


def peer_vectors(folder: Path, sentences: list[list[str]]) -> list[np.ndarray]:
    from elmoformanylangs import Embedder as PeerEmbedder

    return PeerEmbedder(str(folder)).sents2elmo(sentences, output_layer=-2)  # a fresh instance: zero state


@pytest.fixture(scope="module", params=[0, 6], ids=["chars-only", "with-word-embedding"])
def imported(request, tmp_path_factory):
    """(peer folder, our exported model directory) for each variant."""
    if not HAVE_PEER:
        pytest.skip("elmoformanylangs not installed (manylangs-parity extra)")
    from elmo.export.onnx_export import export_model

    root = tmp_path_factory.mktemp(f"manylangs{request.param}")
    folder = write_peer_folder(root / "peer", request.param)
    import_manylangs(folder, root / "ours")
    export_model(root / "ours", threads=1)
    return folder, root / "ours"


# -- parity against ELMoForManyLangs -------------------------------------------------------------------------------
@needs_peer
@pytest.mark.parametrize("sentences", [ENGLISH, CHINESE], ids=["en", "zh"])
def test_import_export_runtime_matches_elmoformanylangs(imported, sentences):
    from elmo.runtime import CPU, Embedder

    folder, ours = imported
    expected = peer_vectors(folder, sentences)
    got = Embedder(ours, providers=[CPU], intra_op_threads=1).embed_tokens(sentences)
    assert [g.shape for g in got] == [e.shape for e in expected] == [(3, len(s), 16) for s in sentences]
    worst = max(float(np.max(np.abs(g - e))) for g, e in zip(got, expected))
    print(f"max abs diff vs ELMoForManyLangs: {worst:.2e}")
    assert worst <= 1e-5


@needs_peer
def test_the_torch_model_matches_too_and_the_scheme_is_stored(imported):
    folder, ours = imported
    model = load_model(ours)
    scheme = load_char_scheme(ours)
    assert isinstance(scheme, VocabScheme)
    assert (ours / WORD_VOCAB_FILE).is_file() == (model.cfg.word_dim > 0)
    sentences = ENGLISH + CHINESE
    with torch.no_grad():
        layers, _ = model(torch.as_tensor(scheme.batch(sentences)).long())
    expected = peer_vectors(folder, sentences)
    worst = max(
        float(np.max(np.abs(layers[i, :, : len(s)].numpy() - e))) for i, (s, e) in enumerate(zip(sentences, expected))
    )
    assert worst <= 1e-5


@needs_peer
def test_the_comparison_is_sensitive_to_the_swapped_word_boundaries(imported):
    """ELMoForManyLangs writes char.dic's <eow> id first and its <bow> id last; the other way round differs."""
    from elmo.runtime import CPU, Embedder

    folder, ours = imported
    runtime = Embedder(ours, providers=[CPU], intra_op_threads=1)  # fresh: no token vector cached yet
    specials = runtime.scheme.specials
    specials["begin_of_word"], specials["end_of_word"] = specials["end_of_word"], specials["begin_of_word"]
    got = runtime.embed_tokens(ENGLISH[:1])[0]
    assert float(np.max(np.abs(got - peer_vectors(folder, ENGLISH[:1])[0]))) > 1e-3


@needs_peer
def test_cli_imports_a_folder(tmp_path, capsys):
    folder = write_peer_folder(tmp_path / "peer", 6)
    assert elmo_main(["import-manylangs", "--model", str(folder), "--out", str(tmp_path / "ours")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["n_layers"] == 3 and summary["dim"] == 16 and summary["word_dim"] == 6
    assert (tmp_path / "ours" / CHAR_VOCAB_FILE).is_file() and (tmp_path / "ours" / "README.md").is_file()


@needs_peer
def test_batch_job_on_pre_tokenized_chinese_matches_elmoformanylangs(imported, tmp_path):
    """`elmo embed-file --tokenized --layers all` on segmented Chinese (the way to feed their zh models)."""
    import h5py

    folder, ours = imported
    text, output = tmp_path / "zh.txt", tmp_path / "zh.hdf5"
    text.write_text("".join(" ".join(s) + "\n" for s in CHINESE), encoding="utf-8")
    args = [str(text), str(output), "--model", str(ours), "--tokenized", "--layers", "all", "--threads", "1"]
    assert elmo_main(["embed-file", *args, "--no-progress"]) == 0
    expected = peer_vectors(folder, CHINESE)
    with h5py.File(output, "r") as handle:
        for index, want in enumerate(expected):
            assert float(np.max(np.abs(handle[str(index)][...] - want))) <= 1e-5


def test_a_wrong_graph_fails_verification_on_this_fixture(tmp_path, monkeypatch):
    """The synthetic weights keep float32 near float64 (a correct export passes with room to spare on any CPU),
    and one recurrent weight flipped in the graph is still caught."""
    import elmo.export.onnx_export as onnx_export

    import_manylangs(write_synthetic_folder(tmp_path / "peer", word_dim=6), tmp_path / "ours")
    onnx_export.export_model(tmp_path / "ours", tmp_path / "good", threads=1)
    verification = json.loads((tmp_path / "good" / "onnx.json").read_text())["verification"]
    assert verification["pytorch_float32_max_abs_error"] < 1e-5
    assert all(case["max_abs_error"] <= case["bound"] / 2 for case in verification["cases"])

    real = onnx_export.build_context_graph

    def one_weight_flipped(state, cfg, **options):
        name = "forward_layers.1.state_linearity.weight"
        state = {**state, name: state[name].copy()}
        state[name][0, 0] = -state[name][0, 0]
        return real(state, cfg, **options)

    monkeypatch.setattr(onnx_export, "build_context_graph", one_weight_flipped)
    with pytest.raises(ModelFileError, match="verification against PyTorch failed"):
        onnx_export.export_model(tmp_path / "ours", tmp_path / "flipped", threads=1)


@pytest.mark.parametrize("link", [False, True], ids=["dot-dot-path", "symlink-out"])
def test_config_path_never_reads_outside_the_folder(tmp_path, link):
    """config.json's config_path ``../outside.json`` (or a symlink in the folder pointing out of it) is not read,
    even where that file exists: the import fails naming config_path."""
    from elmo.importers.manylangs import read_network_config

    folder = write_synthetic_folder(tmp_path / "zhs.model", word_dim=0)
    (folder / "net.json").unlink()
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(network(0)))
    if link:
        (folder / "net.json").symlink_to(outside)
        name = "net.json"
    else:
        name = "../outside.json"
    (folder / "config.json").write_text(json.dumps({"config_path": name}))
    with pytest.raises(ConfigError, match=f"config_path '{re.escape(name)}': no such file in"):
        read_network_config(folder)


def test_runtime_refuses_a_char_vocabulary_changed_after_export(tmp_path):
    from elmo.export.onnx_export import export_model

    from elmo.runtime import CPU, Embedder

    import_manylangs(write_synthetic_folder(tmp_path / "peer", word_dim=0), tmp_path / "ours")
    export_model(tmp_path / "ours", threads=1)
    runtime = Embedder(tmp_path / "ours", providers=[CPU], intra_op_threads=1)
    assert runtime.embed_tokens([["a", "cat"]])[0].shape == (3, 2, 16)
    vocab = json.loads((tmp_path / "ours" / CHAR_VOCAB_FILE).read_text("utf-8"))
    vocab["chars"]["a"], vocab["chars"]["c"] = vocab["chars"]["c"], vocab["chars"]["a"]
    (tmp_path / "ours" / CHAR_VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    with pytest.raises(ModelFileError, match=CHAR_VOCAB_FILE):
        Embedder(tmp_path / "ours", providers=[CPU], intra_op_threads=1)


# -- malformed folders (no ELMoForManyLangs needed) ----------------------------------------------------------------
class _NotATensor:
    pass


def _tiny_tensors(word_dim: int) -> tuple[dict, dict]:
    """State dicts in ELMoForManyLangs' key layout, made without the package. Seeded, and scaled as a trained or
    freshly initialised network is: matrices N(0, 1 / fan_in), biases N(0, 0.01), embeddings N(0, 1). Unscaled
    N(0, 1) recurrent weights made a chaotic LSTM that amplified rounding to order 1 (PyTorch float32 5.7 from
    float64 on 400 tokens), so whether a correct export passed its verification depended on the CPU's kernels; at
    these scales float32 stays near 1e-6 of float64 on every case and a flipped weight still misses by far
    (test_a_wrong_graph_fails_verification_on_this_fixture)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        scale = 1.0 / np.sqrt(fan_in) if fan_in else 0.1
        return torch.randn(*shape, generator=generator) * scale

    def embedding(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    cfg = network(word_dim)
    chars, words = lexicons()
    emb, enc = cfg["token_embedder"], cfg["encoder"]
    n_filters, p, c = sum(n for _, n in emb["filters"]), enc["projection_dim"], enc["dim"]
    token = {"char_emb_layer.embedding.weight": embedding(len(chars), emb["char_dim"])}
    if word_dim:
        token["word_emb_layer.embedding.weight"] = embedding(len(words), word_dim)
    for i, (width, count) in enumerate(emb["filters"]):
        token[f"convolutions.{i}.weight"] = randn(count, emb["char_dim"], width)
        token[f"convolutions.{i}.bias"] = randn(count)
    for k in range(emb["n_highway"]):
        token[f"highways._layers.{k}.weight"] = randn(2 * n_filters, n_filters)
        token[f"highways._layers.{k}.bias"] = randn(2 * n_filters)
    token["projection.weight"] = randn(p, n_filters + word_dim)
    token["projection.bias"] = randn(p)
    encoder = {}
    for direction in ("forward", "backward"):
        for layer in range(enc["n_layers"]):
            name = f"{direction}_layer_{layer}"
            encoder[f"{name}.input_linearity.weight"] = randn(4 * c, p)
            encoder[f"{name}.state_linearity.weight"] = randn(4 * c, p)
            encoder[f"{name}.state_linearity.bias"] = randn(4 * c)
            encoder[f"{name}.state_projection.weight"] = randn(p, c)
    return token, encoder


def write_synthetic_folder(directory: Path, word_dim: int = 6) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    token, encoder = _tiny_tensors(word_dim)
    torch.save(token, directory / "token_embedder.pkl")
    torch.save(encoder, directory / "encoder.pkl")
    chars, words = lexicons()
    (directory / "char.dic").write_text("".join(f"{c}\t{i}\n" for c, i in chars.items()), encoding="utf-8")
    (directory / "word.dic").write_text("".join(f"{w}\t{i}\n" for w, i in words.items()), encoding="utf-8")
    (directory / "net.json").write_text(json.dumps(network(word_dim)))
    (directory / "config.json").write_text(json.dumps({"config_path": "/somewhere/else/net.json"}))
    return directory


def test_a_well_formed_synthetic_folder_imports(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing a user cannot act on (torch's slow-path UserWarning was one)
        model = import_manylangs(write_synthetic_folder(tmp_path / "peer"), tmp_path / "ours")
    assert model.cfg.char_scheme == "vocab" and model.cfg.word_dim == 6 and model.cfg.token_width == 51
    assert load_model(tmp_path / "ours").cfg == model.cfg


def _drop(name: str):
    return lambda d: (d / name).unlink()


def _resave(name: str, edit):
    def change(d: Path) -> None:
        state = torch.load(d / name, weights_only=True)
        edit(state)
        torch.save(state, d / name)

    return change


def _pickle_object(d: Path) -> None:
    with open(d / "encoder.pkl", "wb") as handle:
        pickle.dump({"forward_layer_0.input_linearity.weight": _NotATensor()}, handle)


def _pickle_list(d: Path) -> None:
    torch.save({"projection.weight": [1.0, 2.0]}, d / "token_embedder.pkl")


CASES = {
    "no config.json": (_drop("config.json"), ConfigError, "config.json"),
    "no network json": (_drop("net.json"), ConfigError, "config.json"),
    "no char.dic": (_drop("char.dic"), ModelFileError, "char.dic"),
    "no word.dic": (_drop("word.dic"), ModelFileError, "word.dic"),
    "no token_embedder.pkl": (_drop("token_embedder.pkl"), ModelFileError, "token_embedder.pkl"),
    "no encoder.pkl": (_drop("encoder.pkl"), ModelFileError, "encoder.pkl"),
    "conv shape": (
        _resave("token_embedder.pkl", lambda s: s.update({"convolutions.1.weight": torch.zeros(8, 5, 3)})),
        ModelFileError,
        "token_embedder.pkl",
    ),
    "lstm shape": (
        _resave("encoder.pkl", lambda s: s.update({"backward_layer_1.state_projection.weight": torch.zeros(8, 17)})),
        ModelFileError,
        "encoder.pkl",
    ),
    "missing lstm tensor": (
        _resave("encoder.pkl", lambda s: s.pop("forward_layer_1.state_linearity.bias")),
        ModelFileError,
        "encoder.pkl",
    ),
    "char table vs char.dic": (
        _resave("token_embedder.pkl", lambda s: s.update({"char_emb_layer.embedding.weight": torch.zeros(3, 5)})),
        ModelFileError,
        "token_embedder.pkl",
    ),
    "pickled object": (_pickle_object, ModelFileError, "encoder.pkl"),
    "pickled non-tensor": (_pickle_list, ModelFileError, "token_embedder.pkl"),
    "garbage pkl": (lambda d: (d / "encoder.pkl").write_bytes(b"not a pickle"), ModelFileError, "encoder.pkl"),
    "char.dic without <bow>": (
        lambda d: (d / "char.dic").write_text(
            "".join(line + "\n" for line in (d / "char.dic").read_text("utf-8").splitlines() if "<bow>" not in line),
            "utf-8",
        ),
        ModelFileError,
        "char.dic",
    ),
    "bad char.dic line": (
        lambda d: (d / "char.dic").write_text("a\tb\tc\n", "utf-8"),
        ModelFileError,
        "char.dic",
    ),
    "lstm encoder": (
        lambda d: (d / "net.json").write_text(
            json.dumps({**network(6), "encoder": {**network(6)["encoder"], "name": "lstm"}})
        ),
        ConfigError,
        "encoder.name",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_folder_is_one_error_naming_the_file(tmp_path, case):
    change, error, named = CASES[case]
    folder = write_synthetic_folder(tmp_path / "peer")
    change(folder)
    with pytest.raises(error) as caught:
        import_manylangs(folder, tmp_path / "ours")
    assert named in str(caught.value)
    assert not (tmp_path / "ours" / "model.safetensors").exists()


def test_cli_reports_a_malformed_folder_in_one_line(tmp_path, capsys):
    folder = write_synthetic_folder(tmp_path / "peer")
    _pickle_object(folder)
    assert elmo_main(["import-manylangs", "--model", str(folder), "--out", str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "encoder.pkl" in err[0] and err[0].startswith("elmo import-manylangs: error:")


def test_dic_parsing_follows_elmoformanylangs(tmp_path):
    """Lines are stripped; a lone id is the ideographic space U+3000; a later line wins."""
    path = tmp_path / "char.dic"
    path.write_text("a\t0\n\u3000\t1\nb\t2\na\t3\n", encoding="utf-8")
    assert read_dic(path) == {"a": 3, "\u3000": 1, "b": 2}


@pytest.mark.parametrize("bad_id", ["²", "٣", "-1", "1.0", "x"])
def test_a_dic_id_that_is_not_ascii_digits_is_named(tmp_path, bad_id):
    path = tmp_path / "char.dic"
    path.write_text(f"a\t0\nb\t{bad_id}\n", encoding="utf-8")  # "²".isdigit() is True, int("²") raises
    with pytest.raises(ModelFileError, match="line 2 is not 'token<TAB>id' with an id >= 0"):
        read_dic(path)


def test_vocab_scheme_rows():
    chars, words = lexicons()
    specials = {
        "begin_of_word": chars["<eow>"],
        "end_of_word": chars["<bow>"],
        "padding": chars["<pad>"],
        "unknown": chars["<oov>"],
        "sentence_begin": chars["<bos>"],
        "sentence_end": chars["<eos>"],
    }
    scheme = VocabScheme(chars, specials, 6, ("<bos>", "<eos>"), words, {"unknown": 0, "padding": 3})
    row = scheme.token_ids("cat" + "龘" * 5)  # cut to max_chars - 2 = 4 characters, then looked up as a word
    assert scheme.width == 7 and row.tolist()[:6] == [
        chars["<eow>"] + 1,
        chars["c"] + 1,
        chars["a"] + 1,
        chars["t"] + 1,
        chars["<oov>"] + 1,
        chars["<bow>"] + 1,
    ]
    assert row[6] == words["<oov>"] + 1
    assert scheme.bos_ids.tolist() == [chars["<eow>"] + 1, chars["<bos>"] + 1, chars["<bow>"] + 1] + [
        chars["<pad>"] + 1
    ] * 3 + [words["<bos>"] + 1]
    assert (scheme.batch([["cat"], []])[1] == 0).all()


def test_errors_are_elmo_errors():
    assert issubclass(ModelFileError, ElmoError) and issubclass(ConfigError, ElmoError)
