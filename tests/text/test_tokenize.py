from hypothesis import given
from hypothesis import strategies as st

from elmo.text.tokenize import tokenize, whitespace_tokens


def test_chinese_is_split_per_character_with_offsets():
    text = "我吃了一个苹果。"
    result = tokenize(text)
    assert result.tokens == list(text)
    assert result.offsets == [(i, i + 1) for i in range(len(text))]


def test_english_splits_punctuation_and_keeps_case():
    result = tokenize("Hello, Apple Inc.!")
    assert result.tokens == ["Hello", ",", "Apple", "Inc", ".", "!"]
    assert result.offsets[2] == (7, 12)


def test_mixed_text_offsets_point_into_original():
    text = "  我买了一台苹果电脑 (Apple MacBook) 😀 naïve"
    result = tokenize(text)
    assert "苹" in result.tokens and "MacBook" in result.tokens and "naïve" in result.tokens
    for token, (start, end) in zip(result.tokens, result.offsets):
        assert text[start:end] == token


def test_empty_and_blank_text_give_no_tokens():
    assert tokenize("").tokens == []
    assert tokenize(" \t\n").tokens == []


def test_pretokenized_input_passes_through_untouched():
    assert whitespace_tokens("New  York's 苹果电脑 ,") == ["New", "York's", "苹果电脑", ","]


@given(st.text(max_size=60))
def test_offsets_are_ordered_and_inside_the_text(text):
    result = tokenize(text)
    previous_end = 0
    for token, (start, end) in zip(result.tokens, result.offsets):
        assert previous_end <= start < end <= len(text)
        assert token and not token.isspace()
        previous_end = end
