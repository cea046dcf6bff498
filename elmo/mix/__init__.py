"""Task scalar mixes: store.py applies a stored mix in numpy (torch-free: service, batch job, features);
modules.py (ScalarMix, Elmo), task_data.py and cli.py (``elmo mix train / report``) train them with torch."""
