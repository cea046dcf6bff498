"""ELMo in spaCy: the ``elmo`` pipeline component and the trainable ``elmo.ElmoListener.v1`` architecture.

Both are registered through package entry points (``spacy_factories``, ``spacy_architectures``; the ``spacy``
extra), so ``nlp.add_pipe("elmo", config={"model": "models/default"})`` works after ``pip install`` without importing
this package first. Torch-free: the component runs the onnxruntime runtime or a server, the listener is thinc.

- :mod:`elmo.spacy.component`: the component (per-token layers on the Doc, ``doc.tensor``, similarity hooks).
- :mod:`elmo.spacy.listener`: the listener (a learned scalar mix per downstream component, then a projection).
- :mod:`elmo.spacy.tasks`: a listener's mix -> a served task, and a stored task -> a listener's starting mix.
- :mod:`elmo.spacy.data`: the labelled sets of ``elmo mix`` as spaCy ``DocBin`` files for ``spacy train``.
- :mod:`elmo.spacy.cli`: ``elmo spacy data`` and ``elmo spacy export-task``.
"""
