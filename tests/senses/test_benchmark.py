from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from elmo.errors import DataError
from elmo.runtime import Embedder
from elmo.senses.benchmark import (
    LANGUAGES,
    load_senses,
    markdown_tables,
    nearest_neighbour_accuracy,
    parse_line,
    run_benchmark,
    summary,
)


@pytest.mark.parametrize("language", LANGUAGES)
def test_packaged_sets_meet_the_benchmark_design(language):
    examples = load_senses(language)
    per_sense = Counter((e.word, e.sense) for e in examples)
    words = {word for word, _ in per_sense}
    assert len(words) >= 6
    assert min(per_sense.values()) >= 10
    assert all(len({s for w, s in per_sense if w == word}) >= 2 for word in words)
    assert len({e.text for e in examples}) == len(examples)
    for e in examples:
        assert "".join(e.tokens[e.first : e.last]) == e.word.replace(" ", "")


def test_chinese_words_are_runs_of_characters_in_raw_text():
    example = parse_line("苹果\tcompany\t[[苹果]]昨天发布了新手机。", "zh")
    assert example.tokens[example.first : example.last] == ("苹", "果")
    assert example.text == "苹果昨天发布了新手机。"


@pytest.mark.parametrize(
    "line, problem",
    [
        ("bank\tfinance\tThe bank was closed.", "exactly once"),
        ("bank\tfinance\tThe [[bank]] and the [[bank]].", "exactly once"),
        ("bank\tfinance\tThe [[banks]] were closed.", "exactly once"),
        ("bank\tThe [[bank]] was closed.", "got 2 field"),
        ("ban\tfinance\tThe [[ban]]k was closed.", "whole run of tokens"),
    ],
)
def test_malformed_lines_name_the_problem(line, problem):
    with pytest.raises(DataError, match=problem):
        parse_line(line, "x.tsv:2")


def test_nearest_neighbour_accuracy_separated_blind_and_swapped():
    words, senses = ["w"] * 6, ["a", "a", "a", "b", "b", "b"]
    separated = np.array([[1, 0], [1, 0.1], [1, 0.2], [0, 1], [0.1, 1], [0.2, 1]], float)
    assert nearest_neighbour_accuracy(separated, words, senses)["accuracy"] == 1.0
    blind = nearest_neighbour_accuracy(np.ones((6, 2)), words, senses)
    assert blind["accuracy"] == pytest.approx(blind["chance"]) == pytest.approx(2 / 5)
    # each vector's nearest neighbour is in the other sense
    swapped = np.array([[1, 0], [1, 0.01], [0, 1], [0.01, 1]], float)
    result = nearest_neighbour_accuracy(swapped, ["w"] * 4, ["a", "b", "a", "b"])
    assert result["accuracy"] == 0.0
    assert result["words"]["w"]["n"] == 4


def test_words_are_scored_only_against_their_own_occurrences():
    # identical vectors across words must not count: each word has its own neighbours
    vectors = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], float)
    result = nearest_neighbour_accuracy(vectors, ["x", "x", "y", "y"], ["a", "a", "b", "b"])
    assert result["accuracy"] == 1.0
    assert result["words"]["x"]["chance"] == 1.0


def test_hits_are_per_occurrence_in_input_order():
    # words interleaved; each word's third occurrence finds the other sense (grouped by word it would read 1,1,0,1,1,0)
    vectors = np.array([[1, 0], [0, 1], [1, 0.1], [0, 1], [0, 1], [1, 0.3]], float)
    result = nearest_neighbour_accuracy(vectors, ["x", "y", "x", "y", "x", "y"], ["a", "b", "a", "b", "c", "c"])
    assert result["hits"] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert np.mean(result["hits"]) == pytest.approx(result["accuracy"])


def test_runtime_benchmark_layer_zero_is_context_blind(tiny_model_dir):
    embedder = Embedder(tiny_model_dir, intra_op_threads=1, inter_op_threads=1)
    result = run_benchmark(embedder.embed_tokens, {"top": lambda layers: layers[-1]})
    for language in LANGUAGES:
        scores = result[language]
        assert scores["layers"][0]["accuracy"] == pytest.approx(scores["layers"][0]["chance"])
        assert scores["mixes"]["top"]["accuracy"] == scores["layers"][-1]["accuracy"]
        assert scores["best_layer"]["accuracy"] == max(x["accuracy"] for x in scores["layers"])
    flat = summary(result)
    assert flat["sense_en_best"] == round(result["en"]["best_layer"]["accuracy"], 4)
    table = "\n".join(markdown_tables(result))
    assert "| 苹果 |" in table and "mix top" in table
