"""The word-sense benchmark: does a layer (or a task's mix) give a word different vectors in different senses?

Sentence sets (``en.tsv``, ``zh.tsv`` beside this file, written for the project, README.md there) mark one
occurrence of an ambiguous word per sentence, with its sense. A word's vector in a sentence is the mean of the
vectors of the tokens that spell it (raw Chinese is one token per character, so 苹果 is two). The score is
leave-one-out nearest-neighbour same-sense accuracy: for each occurrence, is the most cosine-similar *other*
occurrence of the same word used in the same sense? Exact ties (layer 0, the char-CNN, sees only the word, so all
its occurrences are identical) count as the share of tied neighbours with the same sense, so a context-blind layer
scores chance, which the report states per word: (n_sense - 1) / (n_word - 1) averaged over occurrences.

Torch-free: ``embed`` is any function from token lists to per-sentence layers (L, n_tokens, D), such as
:meth:`elmo.runtime.Embedder.embed_tokens` or the training loop's PyTorch forward pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from elmo.errors import DataError
from elmo.text.tokenize import tokenize

LANGUAGES = ("en", "zh")
SENSE_DIR = Path(__file__).resolve().parent
_MARK = re.compile(r"\[\[(.+?)\]\]")

Embed = Callable[[list[list[str]]], list[np.ndarray]]


@dataclass(frozen=True)
class SenseExample:
    """One sentence with one marked occurrence of ``word`` used in ``sense``; ``tokens[first:last]`` spell it."""

    word: str
    sense: str
    text: str
    tokens: tuple[str, ...]
    first: int
    last: int


def parse_line(line: str, source: str) -> SenseExample:
    """``word<TAB>sense<TAB>sentence with [[word]] marked once`` -> a tokenized example."""
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 3:
        raise DataError(f"{source}: expected word<TAB>sense<TAB>sentence, got {len(fields)} field(s)")
    word, sense, marked = fields
    marks = list(_MARK.finditer(marked))
    if len(marks) != 1 or marks[0].group(1) != word:
        raise DataError(f"{source}: the sentence must mark '{word}' exactly once as [[{word}]]")
    start = marks[0].start()
    text = marked[:start] + word + marked[marks[0].end() :]
    end = start + len(word)
    tokenized = tokenize(text)
    inside = [i for i, (a, b) in enumerate(tokenized.offsets) if a < end and b > start]
    if not inside or tokenized.offsets[inside[0]][0] != start or tokenized.offsets[inside[-1]][1] != end:
        raise DataError(f"{source}: '{word}' is not a whole run of tokens in {text!r}")
    return SenseExample(word, sense, text, tuple(tokenized.tokens), inside[0], inside[-1] + 1)


@lru_cache(maxsize=4)
def load_senses(language: str) -> tuple[SenseExample, ...]:
    """The packaged sentence set of one language (``en`` or ``zh``)."""
    if language not in LANGUAGES:
        raise DataError(f"no sense set for language {language!r}; known: {', '.join(LANGUAGES)}")
    path = SENSE_DIR / f"{language}.tsv"
    lines = path.read_text(encoding="utf-8").splitlines()
    return tuple(parse_line(line, f"{path.name}:{n}") for n, line in enumerate(lines[1:], start=2) if line.strip())


def occurrence_layers(examples: Sequence[SenseExample], embed: Embed) -> list[np.ndarray]:
    """Per example, its sentence's layers (L, n_tokens, D) as ``embed`` returns them."""
    return list(embed([list(e.tokens) for e in examples]))


def word_vector(example: SenseExample, token_vectors: np.ndarray) -> np.ndarray:
    """(..., n_tokens, D) -> (..., D): the mean over the tokens that spell the word."""
    return token_vectors[..., example.first : example.last, :].mean(axis=-2)


def nearest_neighbour_accuracy(vectors: np.ndarray, words: Sequence[str], senses: Sequence[str]) -> dict:
    """Leave-one-out nearest neighbour among the other occurrences of the same word.

    ``vectors`` (N, D). Returns {"accuracy": micro average, "chance": the same for a context-blind vector,
    "words": {word: {"accuracy", "chance", "n"}}, "hits": per occurrence, in input order, its share of same-sense
    nearest neighbours (for paired comparisons of two models)}.
    """
    vectors = np.asarray(vectors, dtype=np.float64)
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    words_arr, senses_arr = np.asarray(words), np.asarray(senses)
    per_word, hits, chances = {}, np.zeros(len(words)), []
    for word in dict.fromkeys(words):
        rows = np.flatnonzero(words_arr == word)
        sims = unit[rows] @ unit[rows].T
        np.fill_diagonal(sims, -np.inf)
        same = senses_arr[rows][:, None] == senses_arr[rows][None, :]
        np.fill_diagonal(same, False)
        best = sims.max(axis=1, keepdims=True)
        tied = sims >= best - 1e-9  # float noise between identical vectors counts as a tie
        word_hits = (tied & same).sum(axis=1) / tied.sum(axis=1)
        word_chance = same.sum(axis=1) / (len(rows) - 1)
        per_word[word] = {"accuracy": float(word_hits.mean()), "chance": float(word_chance.mean()), "n": len(rows)}
        hits[rows] = word_hits
        chances.extend(word_chance)
    return {
        "accuracy": float(np.mean(hits)),
        "chance": float(np.mean(chances)),
        "words": per_word,
        "hits": [round(float(h), 4) for h in hits],
    }


def score_language(examples: Sequence[SenseExample], layers: Sequence[np.ndarray], mixes: dict | None = None) -> dict:
    """Accuracy per layer and per mix for one language's examples and their sentence layers (L, n, D).

    ``mixes``: {name: function (L, n, D) -> (n, D)}, e.g. a stored task's ``apply``.
    """
    words, senses = [e.word for e in examples], [e.sense for e in examples]
    n_layers = layers[0].shape[0]
    result = {"sentences": len(examples), "words": len(set(words)), "layers": [], "mixes": {}}
    for j in range(n_layers):
        vectors = np.stack([word_vector(e, x[j]) for e, x in zip(examples, layers)])
        result["layers"].append(nearest_neighbour_accuracy(vectors, words, senses))
    for name, mix in (mixes or {}).items():
        vectors = np.stack([word_vector(e, mix(x)) for e, x in zip(examples, layers)])
        result["mixes"][name] = nearest_neighbour_accuracy(vectors, words, senses)
    best = max(range(n_layers), key=lambda j: result["layers"][j]["accuracy"])
    result["best_layer"] = {
        "layer": best,
        "accuracy": result["layers"][best]["accuracy"],
        "hits": result["layers"][best]["hits"],
    }
    return result


def run_benchmark(embed: Embed, mixes: dict | None = None, languages: Sequence[str] = LANGUAGES) -> dict:
    """{language: score_language(...)} for the packaged sentence sets."""
    out = {}
    for language in languages:
        examples = load_senses(language)
        out[language] = score_language(examples, occurrence_layers(examples, embed), mixes)
    return out


def summary(result: dict) -> dict:
    """A flat record for training histories: per language the accuracy of each layer and the best one."""
    flat = {}
    for language, scores in result.items():
        for j, layer in enumerate(scores["layers"]):
            flat[f"sense_{language}_layer{j}"] = round(layer["accuracy"], 4)
        flat[f"sense_{language}_best"] = round(scores["best_layer"]["accuracy"], 4)
    return flat


def markdown_tables(result: dict) -> list[str]:
    """One table per language: rows are words (+ all), columns chance, each layer, each mix."""
    lines: list[str] = []
    for language, scores in result.items():
        n_layers = len(scores["layers"])
        mixes = list(scores["mixes"])
        head = ["word", "n", "chance"] + [f"layer {j}" for j in range(n_layers)] + [f"mix {m}" for m in mixes]
        lines += [f"**{language}** ({scores['sentences']} sentences, {scores['words']} words)", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        columns = scores["layers"] + [scores["mixes"][m] for m in mixes]
        for word, info in scores["layers"][0]["words"].items():
            cells = [f"{c['words'][word]['accuracy']:.3f}" for c in columns]
            lines.append(f"| {word} | {info['n']} | {info['chance']:.3f} | " + " | ".join(cells) + " |")
        cells = [f"**{c['accuracy']:.3f}**" for c in columns]
        chance = scores["layers"][0]["chance"]
        lines.append(f"| all | {scores['sentences']} | {chance:.3f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines
