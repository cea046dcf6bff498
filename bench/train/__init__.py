"""Benches of training: the OpenMP wait policy of the training and adapt steps."""
