"""The model repository (elmo.runtime.repository): ROOT/NAME/VERSION/ folders, what counts as a version, and
publishing a new one atomically, also with other publishers and a poller at work at the same time."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from elmo.client import EmbedderClient
from elmo.errors import ConfigError, ModelFileError
from elmo.runtime import Embedder
from elmo.runtime.repository import (
    INCOMING_PREFIX,
    ModelRef,
    check_model_name,
    complete_versions,
    incomplete_reason,
    is_complete,
    numbered_folders,
    publish_copy,
    publishing,
    scan,
    verification_passed,
    version_dir,
)
from tests.serve_process import ServeProcess
from tests.service_helpers import POS_DEMO, model_with_pos_demo

GRAPHS = {"model": "model.onnx", "encoder": "encoder.onnx", "context": "context.onnx"}


def fake_export(folder: Path, passed: object = True, data: bytes = b"w" * 64, chunks: int = 1) -> Path:
    """Only the layout matters here: the graph files, the weights file and onnx.json's records of them. The
    weights are written in ``chunks`` pieces (a writer that takes a while)."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in GRAPHS.values():
        (folder / file).write_bytes(b"graph")
    with open(folder / "model.onnx.data", "wb") as handle:
        step = max(1, len(data) // chunks)
        for start in range(0, len(data), step):
            handle.write(data[start : start + step])
            handle.flush()
    meta = {
        "graphs": GRAPHS,
        "weights_data": {"file": "model.onnx.data", "bytes": len(data)},
        "verification": {"passed": passed},
    }
    (folder / "onnx.json").write_text(json.dumps(meta))
    return folder


# -- names -------------------------------------------------------------------------------------------------------
def test_model_refs_parse_and_print():
    assert ModelRef.parse("default") == ModelRef("default") and ModelRef.parse("default").version is None
    assert ModelRef.parse("default@2") == ModelRef("default", 2)
    assert ModelRef.parse("zh.small-v2@10").version == 10
    assert str(ModelRef("default", 2)) == "default@2" and str(ModelRef.parse("default")) == "default"
    for bad in ("default@0", "default@02", "default@x", "default@", "default@-1", "default@2@3", "default@ 2"):
        with pytest.raises(ConfigError, match="whole number from 1, like default@2"):
            ModelRef.parse(bad)
    with pytest.raises(ConfigError, match="no model name"):
        ModelRef.parse("@2")


def test_model_names():
    for good in ("default", "zhs", "elmo-small_2.1", "A" * 64):
        assert check_model_name(good) == good
    for bad in ("", ".hidden", "-x", "a/b", "a@2", "a b", "A" * 65, "..", "模型"):
        with pytest.raises(ConfigError, match="letters, digits"):
            check_model_name(bad)


# -- what counts ---------------------------------------------------------------------------------------------------
def test_scan_counts_only_complete_verified_numbered_versions(tmp_path):
    root = tmp_path / "root"
    fake_export(root / "default" / "1")
    fake_export(root / "default" / "3")
    fake_export(root / "default" / "2", passed=False)  # verification failed
    fake_export(root / "default" / "4", passed="yes")  # not a JSON true
    fake_export(root / "default" / "5").joinpath("onnx.json").unlink()  # no verification record
    fake_export(root / "default" / "6").joinpath("encoder.onnx").unlink()  # a graph missing
    with open(fake_export(root / "default" / "7") / "model.onnx.data", "r+b") as handle:
        handle.truncate(10)  # the weights still being copied
    (root / "default" / "8").mkdir()  # empty
    (root / "default" / "9").mkdir()
    (root / "default" / "9" / "onnx.json").write_text("{not json")
    fake_export(root / "default" / "010")  # leading zero: not a version number
    fake_export(root / "default" / "latest")
    fake_export(root / "default" / f"{INCOMING_PREFIX}123-abc")  # being published
    fake_export(root / "default" / ".11")
    (root / "default" / "12").write_text("a file, not a folder")
    fake_export(root / "zhs" / "1")
    fake_export(root / ".hidden" / "1")
    fake_export(root / "bad name" / "1")
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("not a model")

    assert scan(root) == {"default": [1, 3], "empty": [], "zhs": [1]}
    assert numbered_folders(root / "default") == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert complete_versions(root / "default") == [1, 3] and complete_versions(root / "missing") == []
    assert is_complete(version_dir(root, "default", 3)) and not is_complete(root / "default" / "010")
    assert verification_passed(root / "default" / "1") and not verification_passed(root / "default" / "4")
    reasons = {v: incomplete_reason(root / "default" / str(v)) for v in (2, 5, 6, 7, 8, 9)}
    assert "no passed verification record" in reasons[2]
    assert "onnx.json: missing or not a JSON object" in reasons[5] and "not a JSON object" in reasons[9]
    assert reasons[6].endswith("6: missing encoder.onnx")
    assert "model.onnx.data: 10 bytes, onnx.json records 64 (still copying?)" in reasons[7]
    assert incomplete_reason(root / "default" / "1") is None

    with pytest.raises(ModelFileError, match="model root not found"):
        scan(tmp_path / "nowhere")


def test_a_version_that_reaches_outside_its_folder_is_not_complete(tmp_path):
    """A symlinked graph (``model.onnx -> /etc/passwd``) or a graph, weights or probe named by a path would make any
    host file part of a "complete" version (and of the admin index's sizes)."""
    root = tmp_path / "models"
    linked = fake_export(root / "default" / "1")
    (linked / "model.onnx").unlink()
    (linked / "model.onnx").symlink_to("/etc/passwd")
    named = fake_export(root / "default" / "2")
    meta = json.loads((named / "onnx.json").read_text())
    meta["weights_data"]["file"] = "/etc/hostname"
    (named / "onnx.json").write_text(json.dumps(meta))
    probe = fake_export(root / "default" / "3")
    meta = json.loads((probe / "onnx.json").read_text())
    meta["probe"] = {"file": "../probe.bin", "bytes": 8}
    (probe / "onnx.json").write_text(json.dumps(meta))
    assert complete_versions(root / "default") == []
    assert "model.onnx: graph is a symlink: refused" in incomplete_reason(linked)
    assert "weights data '/etc/hostname' must be a plain file name" in incomplete_reason(named)
    assert "probe '../probe.bin' must be a plain file name" in incomplete_reason(probe)


def outside_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "leads outside" in r.getMessage()]


def test_a_symlinked_version_folder_counts_and_is_named_once(tmp_path, caplog):
    """docs/how-to/models.md, "Paths that leave their folder": a version published as a symlink to a folder elsewhere is
    served, and one WARNING names where it leads, however often the repository is scanned."""
    elsewhere = fake_export(tmp_path / "exports" / "v2")
    root = tmp_path / "models"
    fake_export(root / "default" / "1")
    (root / "default" / "2").symlink_to(elsewhere)
    (root / "default" / "3").symlink_to("1")  # inside the model's folder: nothing to say
    with caplog.at_level("WARNING"):
        for _ in range(3):  # a poller scans again and again
            assert scan(root) == {"default": [1, 2, 3]}
    assert outside_warnings(caplog) == [
        f"version folder {root / 'default' / '2'} leads outside {root / 'default'}, to {elsewhere}: loaded from "
        'there (docs/how-to/models.md, "Paths that leave their folder")'
    ]


def test_a_symlinked_model_folder_counts_and_is_named_once(tmp_path, caplog):
    elsewhere = tmp_path / "shared" / "zh"
    fake_export(elsewhere / "1")
    root = tmp_path / "models"
    root.mkdir()
    (root / "zh").symlink_to(elsewhere)
    with caplog.at_level("WARNING"):
        assert scan(root) == {"zh": [1]}
        assert scan(root) == {"zh": [1]}
    assert outside_warnings(caplog) == [
        f"model folder {root / 'zh'} leads outside {root}, to {elsewhere}: loaded from there "
        '(docs/how-to/models.md, "Paths that leave their folder")'
    ]


def test_a_model_root_reached_through_a_symlink_is_not_outside_itself(tmp_path, caplog):
    real = tmp_path / "real"
    fake_export(real / "default" / "1")
    (tmp_path / "link").symlink_to(real)
    with caplog.at_level("WARNING"):
        assert scan(tmp_path / "link") == {"default": [1]}
    assert outside_warnings(caplog) == []


def test_a_served_repository_follows_symlinked_version_and_task_folders_and_says_so_once(tiny_model_dir, tmp_path):
    """`elmo serve --model-root` on a version folder and a task folder that are symlinks to folders elsewhere: both
    are served (a task's mix applied), and the server's log names each outside place once, polls or not."""
    version = model_with_pos_demo(tiny_model_dir, tmp_path / "exports")
    shared_task = tmp_path / "shared-tasks" / POS_DEMO.name
    shutil.move(version / "tasks" / POS_DEMO.name, shared_task)
    (version / "tasks" / POS_DEMO.name).symlink_to(shared_task)
    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "1").symlink_to(version)
    args = ["--model-root", str(root), "--poll-interval-s", "0.05"]
    with ServeProcess(args, tmp_path / "serve") as server, EmbedderClient(server.wait_serving()) as client:
        plain = client.embed_texts(["the apple fell"], model="tiny")[0]
        for _ in range(3):  # a task is read again each time: still said once
            mixed = client.embed(["the apple fell"], model="tiny", task=POS_DEMO.name)[0].mix
        np.testing.assert_allclose(mixed, POS_DEMO.apply(plain), rtol=1e-5, atol=1e-6)
        log = server.stderr()  # after the polls of the load, warm-up and calls (every 0.05 s)
    assert log.count("leads outside") == 2, log
    assert f"version folder {root / 'tiny' / '1'} leads outside {root / 'tiny'}, to {version}: loaded" in log
    served = root / "tiny" / "1"
    task = served / "tasks" / POS_DEMO.name
    assert f"task folder {task} leads outside {served}, to {shared_task}: loaded from there" in log


def test_a_real_export_counts_and_loads(tiny_model_dir, tmp_path):
    published = publish_copy(tiny_model_dir, tmp_path / "root", "tiny")
    assert (published.version, published.path) == (1, tmp_path / "root" / "tiny" / "1")
    assert scan(tmp_path / "root") == {"tiny": [1]}
    (embedded,) = Embedder(published.path, intra_op_threads=1).embed(["The cat sat ."])
    assert embedded.layers.shape[:2] == (3, 4)  # 3 layers, 4 tokens


# -- publishing --------------------------------------------------------------------------------------------------
def test_publishing_numbers_versions_one_more_than_the_highest(tiny_model_dir, tmp_path):
    root = tmp_path / "root"  # created on the first publication
    for expected in (1, 2, 3):
        with publishing(root, "tiny") as publication:
            assert publication.folder.parent == root / "tiny" and publication.folder.name.startswith(INCOMING_PREFIX)
            assert scan(root) == {"tiny": list(range(1, expected))}  # not visible while it is written
            shutil.copytree(tiny_model_dir, publication.folder, dirs_exist_ok=True)
        assert publication.version == expected and publication.path == root / "tiny" / str(expected)
        assert not publication.folder.exists()
    assert scan(root) == {"tiny": [1, 2, 3]}
    assert sorted(p.name for p in (root / "tiny").iterdir()) == ["1", "2", "3"]  # no temporary folder left

    shutil.rmtree(root / "tiny" / "2")  # a gap stays a gap; a folder by hand with a higher number counts
    (root / "tiny" / "7").mkdir()
    assert publish_copy(tiny_model_dir, root, "tiny").version == 8
    assert scan(root) == {"tiny": [1, 3, 8]}


def test_a_published_version_is_readable_by_every_user_whatever_the_umask(tmp_path):
    """tempfile.mkdtemp makes 0700 folders, a umask of 077 0600 files: a server running as another user (the
    image's) could not read the version. The modes are set explicitly: folders 0755, files 0644."""
    source = fake_export(tmp_path / "export")
    (source / "tasks").mkdir()
    (source / "tasks" / "pos.json").write_text("{}")
    old = os.umask(0o077)
    try:
        for path in source.rglob("*"):
            path.chmod(0o700 if path.is_dir() else 0o600)
        publication = publish_copy(source, tmp_path / "root", "m")
    finally:
        os.umask(old)
    assert stat.S_IMODE(publication.path.stat().st_mode) == 0o755
    modes = {
        p.relative_to(publication.path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in publication.path.rglob("*")
    }
    assert modes["tasks"] == 0o755 and modes["tasks/pos.json"] == 0o644 and modes["model.onnx.data"] == 0o644
    assert set(modes.values()) == {0o755, 0o644}


def test_an_error_while_writing_publishes_nothing(tiny_model_dir, tmp_path):
    root = tmp_path / "root"
    with pytest.raises(RuntimeError, match="export crashed"), publishing(root, "tiny") as publication:
        shutil.copytree(tiny_model_dir, publication.folder, dirs_exist_ok=True)
        raise RuntimeError("export crashed")
    assert publication.version is None and not publication.folder.exists()
    assert list((root / "tiny").iterdir()) == [] and scan(root) == {"tiny": []}
    with pytest.raises(KeyboardInterrupt), publishing(root, "tiny") as publication:  # Ctrl-C too
        raise KeyboardInterrupt
    assert list((root / "tiny").iterdir()) == []
    assert publish_copy(tiny_model_dir, root, "tiny").version == 1


def test_an_incomplete_export_is_refused(tiny_model_dir, tmp_path):
    root = tmp_path / "root"
    with pytest.raises(ModelFileError, match=r"not a complete export, nothing was published to .*onnx.json: missing"):
        with publishing(root, "m") as publication:
            (publication.folder / "model.onnx").write_bytes(b"graph")
    with pytest.raises(ModelFileError, match="no passed verification record"):
        publish_copy(fake_export(tmp_path / "failed", passed=False), root, "m")
    with pytest.raises(ModelFileError, match="missing model.onnx"):
        publish_copy(tiny_model_dir, root, "m", ignore=shutil.ignore_patterns("model.onnx"))
    assert list((root / "m").iterdir()) == []
    with pytest.raises(ConfigError, match="model name '.m'"):
        publish_copy(tiny_model_dir, root, ".m")


def test_concurrent_publishers_get_distinct_versions_and_a_poller_never_sees_half_a_version(tmp_path):
    root, name = tmp_path / "root", "m"
    source = fake_export(tmp_path / "export", data=os.urandom(1 << 20), chunks=64)
    stop, seen, problems = threading.Event(), set(), []

    def poll() -> None:
        model_dir = root / name
        while not stop.is_set():
            numbered = numbered_folders(model_dir)  # then complete: versions only appear, never go, here
            complete = complete_versions(model_dir)
            if not set(numbered) <= set(complete):  # a numbered folder that was not (yet) a whole version
                problems.append((numbered, complete))
            seen.update(complete)
            for version in complete:  # a version seen complete is whole: the same bytes as the source
                data = version_dir(root, name, version) / "model.onnx.data"
                if data.read_bytes() != (source / "model.onnx.data").read_bytes():
                    problems.append(version)

    barrier = threading.Barrier(8)

    def publish(_: int) -> list[int]:
        barrier.wait()
        return [_publish_in_chunks(source, root, name) for _ in range(3)]

    poller = threading.Thread(target=poll)
    poller.start()
    threads, results = [], []
    for i in range(8):
        threads.append(threading.Thread(target=lambda i=i: results.extend(publish(i))))
        threads[-1].start()
    for thread in threads:
        thread.join(60)
    # and from other processes, at the same time as a thread of this one
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_publish_three, str(source), str(root), name) for _ in range(3)]
        results.extend(_publish_in_chunks(source, root, name) for _ in range(3))
        for future in futures:
            results.extend(future.result(timeout=120))
    stop.set()
    poller.join(30)

    assert sorted(results) == list(range(1, 8 * 3 + 3 * 3 + 3 + 1))  # each its own number, none lost
    assert scan(root) == {name: sorted(results)}
    assert sorted(p.name for p in (root / name).iterdir()) == sorted(str(v) for v in results)  # no leftovers
    assert not problems, problems[:5]
    assert seen  # the poller did see versions appear


def _publish_in_chunks(source: Path, root: Path, name: str) -> int:
    """A publisher that writes its files one by one (the weights last), as an export does."""
    with publishing(root, name) as publication:
        for file in sorted(source.iterdir(), key=lambda p: p.name == "model.onnx.data"):
            shutil.copyfile(file, publication.folder / file.name)
    return publication.version


def _publish_three(source: str, root: str, name: str) -> list[int]:
    return [_publish_in_chunks(Path(source), Path(root), name) for _ in range(3)]


def test_an_oversized_onnx_json_is_not_read(tmp_path, monkeypatch):
    """A 200 MB onnx.json once blocked the admin index (and the event loop) for 2 s: past the cap it is not read."""
    import elmo.runtime.repository as repository

    folder = fake_export(tmp_path / "models" / "default" / "1")
    monkeypatch.setattr(repository, "MAX_META_BYTES", 100)
    meta = json.loads((folder / "onnx.json").read_text())
    meta["padding"] = "x" * 200
    (folder / "onnx.json").write_text(json.dumps(meta))
    assert "over 100 bytes" in incomplete_reason(folder) and complete_versions(tmp_path / "models" / "default") == []
