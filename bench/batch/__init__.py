"""Benches of the batch job, `elmo embed-file`, against the in-process runtime."""
