"""Text in (torch-free): the one tokenizer (tokenize.py) and the one token -> ELMo char-id mapping (chars.py),
used by training, export, runtime, service and batch job alike."""
