"""Model and checkpoints: config.py (the model dataclass, JSON in and out; no torch), bilm.py (the PyTorch biLM),
checkpoint.py (safetensors only). Training side, except config.py."""
