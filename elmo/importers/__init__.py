"""Importers (torch): published weights of other ELMo systems into a model directory (allennlp.py: AllenNLP /
bilm-tf options.json + weights.hdf5)."""
