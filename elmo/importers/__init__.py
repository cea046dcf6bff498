"""Importers (torch): published weights of other ELMo systems into a model directory (allennlp.py: AllenNLP /
bilm-tf options.json + weights.hdf5; manylangs.py: ELMoForManyLangs), and pull.py: a published model by name,
downloaded, checked, imported and exported."""
