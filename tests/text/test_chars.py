import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from elmo.text.chars import (
    BOS_IDS,
    BYTES,
    EOS_IDS,
    MAX_CHARS,
    N_CHAR_IDS,
    batch_to_char_ids,
    char_lengths,
    lengths_of,
    word_to_char_ids,
)


def test_ascii_word_matches_published_scheme():
    ids = word_to_char_ids("ab")
    # BOW 258, 'a' 97, 'b' 98, EOW 259, then in-word pad 260 -- all shifted by +1.
    assert ids[:4].tolist() == [259, 98, 99, 260]
    assert (ids[4:] == 261).all()
    assert ids.shape == (MAX_CHARS,)


def test_sentence_boundaries_and_literal_tokens():
    assert BOS_IDS[:3].tolist() == [259, 257, 260]
    assert EOS_IDS[:3].tolist() == [259, 258, 260]
    assert (word_to_char_ids("<S>") == BOS_IDS).all()
    assert (word_to_char_ids("</S>") == EOS_IDS).all()


def test_cjk_is_utf8_bytes():
    ids = word_to_char_ids("苹")
    assert ids[1:4].tolist() == [b + 1 for b in "苹".encode()]
    assert ids[4] == 260


def test_long_word_is_truncated_to_48_bytes_not_an_error():
    ids = word_to_char_ids("x" * 200)
    assert ids[0] == 259 and ids[48] == ord("x") + 1 and ids[49] == 260


def test_batch_pads_with_zero_token_slots():
    batch = batch_to_char_ids([["a", "b", "c"], ["d"]])
    assert batch.shape == (2, 3, MAX_CHARS)
    assert (batch[1, 1:] == 0).all()
    assert lengths_of(batch).tolist() == [3, 1]


@given(st.text(min_size=1, max_size=80))
def test_any_word_maps_into_the_table(word):
    ids = word_to_char_ids(word)
    assert ids.min() >= 1 and ids.max() < N_CHAR_IDS
    assert ids[0] == 259
    raw = word.encode("utf-8", "ignore")[:48]
    if word not in ("<S>", "</S>"):
        assert bytes((ids[1 : 1 + len(raw)] - 1).astype(np.uint8).tolist()) == raw
        assert ids[1 + len(raw)] == 260


def test_char_lengths_count_up_to_the_end_of_word_marker():
    rows = np.stack([word_to_char_ids(w) for w in ["a", "abc", "x" * 70, "苹"]] + [BOS_IDS])
    # BOW + bytes + EOW; a long word keeps its 48 bytes; a CJK char is 3 bytes.
    assert char_lengths(rows, BYTES.pad_id).tolist() == [3, 5, MAX_CHARS, 5, 3]
