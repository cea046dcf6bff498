"""The report's 苹果 experiment pools the word's two character tokens as the word-sense benchmark does."""

from __future__ import annotations

import numpy as np

from elmo.mix.cli import APPLE_SENTENCES, apple_experiment, apple_vectors
from elmo.runtime import Embedder
from elmo.text.tokenize import tokenize


def test_apple_vectors_are_the_mean_of_the_two_character_tokens(tiny_model_dir):
    embedder = Embedder(tiny_model_dir, intra_op_threads=1)
    sentences = ["我吃了一个苹果。", "苹果公司发布了新手机，苹果很贵。"]
    vectors = apple_vectors(embedder, sentences)
    for sentence, vector in zip(sentences, vectors):
        tokens = tokenize(sentence).tokens
        first = tokens.index("苹")  # the first occurrence
        layers = embedder.embed_tokens([tokens])[0]
        assert np.allclose(vector, layers[:, first : first + 2].mean(axis=1), atol=1e-6)
    result = apple_experiment(embedder)
    n = len(APPLE_SENTENCES["fruit"]) + len(APPLE_SENTENCES["company"])
    assert [len(layer["matrix"]) for layer in result["layers"]] == [n] * 3
