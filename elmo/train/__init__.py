"""Training (torch): corpus.py (fetch by package name, splits) -> vocab.py -> config.py, objective.py, loop.py
(``elmo train``) -> evaluate.py (perplexity) beside ngram.py (the Kneser-Ney baseline)."""
