"""The word-sense benchmark (benchmark.py) and its hand-written sentence sets (en.tsv, zh.tsv, README.md).
Torch-free."""
