"""AllenNLP 2.10.1's own ELMo biLM (``allennlp.modules.elmo._ElmoBiLm``), run in its own venv (.venv-allennlp,
scripts/allennlp-venv.sh) and driven by bench/runtime/allennlp_side_by_side.py, one JSON object a line on
stdin/stdout. It imports nothing of this project: only AllenNLP, torch and numpy.

Requests: ``{"op": "load", "options": PATH, "weights": PATH, "threads": N}``, ``{"op": "sentences", "sentences":
[[token, ...], ...]}``, ``{"op": "embed", "batches": [[first, count], ...], "out": PATH | null}``. ``embed`` runs
each batch as an AllenNLP user does (``batch_to_ids``, the biLM under ``torch.no_grad``, the sentence boundaries
removed, a numpy array per sentence) and answers the seconds it took; with ``out`` it also saves the vectors of
every sentence (layers, tokens, dim) to that .npz, outside the clock. The LSTM state is reset before every batch:
AllenNLP's biLM carries it from batch to batch, which would make its vectors depend on what it saw before (this
project's runtime starts every sentence from the same state).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
from allennlp.modules.elmo import _ElmoBiLm, batch_to_ids


class Worker:
    def __init__(self) -> None:
        self.bilm: _ElmoBiLm | None = None
        self.sentences: list[list[str]] = []

    def load(self, options: str, weights: str, threads: int) -> dict:
        torch.set_num_threads(threads)
        self.bilm = _ElmoBiLm(options, weights, requires_grad=False).eval()
        import allennlp

        return {"allennlp": allennlp.__version__, "torch": torch.__version__, "threads": torch.get_num_threads()}

    def embed_batch(self, batch: list[list[str]]) -> list[np.ndarray]:
        self.bilm._elmo_lstm.reset_states()
        with torch.no_grad():
            output = self.bilm(batch_to_ids(batch))
        layers = torch.stack(output["activations"], dim=1).numpy()  # (B, L+1, T+2, 2P), <S> and </S> included
        return [layers[row, :, 1 : len(sentence) + 1] for row, sentence in enumerate(batch)]

    def embed(self, batches: list[list[int]], out: str | None) -> dict:
        vectors, seconds = [], 0.0
        for first, count in batches:
            batch = self.sentences[first : first + count]
            begin = time.perf_counter()
            answer = self.embed_batch(batch)
            seconds += time.perf_counter() - begin
            vectors += answer if out else []
        if out:
            np.savez(out, *vectors)
        return {"seconds": seconds}

    def handle(self, request: dict) -> dict:
        op = request["op"]
        if op == "load":
            return self.load(request["options"], request["weights"], int(request["threads"]))
        if op == "sentences":
            self.sentences = request["sentences"]
            return {"sentences": len(self.sentences)}
        if op == "embed":
            return self.embed(request["batches"], request.get("out"))
        raise ValueError(f"unknown op {op!r}")


def main() -> None:
    worker = Worker()
    for line in sys.stdin:
        try:
            answer = worker.handle(json.loads(line))
        except Exception as error:  # the driver prints it and stops
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
