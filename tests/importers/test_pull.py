"""elmo.importers.pull (`elmo pull NAME`) against a local HTTP server, never the network.

The server (http.server in a thread on 127.0.0.1, Range requests answered with 206) serves fixture files at the
publishers' paths, through ``--base-url``: the bilm-tf fixture (AllenNLP's options.json + weights.hdf5 layout, read
from ../shared/reference, skipped when absent) as the `small` model, and a tiny ELMoForManyLangs folder zipped flat
as NLPL's zips are, as `zh`. It logs every request's Range header and can drop the connection once, mid-file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import socket
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo.cli import main as elmo_main
from elmo.errors import DataError
from elmo.importers import pull as pull_module
from elmo.importers.catalogue import CATALOGUE, MANYLANGS_MODELS, Entry, Source, markdown_table, resolve_url
from elmo.importers.download import Pins
from elmo.importers.pull import download, extract_zip
from elmo.runtime import Embedder
from elmo.runtime.repository import complete_versions
from tests.importers.test_manylangs import write_synthetic_folder

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
SMALL = CATALOGUE["small"]
ZH = CATALOGUE["zh"]


def path_of(source: Source) -> str:
    return resolve_url(source.url, "http://x")[len("http://x") :]


class FixtureServer:
    """Serves ``files`` (URL path -> bytes); ``log`` holds (path, Range header) per request; ``drop_after[path] = n``
    sends the full Content-Length but closes the connection after byte n, once."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.log: list[tuple[str, str | None]] = []
        self.drop_after: dict[str, int] = {}
        self.ignore_range = False  # answer every request with the whole file (200), as some servers do
        self.endless: dict[str, bool] = {}  # path -> stream bytes without end and without a Content-Length
        self.redirects: dict[str, str] = {}  # path -> a 302 to this address
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner.log.append((self.path, self.headers.get("Range")))
                if self.path in owner.redirects:
                    self.send_response(302)
                    self.send_header("Location", owner.redirects[self.path])
                    self.end_headers()
                    return
                if self.path in owner.endless:
                    self.stream_without_end()
                    return
                data = owner.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                if self.headers.get("Range") and not owner.ignore_range:
                    start = int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"]).group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                cut = owner.drop_after.pop(self.path, None)
                if cut is not None:
                    self.wfile.write(data[start:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data[start:])

            def stream_without_end(self) -> None:
                self.send_response(200)
                self.end_headers()
                block = b"\0" * 65536
                try:
                    for _ in range(1 << 16):  # 4 GiB at most, should the client never stop
                        self.wfile.write(block)
                except OSError:  # the client cut it off: what should happen
                    pass
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def ranges(self, path: str) -> list[str | None]:
        return [r for p, r in self.log if p == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)  # straight to 127.0.0.1, never through a proxy
    monkeypatch.setenv("no_proxy", "*")
    served = FixtureServer()
    yield served
    served.close()


@pytest.fixture
def allennlp_files(bilm_tf_fixture, server) -> dict[str, bytes]:
    """The bilm-tf fixture at the paths of AllenNLP's `small` files."""
    options, weights = SMALL.files
    server.files[path_of(options)] = (bilm_tf_fixture / "options.json").read_bytes()
    server.files[path_of(weights)] = (bilm_tf_fixture / "lm_weights.hdf5").read_bytes()
    return {options.file: server.files[path_of(options)], weights.file: server.files[path_of(weights)]}


def pull_args(name: str, server: FixtureServer, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "pull",
        name,
        "--base-url",
        server.url,
        "--cache",
        str(tmp_path / "cache"),
        "--no-progress",
        "--threads",
        "1",
        *extra,
    ]


def last_error(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("elmo pull: error:")]


# -- the catalogue ---------------------------------------------------------------------------------------------------
def test_the_catalogue_names_the_published_models():
    allennlp = [e for e in CATALOGUE.values() if e.kind == "allennlp"]
    manylangs = [e for e in CATALOGUE.values() if e.kind == "manylangs"]
    assert [e.name for e in allennlp] == ["small", "medium", "original", "5.5B"]
    assert len(manylangs) == len(MANYLANGS_MODELS) == 44
    assert sorted(int(e.files[0].file[:-4]) for e in manylangs) == list(range(136, 180))  # NLPL 136-179
    assert ZH.files[0].url == "https://vectors.nlpl.eu/repository/11/179.zip"
    assert SMALL.files[1].url == (
        "https://s3-us-west-2.amazonaws.com/allennlp/models/elmo/2x1024_128_2048cnn_1xhighway/"
        "elmo_2x1024_128_2048cnn_1xhighway_weights.hdf5"
    )
    assert all(e.licence == "Apache-2.0" for e in allennlp)
    assert resolve_url(ZH.files[0].url, "http://mirror:81/") == "http://mirror:81/repository/11/179.zip"


def test_docs_pretrained_shows_the_catalogue_table():
    """docs/how-to/pretrained.md carries the table `python -m elmo.importers.catalogue` writes, unchanged."""
    assert markdown_table() in (REPO / "docs" / "how-to" / "pretrained.md").read_text()


def test_an_unknown_name_is_one_line(capsys, tmp_path):
    assert elmo_main(["pull", "nope", "--out", str(tmp_path / "m")]) == 2
    assert "unknown model 'nope': one of small, medium, original, 5.5B, ar" in last_error(capsys)[0]
    assert elmo_main(["pull", "--list"]) == 0
    assert capsys.readouterr().out == markdown_table()


# -- download: resume, truncation, pins ------------------------------------------------------------------------------
@pytest.mark.slow  # 4.5 s (two imports + exports, 2 busy cores): the slow tier's rule is a call of 2 s or more
def test_an_interrupted_download_resumes_and_the_model_serves(
    server, allennlp_files, bilm_tf_fixture, tmp_path, capsys
):
    weights = SMALL.files[1]
    cut = 100_000
    server.drop_after[path_of(weights)] = cut
    out = tmp_path / "small"
    assert elmo_main(pull_args("small", server, tmp_path, "--out", str(out), "--retries", "0")) == 2
    error = last_error(capsys)
    assert len(error) == 1 and f"broke off at {cut:,} bytes" in error[0] and "again to resume" in error[0]
    part = tmp_path / "cache" / "small" / (weights.file + ".part")
    assert part.stat().st_size == cut and not out.exists()

    assert elmo_main(pull_args("small", server, tmp_path, "--out", str(out))) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert server.ranges(path_of(weights)) == [None, f"bytes={cut}-"]  # the rerun asked only for the rest
    pins = json.loads((tmp_path / "cache" / "pins.json").read_text())
    assert pins[f"small/{weights.file}"]["sha256"] == hashlib.sha256(allennlp_files[weights.file]).hexdigest()
    assert summary["files"][weights.file]["pin"] == "recorded" and summary["out"] == str(out)
    assert json.loads((out / "pull.json").read_text())["licence"] == "Apache-2.0"

    # the end result serves, and it is the original implementation's model: bilm-tf's own top layer
    sentences = json.loads((bilm_tf_fixture / "sentences.json").read_text())
    tokens = sentences[0][0].split()
    layers = Embedder(out).embed_tokens([tokens])[0]
    with h5py.File(bilm_tf_fixture / "lm_embeddings_0.hdf5", "r") as handle:
        top = handle["0"][...]
    np.testing.assert_allclose(layers[-1], np.concatenate([top[0], top[1]], axis=-1), atol=1e-5, rtol=0)

    # a later pull reuses the cache and verifies the pins (nothing downloaded again)
    requests = len(server.log)
    assert elmo_main(pull_args("small", server, tmp_path, "--model-root", str(tmp_path / "repo"), "--as", "en")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(server.log) == requests and {f["pin"] for f in summary["files"].values()} == {"verified"}
    assert summary["version"] == 1 and complete_versions(tmp_path / "repo" / "en") == [1]


def test_a_truncated_file_is_refused(server, allennlp_files, tmp_path, capsys, monkeypatch):
    options, weights = SMALL.files
    whole = allennlp_files[weights.file]
    sources = (
        Source(options.file, options.url, len(allennlp_files[options.file])),
        Source(weights.file, weights.url, len(whole)),
    )
    sized = Entry("small", "allennlp", SMALL.title, sources, SMALL.licence)
    monkeypatch.setattr(pull_module, "CATALOGUE", {"small": sized})
    server.files[path_of(weights)] = whole[: len(whole) // 2]  # the server itself has a truncated copy
    out = tmp_path / "small"
    assert elmo_main(pull_args("small", server, tmp_path, "--out", str(out))) == 2
    error = last_error(capsys)
    assert len(error) == 1 and f"offers {len(whole) // 2:,} bytes, the catalogue lists {len(whole):,}" in error[0]
    assert not out.exists() and not (tmp_path / "cache" / "small" / weights.file).exists()

    # without a catalogue size the pin's size decides: a cached copy cut short on disk is refused and removed
    monkeypatch.setattr(pull_module, "CATALOGUE", CATALOGUE)
    server.files[path_of(weights)] = whole
    pins = Pins(tmp_path / "cache" / "pins.json")
    cached = download(SMALL, tmp_path / "cache", pins, server.url, progress=False)[1].path
    cached.write_bytes(whole[:-10])
    assert elmo_main(pull_args("small", server, tmp_path, "--out", str(out))) == 2
    error = last_error(capsys)
    assert len(error) == 1 and "truncated" in error[0] and "the pin recorded on first download" in error[0]
    assert not cached.exists() and not out.exists()

    # with neither (a first download, the size unknown) the importer refuses it, and the new pins go with the files
    (tmp_path / "cache" / "pins.json").unlink()
    server.files[path_of(weights)] = whole[: len(whole) // 2]
    assert elmo_main(pull_args("small", server, tmp_path, "--out", str(out))) == 2
    error = last_error(capsys)
    assert len(error) == 1 and f"downloaded first, {options.file}, {weights.file}, and its new pins" in error[0]
    assert json.loads((tmp_path / "cache" / "pins.json").read_text()) == {} and not cached.exists()


def test_a_server_that_ignores_the_range_is_read_from_the_start(server, allennlp_files, tmp_path):
    weights = SMALL.files[1]
    server.drop_after[path_of(weights)] = 5000
    pins = Pins(tmp_path / "cache" / "pins.json")
    with pytest.raises(DataError, match="broke off at 5,000 bytes"):
        download(SMALL, tmp_path / "cache", pins, server.url, retries=0, progress=False)
    server.ignore_range = True
    fetched = download(SMALL, tmp_path / "cache", pins, server.url, retries=0, progress=False)
    assert server.ranges(path_of(weights)) == [None, "bytes=5000-"]  # asked from the offset, got the whole file
    assert fetched[1].path.read_bytes() == allennlp_files[weights.file] and fetched[1].pinned == "recorded"


def test_a_file_another_pull_is_fetching_is_left_alone(server, allennlp_files, tmp_path):
    options = SMALL.files[0]
    dest = tmp_path / "cache" / "small" / options.file
    dest.parent.mkdir(parents=True)
    with open(dest.with_name(dest.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running `elmo pull small` holds it
        with pytest.raises(DataError, match="another elmo pull is fetching this file now"):
            download(SMALL, tmp_path / "cache", Pins(tmp_path / "cache" / "pins.json"), server.url, progress=False)
    assert not dest.exists() and server.log == []


def test_an_altered_file_is_refused_against_its_pin(server, allennlp_files, tmp_path, capsys, monkeypatch):
    weights = SMALL.files[1]
    pins = Pins(tmp_path / "cache" / "pins.json")
    fetched = download(SMALL, tmp_path / "cache", pins, server.url, progress=False)
    assert [f.pinned for f in fetched] == ["recorded", "recorded"]
    altered = bytearray(allennlp_files[weights.file])
    altered[len(altered) // 2] ^= 0x01  # one bit, same size
    server.files[path_of(weights)] = bytes(altered)
    fetched[1].path.unlink()  # a later download (the cache emptied, or another machine sharing the pins file)
    out = tmp_path / "small"
    monkeypatch.setenv(pull_module.BASE_URL_ENV, server.url)  # the mirror named by the environment this time
    args = ["pull", "small", "--cache", str(tmp_path / "cache"), "--no-progress", "--out", str(out)]
    assert elmo_main(args) == 2
    error = last_error(capsys)
    assert len(error) == 1 and "differs from the pin" in error[0] and "not imported" in error[0]
    assert not out.exists() and not fetched[1].path.exists()  # refused, removed: a rerun downloads it afresh

    # the same for a cached file changed on disk after its download
    server.files[path_of(weights)] = allennlp_files[weights.file]
    fetched = download(SMALL, tmp_path / "cache", pins, server.url, progress=False)
    assert fetched[1].pinned == "verified"
    fetched[1].path.write_bytes(bytes(altered))
    with pytest.raises(DataError, match="differs from the pin"):
        download(SMALL, tmp_path / "cache", pins, server.url, progress=False)


# -- published checksums: pinned in the catalogue, never trusted on first use ---------------------------------------
def test_the_list_shows_which_files_are_pinned_by_a_published_checksum(capsys):
    weights = CATALOGUE["original"].files[1]
    # the Git LFS pointer of the Hugging Face mirror (cited in elmo/importers/catalogue.py): its oid and size
    assert weights.sha256 == "a6b92b9ccbb13fe489faacd2221c795d4bebe84b75f8aded9d85ea464fa5c994"
    assert weights.size == 374_434_792
    assert elmo_main(["pull", "--list"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "weights.hdf5: **SHA-256 pinned** (`a6b92b9ccbb1…`)" in rows["`original`"]
    assert "options.json: size listed, SHA-256 on first use" in rows["`original`"]
    assert "weights.hdf5: on first use" in rows["`small`"] and "179.zip: on first use" in rows["`zh`"]
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        Source("f", "https://x/f", 1, "A6B9")  # a pin is a whole SHA-256, never a guess or a prefix


def pinned_small(allennlp_files: dict[str, bytes]) -> Entry:
    """`small` as the catalogue lists a file it has a published checksum for: the fixture's size and SHA-256."""
    options, weights = SMALL.files
    whole = allennlp_files[weights.file]
    pinned = Source(weights.file, weights.url, len(whole), hashlib.sha256(whole).hexdigest())
    return Entry("small", "allennlp", SMALL.title, (options, pinned), SMALL.licence)


def test_a_tampered_download_of_a_pinned_file_is_refused_and_nothing_kept(
    server, allennlp_files, tmp_path, capsys, monkeypatch
):
    weights = SMALL.files[1]
    monkeypatch.setattr(pull_module, "CATALOGUE", {"small": pinned_small(allennlp_files)})
    tampered = bytearray(allennlp_files[weights.file])
    tampered[len(tampered) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    server.files[path_of(weights)] = bytes(tampered)
    out, cache = tmp_path / "small", tmp_path / "cache"
    assert elmo_main(pull_args("small", server, tmp_path, "--out", str(out))) == 2
    error = last_error(capsys)
    assert len(error) == 1 and "differs from the published" in error[0] and "nothing kept or imported" in error[0]
    assert not out.exists()
    assert not [p for p in (cache / "small").iterdir() if p.name.startswith(weights.file) and p.suffix != ".lock"]
    assert f"small/{weights.file}" not in json.loads((cache / "pins.json").read_text())  # not trusted on first use

    # a pin of one's own (a pins file that recorded the tampered file) does not outrank the published checksum
    Pins(cache / "pins.json").record(f"small/{weights.file}", hashlib.sha256(tampered).hexdigest(), len(tampered), "x")
    with pytest.raises(DataError, match="differs from the published"):
        download(pull_module.CATALOGUE["small"], cache, Pins(cache / "pins.json"), server.url, progress=False)

    # the publisher's file passes, marked as checked against the published checksum
    server.files[path_of(weights)] = allennlp_files[weights.file]
    fetched = download(pull_module.CATALOGUE["small"], cache, Pins(cache / "pins.json"), server.url, progress=False)
    assert [f.pinned for f in fetched] == ["verified", "published"]

    # and a cached copy altered on disk afterwards is refused and removed, whatever the pins file says
    fetched[1].path.write_bytes(bytes(tampered))
    with pytest.raises(DataError, match="differs from the published"):
        download(pull_module.CATALOGUE["small"], cache, Pins(cache / "pins.json"), server.url, progress=False)
    assert not fetched[1].path.exists()


# -- ELMoForManyLangs: a zip, into a model repository ----------------------------------------------------------------
def zip_flat(folder: Path, archive: Path) -> bytes:
    with zipfile.ZipFile(archive, "w") as handle:
        for file in sorted(folder.iterdir()):
            handle.write(file, file.name)  # NLPL's zips hold the model folder's files at the top level
    return archive.read_bytes()


@pytest.mark.slow  # 2.8 s (import + export + a 1 s retry wait)
def test_a_manylangs_zip_is_published_as_the_next_version_and_serves(server, tmp_path, capsys):
    folder = write_synthetic_folder(tmp_path / "peer", word_dim=0)
    server.files[path_of(ZH.files[0])] = zip_flat(folder, tmp_path / "179.zip")
    server.drop_after[path_of(ZH.files[0])] = 1000  # broken once, resumed within the run (--retries)
    root = tmp_path / "repo"
    assert elmo_main(pull_args("zh", server, tmp_path, "--model-root", str(root))) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["model"] == "zh" and summary["version"] == 1 and summary["out"] == str(root / "zh" / "1")
    assert server.ranges(path_of(ZH.files[0])) == [None, "bytes=1000-"]
    assert complete_versions(root / "zh") == [1]
    assert not [p for p in (tmp_path / "cache" / "zh").iterdir() if p.name.startswith(".extract")]
    layers = Embedder(root / "zh" / "1").embed_tokens([["我们", "喜欢", "自然", "语言"]])[0]
    assert layers.shape[:2] == (3, 4) and np.isfinite(layers).all()


def test_the_weight_budget_is_a_pull_flag(server, tmp_path, capsys):
    """The importers' byte budget (--max-weight-bytes) applies to what `elmo pull` imports."""
    folder = write_synthetic_folder(tmp_path / "peer", word_dim=0)
    server.files[path_of(ZH.files[0])] = zip_flat(folder, tmp_path / "179.zip")
    out = tmp_path / "zh"
    assert elmo_main(pull_args("zh", server, tmp_path, "--out", str(out), "--max-weight-bytes", "1000")) == 2
    error = last_error(capsys)
    assert len(error) == 1 and "over the 1,000-byte budget (--max-weight-bytes)" in error[0] and not out.exists()


def test_a_zip_with_an_unsafe_path_is_refused(tmp_path):
    archive = tmp_path / "bad.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr("../escape.txt", "x")
    with pytest.raises(DataError, match="unsafe entry '../escape.txt'"):
        extract_zip(archive, tmp_path / "into")
    assert not (tmp_path / "escape.txt").exists()


# -- bounds: downloads, redirects, archives (issue 39) -------------------------------------------------------------
@pytest.mark.parametrize("size, cap", [(None, "300,000"), (1000, "1,000")], ids=["unknown-size", "known-size"])
def test_an_endless_download_is_cut_off_at_the_cap(server, tmp_path, size, cap):
    """No Content-Length and no end: cut off at the size the catalogue gives, else at the download cap."""
    from elmo.importers.download import fetch

    server.endless["/endless.bin"] = True
    dest = tmp_path / "cache" / "endless.bin"
    with pytest.raises(DataError, match=f"sent more than {cap} bytes") as refused:
        fetch(
            f"{server.url}/endless.bin",
            dest,
            "x/endless.bin",
            Pins(tmp_path / "pins.json"),
            size,
            retries=0,
            progress=False,
            max_bytes=300_000,
        )
    assert "\n" not in str(refused.value) and "cut off" in str(refused.value)
    assert not dest.exists() and not dest.with_name("endless.bin.part").exists()
    assert not (tmp_path / "pins.json").exists()  # nothing pinned


def test_a_redirect_to_another_origin_is_refused(server, tmp_path):
    from elmo.importers.download import fetch

    other = FixtureServer()  # another port: another origin
    try:
        other.files["/w.bin"] = b"w" * 100
        server.redirects["/w.bin"] = f"{other.url}/w.bin"
        server.redirects["/same.bin"] = f"{server.url}/v.bin"
        server.files["/v.bin"] = b"v" * 100
        pins = Pins(tmp_path / "pins.json")
        with pytest.raises(DataError, match="HTTP 302 redirect to another origin .*: refused"):
            fetch(f"{server.url}/w.bin", tmp_path / "cache" / "w.bin", "x/w.bin", pins, None, retries=0, progress=False)
        assert other.log == [] and pins.get("x/w.bin") is None
        same = fetch(
            f"{server.url}/same.bin",
            tmp_path / "cache" / "same.bin",
            "x/same.bin",
            pins,
            None,
            retries=0,
            progress=False,
        )
        assert same.path.read_bytes() == b"v" * 100  # a redirect on the same origin is followed
    finally:
        other.close()


def test_the_download_cap_is_a_pull_flag(tmp_path, capsys):
    assert elmo_main(["pull", "small", "--out", str(tmp_path / "m"), "--max-download-bytes", "0"]) == 2
    assert "--max-download-bytes must be at least 1" in capsys.readouterr().err


def test_a_zip_bomb_is_refused_before_anything_is_extracted(tmp_path):
    archive = tmp_path / "bomb.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as handle:
        handle.writestr("char.dic", "a\t0\n")
        handle.writestr("encoder.pkl", b"\0" * (64 << 20))  # 64 MiB of zeros deflate to ~64 KB
    assert archive.stat().st_size < 1 << 20
    with pytest.raises(DataError, match=r"member 'encoder.pkl' expands [\d,]+-fold .* a decompression bomb"):
        extract_zip(archive, tmp_path / "into")
    assert not (tmp_path / "into" / "char.dic").exists()


def test_an_archive_over_the_total_or_member_size_is_refused(tmp_path, monkeypatch):
    archive = tmp_path / "big.zip"
    with zipfile.ZipFile(archive, "w") as handle:  # stored: no compression ratio to trip on
        for name in ("char.dic", "a.pkl", "b.pkl"):
            handle.writestr(name, b"x" * 4000)
    monkeypatch.setattr(pull_module, "MAX_EXTRACT_BYTES", 10_000)
    with pytest.raises(DataError, match="its members expand to 12,000 bytes, over the 10,000"):
        extract_zip(archive, tmp_path / "into")
    monkeypatch.setattr(pull_module, "MAX_MEMBER_BYTES", 3_000)
    with pytest.raises(DataError, match="member 'char.dic' expands to 4,000 bytes, over the 3,000 one member may"):
        extract_zip(archive, tmp_path / "into2")
    assert not any((tmp_path / "into").iterdir()) and not any((tmp_path / "into2").iterdir())
