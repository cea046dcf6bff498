"""The tokenizer's fast path (elmo.text.plain) against ``tokenizers`` itself: every character it decides, in every
position a character can take in a word, and random and real texts."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elmo.text import plain
from elmo.text.pipeline import pipeline_tokens
from elmo.text.plain import character_classes, plain_tokens, prepare_fast_path
from elmo.text.tokenize import tokenize

SENSES = Path(__file__).resolve().parents[2] / "elmo" / "senses"
CLASSES = character_classes()
PLAIN = sorted(set().union(*CLASSES.values()))


def pipeline(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    return pipeline_tokens(text)


def chunks(chars: list[str], size: int = 2000):
    for start in range(0, len(chars), size):
        yield chars[start : start + size]


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_character_is_treated_as_tokenizers_treats_it(name):
    """Each character alone, first, inside and last in a word, doubled, and beside punctuation and an ideograph."""
    for chunk in chunks(CLASSES[name]):
        text = " ".join(f"{c} a{c} b{c}c {c}d {c}{c} ({c}) 中{c}文" for c in chunk)
        assert plain_tokens(text) == pipeline(text)


def test_the_classes_cover_what_a_user_writes():
    """The fast path is the common path: English, Chinese and their punctuation are all in it."""
    for text in (
        "Hello, world! It's 3.5% (ok) — “quoted” …",
        "我吃了一个苹果。“苹果”公司，发布了新品！",
        "naïve café Ünïcödé",
        "Menu Applications → System ≥ 2 × 3 ½ €5 ™",
        "Ελληνικά, русский язык; עברית",
        "日本語のテキスト、ｶﾀｶﾅ。한국어 문장입니다.",
        "emoji 😀 here 👍",
    ):
        assert plain_tokens(text) is not None, text


@pytest.mark.parametrize(
    "text",
    ["a\u200bb", "tab\x00nul", "soft\u00adhyphen", "family 👨\u200d👩 emoji", "ext-B 𠀀 ideograph", "\ue000 own"],
)
def test_other_characters_take_the_tokenizers_path(text):
    assert plain_tokens(text) is None
    result = tokenize(text)
    assert (result.tokens, result.offsets) == pipeline(text)


@given(st.text(alphabet=st.sampled_from(PLAIN), max_size=80))
def test_random_plain_texts_match(text):
    assert plain_tokens(text) == pipeline(text)


@given(st.text(max_size=80))
def test_any_text_matches_through_tokenize(text):
    result = tokenize(text)
    assert (result.tokens, result.offsets) == pipeline(text)


def test_real_sentences_match():
    lines = [line for path in sorted(SENSES.glob("*.tsv")) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(lines) > 100
    plain = 0
    for line in lines:
        fast = plain_tokens(line)
        plain += fast is not None
        if fast is not None:
            assert fast == pipeline(line), line
    assert plain > 0.9 * len(lines)  # the sense sentences (English and Chinese) are nearly all on the fast path


def tables_built() -> bool:
    return plain._patterns.cache_info().currsize == 1


@pytest.fixture
def fresh_process(monkeypatch):
    """elmo.text.plain as a new process finds it: no tables, no texts counted; the tables are worth building after
    3 texts here (TEXTS_BEFORE_TABLES). The character classes stay cached: only the patterns are built again."""
    monkeypatch.setattr(plain, "_texts_without_tables", 0)
    monkeypatch.setattr(plain, "TEXTS_BEFORE_TABLES", 3)
    plain._patterns.cache_clear()
    yield
    prepare_fast_path()


def test_a_process_tokenizes_without_the_tables_until_they_are_worth_building(fresh_process):
    texts = ["Hello, world!", "我吃了一个苹果。", "naïve café", "It's 3.5% more."]
    built = []
    for text in texts:
        result = tokenize(text)
        assert (result.tokens, result.offsets) == pipeline(text)
        built.append(tables_built())
    assert built == [False, False, False, True]  # rent three times, then buy


def test_prepare_fast_path_builds_the_tables_at_once(fresh_process):
    prepare_fast_path()
    assert tables_built() and plain.fast_path_ready()
    tokenize("One text.")
    assert plain._texts_without_tables == plain.TEXTS_BEFORE_TABLES  # nothing counted after
