"""The development benchmarks: not installed (``elmo bench``, the one a user runs, is elmo.bench). Run a script from
the repository root as ``.venv/bin/python -m bench.<subject>.<script>``, e.g. ``-m bench.service.latency``; the
subjects are runtime/, export/, service/, batch/ and spacy/, and what they share is the kit (bench.kit)."""
