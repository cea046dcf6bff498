"""The published ELMo models that ``elmo pull NAME`` knows: one table, name -> files, publishers' addresses, sizes,
licence. docs/how-to/pretrained.md carries the same table, written by ``python -m elmo.importers.catalogue`` (and
tests/importers/test_pull.py checks that the two agree). Torch-free.

Sources (checked against the publishers' own pages):

- AllenNLP's English models (https://allennlp.org/elmo, "Pre-trained ELMo Models"; bilm-tf's README links the same
  files): ``options.json`` + ``weights.hdf5`` under https://s3-us-west-2.amazonaws.com/allennlp/models/elmo/, released
  with AllenNLP under the Apache License 2.0.
- ELMoForManyLangs (HIT-SCIR, https://github.com/HIT-SCIR/ELMoForManyLangs, README "Downloads"): 44 languages, one zip
  each, hosted by the NLPL vectors repository (release 1.1, entries 136-179). Each zip holds their model folder
  (config.json, char.dic, word.dic, encoder.pkl, token_embedder.pkl; the network JSON is not inside, and
  ``elmo import-manylangs`` carries it). The README states no licence for the models; it asks users to cite Che et
  al. (2018) and the NLPL repository.

Sizes and checksums: a byte count where a published one was found (a download log of the file, a mirror's Git LFS
pointer), and a SHA-256 where a publisher or a mirror's LFS pointer records one (an LFS pointer names the file's
``oid sha256:...`` and ``size``). A file pinned by its SHA-256 here is checked against it on every download:
a mismatch is refused and nothing is kept. Where none was found, the first download records the size and SHA-256 in
the pins file (trust on first use) and every later download must match them. Each pin below cites where it was found;
none is computed here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

from elmo.sizes import human_bytes

ALLENNLP_BASE = "https://s3-us-west-2.amazonaws.com/allennlp/models/elmo"
NLPL_BASE = "https://vectors.nlpl.eu/repository/11"  # HTTPS: the NLPL repository serves it (HIT-SCIR README links http)
ALLENNLP_LICENCE = "Apache-2.0"
MANYLANGS_LICENCE = "none stated (cite Che et al. 2018)"

ALLENNLP, MANYLANGS = "allennlp", "manylangs"


@dataclass(frozen=True)
class Source:
    """One file of a published model: its name in the download cache, the publisher's address, its size in bytes
    when known (None: recorded by the first download) and its published SHA-256 when one was found (None: pinned on
    first use)."""

    file: str
    url: str
    size: int | None = None
    sha256: str | None = None

    def __post_init__(self) -> None:
        if self.sha256 is not None and (len(self.sha256) != 64 or set(self.sha256) - set("0123456789abcdef")):
            raise ValueError(f"{self.file}: a SHA-256 is 64 lowercase hex digits (got {self.sha256!r})")

    @property
    def pin(self) -> str:
        """How a download of this file is checked, in the words the catalogue table uses."""
        if self.sha256 is not None:
            return "SHA-256 pinned"
        return "size listed, SHA-256 on first use" if self.size is not None else "on first use"


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # ALLENNLP (options.json + weights.hdf5) or MANYLANGS (one zip of their model folder)
    title: str
    files: tuple[Source, ...]
    licence: str
    approx: str = ""  # a size estimate for the docs when the bytes are not known

    @property
    def known_bytes(self) -> int | None:
        sizes = [s.size for s in self.files]
        return None if any(size is None for size in sizes) else sum(sizes)  # type: ignore[arg-type]


def _allennlp(
    name: str,
    stem: str,
    title: str,
    options: int | None,
    weights: int | None,
    approx: str,
    weights_sha256: str | None = None,
) -> Entry:
    files = (  # the folder is named by the full stem, 5.5B included
        Source(f"elmo_{stem}_options.json", f"{ALLENNLP_BASE}/{stem}/elmo_{stem}_options.json", options),
        Source(
            f"elmo_{stem}_weights.hdf5", f"{ALLENNLP_BASE}/{stem}/elmo_{stem}_weights.hdf5", weights, weights_sha256
        ),
    )
    return Entry(name, ALLENNLP, title, files, ALLENNLP_LICENCE, approx)


# (code, language, NLPL entry id): the order of HIT-SCIR's README table. Codes are ISO 639-1, else 639-3
# (cu Old Church Slavonic, grc Ancient Greek); zh is their Chinese model (traditional script, Wikipedia text).
MANYLANGS_MODELS: tuple[tuple[str, str, int], ...] = (
    ("ar", "Arabic", 136),
    ("bg", "Bulgarian", 137),
    ("ca", "Catalan", 138),
    ("cs", "Czech", 139),
    ("cu", "Old Church Slavonic", 140),
    ("da", "Danish", 141),
    ("de", "German", 142),
    ("el", "Greek", 143),
    ("en", "English", 144),
    ("es", "Spanish", 145),
    ("et", "Estonian", 146),
    ("eu", "Basque", 147),
    ("fa", "Persian", 148),
    ("fi", "Finnish", 149),
    ("fr", "French", 150),
    ("ga", "Irish", 151),
    ("gl", "Galician", 152),
    ("grc", "Ancient Greek", 153),
    ("he", "Hebrew", 154),
    ("hi", "Hindi", 155),
    ("hr", "Croatian", 156),
    ("hu", "Hungarian", 157),
    ("id", "Indonesian", 158),
    ("it", "Italian", 159),
    ("ja", "Japanese", 160),
    ("ko", "Korean", 161),
    ("la", "Latin", 162),
    ("lv", "Latvian", 163),
    ("nl", "Dutch", 164),
    ("nb", "Norwegian Bokmål", 165),
    ("nn", "Norwegian Nynorsk", 166),
    ("pl", "Polish", 167),
    ("pt", "Portuguese", 168),
    ("ro", "Romanian", 169),
    ("ru", "Russian", 170),
    ("sk", "Slovak", 171),
    ("sl", "Slovene", 172),
    ("sv", "Swedish", 173),
    ("tr", "Turkish", 174),
    ("ug", "Uyghur", 175),
    ("uk", "Ukrainian", 176),
    ("ur", "Urdu", 177),
    ("vi", "Vietnamese", 178),
    ("zh", "Chinese (traditional)", 179),
)

CATALOGUE: dict[str, Entry] = {
    e.name: e
    for e in (
        _allennlp(
            "small",
            "2x1024_128_2048cnn_1xhighway",
            "AllenNLP ELMo small (English, 1B Word Benchmark)",
            None,
            None,
            "≈ 54 MB (13.6 M float32)",
        ),
        _allennlp(
            "medium",
            "2x2048_256_2048cnn_1xhighway",
            "AllenNLP ELMo medium (English, 1B Word Benchmark)",
            None,
            None,
            "≈ 112 MB (28.0 M float32)",
        ),
        # weights: the Git LFS pointer of elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5 in the Hugging Face mirror
        # lysandre/elmo (https://huggingface.co/lysandre/elmo/commit/e96602c873f90782c21402b8d8d1ff1327318678, the
        # mirror's "Contribute ELMO" commit): oid sha256:a6b92b9c... size 374434792, the size AllenNLP's download
        # logs give for this file. No published checksum was found for the other AllenNLP files or NLPL's zips.
        _allennlp(
            "original",
            "2x4096_512_2048cnn_2xhighway",
            "AllenNLP ELMo original (English, 1B Word Benchmark)",
            336,
            374_434_792,
            "",
            "a6b92b9ccbb13fe489faacd2221c795d4bebe84b75f8aded9d85ea464fa5c994",
        ),
        _allennlp(
            "5.5B",
            "2x4096_512_2048cnn_2xhighway_5.5B",
            "AllenNLP ELMo original (5.5B) (English, Wikipedia + monolingual news crawl)",
            None,
            None,
            "≈ 374 MB (93.6 M float32)",
        ),
        *(
            Entry(
                code,
                MANYLANGS,
                f"ELMoForManyLangs {language}",
                (Source(f"{number}.zip", f"{NLPL_BASE}/{number}.zip"),),
                MANYLANGS_LICENCE,
            )
            for code, language, number in MANYLANGS_MODELS
        ),
    )
}


def resolve_url(url: str, base_url: str | None) -> str:
    """The publisher's ``url``, or with a mirror's ``base_url`` the same path under it (a mirror keeps the
    publishers' layout: https://mirror/allennlp/models/elmo/... and https://mirror/repository/11/179.zip)."""
    if not base_url:
        return url
    return base_url.rstrip("/") + urlsplit(url).path


def _size(entry: Entry) -> str:
    known = entry.known_bytes
    if known is not None:
        return f"{human_bytes(known)} ({known:,} bytes)"
    return f"{entry.approx} (recorded on first download)" if entry.approx else "recorded on first download"


def markdown_table(catalogue: dict[str, Entry] | None = None) -> str:
    """The catalogue as docs/how-to/pretrained.md and ``elmo pull --list`` show it; "checked by" says, file by file,
    whether a download is checked against a published SHA-256 or pinned on first use."""
    catalogue = CATALOGUE if catalogue is None else catalogue
    lines = [
        "| name | model | files (publisher's address) | size | checked by | licence |",
        "|---|---|---|---|---|---|",
    ]
    for entry in catalogue.values():
        links = "<br>".join(f"[`{s.file}`]({s.url})" for s in entry.files)
        pins = "<br>".join(_pin(s) for s in entry.files)
        lines.append(f"| `{entry.name}` | {entry.title} | {links} | {_size(entry)} | {pins} | {entry.licence} |")
    return "\n".join(lines) + "\n"


def _pin(source: Source) -> str:
    short = source.file.rsplit("_", 1)[-1]  # options.json, weights.hdf5, 179.zip
    if source.sha256 is not None:
        return f"{short}: **{source.pin}** (`{source.sha256[:12]}…`)"
    return f"{short}: {source.pin}"


if __name__ == "__main__":  # python -m elmo.importers.catalogue > the table for docs/how-to/pretrained.md
    sys.stdout.write(markdown_table())
