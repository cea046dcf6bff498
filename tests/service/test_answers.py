"""service.core.answers: the serialized EmbedResponse both the unary and streaming calls send, against the message
protobuf builds from the same result field by field."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from elmo.service.core.answers import EmbedResult, PreparedEmbed, response_bytes, sentence_answers, timing_of
from elmo.service.models.batcher import BatchStats

from elmo.runtime.tasks import Task
from elmo.v1 import embedder_pb2 as pb
from elmo.wire import NUMPY_DTYPES, to_tensor


@dataclass
class Version:
    """The fields of a served version an answer names."""

    name: str = "default"
    number: int = 3
    n_layers: int = 3
    dim: int = 8


def result_of(
    sentences, offsets, *, layers=None, task=None, omit_layers=False, dtype=pb.FLOAT32, truncated=None, padded=False
):
    """``padded``: each sentence's vectors a read-only view of one padded batch output (B, n_layers, T, dim), as the
    service's runtime hands them over (elmo.runtime.Embedder ``views=True``), else an array of its own."""
    rng = np.random.default_rng(len(sentences))
    if padded:
        batch = rng.standard_normal((len(sentences), 3, max(map(len, sentences)) + 2, 8)).astype(np.float32)
        batch.flags.writeable = False
        vectors = [batch[i, :, : len(s)] for i, s in enumerate(sentences)]
    else:
        vectors = [rng.standard_normal((3, len(s), 8)).astype(np.float32) for s in sentences]
    prepared = PreparedEmbed(
        Version(), sentences, offsets, layers, task, omit_layers, dtype, truncated or [0] * len(sentences), 1024, 0
    )
    stats = [BatchStats(0.002, 0.010, 5, 80), BatchStats(0.001, 0.020, 9, 40)]
    return EmbedResult(prepared, vectors, stats, started=0.0)


def answered_layers(prepared: PreparedEmbed) -> list[int]:
    """The layers an answer names: none when it carries only the mix, else the requested ones or all three."""
    return [] if prepared.omit_layers else list(prepared.layers or [0, 1, 2])


def built_message(result: EmbedResult, request_id: str) -> pb.EmbedResponse:
    """The answer built with protobuf's own API, one field at a time."""
    prepared = result.prepared
    response = pb.EmbedResponse(
        model="default",
        model_version=3,
        task_stale=prepared.task_stale,
        request_id=request_id,
        layers=answered_layers(prepared),
    )
    for tokens, spans, cut, layers in zip(prepared.sentences, prepared.offsets, prepared.truncated, result.vectors):
        embedding = response.embeddings.add(tokens=tokens, truncated_tokens=cut)
        for start, end in spans or ():
            embedding.offsets.add(start=start, end=end)
        if not prepared.omit_layers:
            to_tensor(
                layers if prepared.layers is None else layers[prepared.layers], prepared.dtype, out=embedding.layers
            )
        if prepared.task is not None:
            to_tensor(prepared.task.apply(layers), prepared.dtype, out=embedding.mix)
    response.timing.CopyFrom(pb.Timing(**timing_of(result)))
    return response


def parsed(result: EmbedResult, request_id: str = "") -> pb.EmbedResponse:
    return pb.EmbedResponse.FromString(response_bytes(result, request_id))


def same_but_total(answer: pb.EmbedResponse, expected: pb.EmbedResponse) -> None:
    assert answer.timing.total_ms >= 0
    answer.timing.total_ms = expected.timing.total_ms = 0  # the clock moved between the two builds
    assert answer == expected


TASK = Task(name="pos", kind="tagging", n_layers=3, dim=8, weights=[0.1, 0.5, -0.2], gamma=1.5)
TEXTS = [["I", "like", "苹果", "."], ["Long", "text"] * 70, ["x"]]
SPANS = [[(0, 1), (2, 6), (7, 9), (9, 10)], [(i, i + 1) for i in range(140)], [(200, 16500)]]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"layers": [2, 0]},
        {"task": TASK},
        {"task": TASK, "omit_layers": True},
        {"dtype": pb.FLOAT16},
        {"truncated": [0, 5, 0]},
    ],
    ids=["all-layers", "chosen-layers", "task", "mix-only", "float16", "truncated"],
)
@pytest.mark.parametrize("padded", [False, True], ids=["own-arrays", "batch-views"])
def test_serialized_answer_is_the_message_protobuf_builds(options, padded):
    result = result_of(TEXTS, SPANS, padded=padded, **options)
    same_but_total(parsed(result, "req-7"), built_message(result, "req-7"))


def test_pretokenized_sentences_have_no_offsets():
    result = result_of([["a", "b"], ["c"]], [None, None])
    answer = parsed(result)
    assert [list(e.offsets) for e in answer.embeddings] == [[], []]
    same_but_total(answer, built_message(result, ""))


def test_sentence_vectors_are_in_the_wire_dtype_and_copied_only_to_convert():
    for dtype in (pb.FLOAT32, pb.FLOAT16):
        for sentence in sentence_answers(result_of(TEXTS, SPANS, layers=[1], task=TASK, dtype=dtype, padded=True)):
            for array in (sentence.layers, sentence.mix):
                assert array.dtype == NUMPY_DTYPES[dtype] and array.flags.c_contiguous
    # float32, every layer in order: the batch's own vectors, not a copy (the answer's bytes are the one copy)
    result = result_of(TEXTS, SPANS, padded=True)
    for sentence, vectors in zip(sentence_answers(result), result.vectors):
        assert sentence.layers is vectors and not sentence.layers.flags.c_contiguous


def test_timing_reports_the_slowest_piece_and_the_largest_batch():
    timing = timing_of(result_of(TEXTS, SPANS))
    assert timing["queue_ms"] == pytest.approx(1.0) and timing["inference_ms"] == pytest.approx(20.0)
    assert (timing["batch_sentences"], timing["batch_tokens"]) == (5, 80)
