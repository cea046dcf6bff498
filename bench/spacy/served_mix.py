"""A mix learned in ``spacy train``, exported as a task and served: the service's answer against the listener's own.

    python -m bench.spacy.served_mix --pipeline training/model-last --component tagger --sentences 500 \\
        --out bench/results/spacy_served_mix.json

Copies the pipeline's model directory (its ``elmo`` component's) to a temporary folder, stores the component's
listener mix there as a task (``elmo spacy export-task``), starts ``elmo serve`` on the copy and asks it for
``task=NAME`` on the first ``--sentences`` test sentences (Brown's held-out test files, gold tokens); the same tokens
go through the pipeline's ``elmo`` component and the listener's mix layer in process. Reports the largest
absolute difference per token vector over all of them (the bar: 1e-5).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from bench.kit.results import bench_parser, result_path, write_json
from bench.kit.serve import start_server
from elmo.bench.figures import machine


def run(args) -> dict:
    import spacy
    from spacy.tokens import Doc

    from elmo.client import EmbedderClient
    from elmo.mix.task_data import load_builtin
    from elmo.spacy.listener import find_mix
    from elmo.spacy.tasks import export_task

    nlp = spacy.load(args.pipeline)
    source = Path(nlp.get_pipe("elmo").model_path)
    sentences = load_builtin(args.set).splits["test"].sentences[: args.sentences]
    work = Path(tempfile.mkdtemp(prefix="served-mix-"))
    try:
        model = work / "model"
        shutil.copytree(source, model, ignore=shutil.ignore_patterns("report", "*.png"))
        export_task(args.pipeline, args.component, model, "spacy_mix")
        mix = find_mix(nlp.get_pipe(args.component).model)
        own = mix.predict([nlp.get_pipe("elmo")(Doc(nlp.vocab, words=words)) for words in sentences])
        server = start_server(model, http=False, threads=args.threads)
        try:
            with EmbedderClient(server.grpc_target) as client:
                served = []
                for i in range(0, len(sentences), 32):
                    answer = client.embed(sentences[i : i + 32], task="spacy_mix", omit_layers=True)
                    served.extend(e.mix for e in answer)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    differences = [float(np.abs(a - b).max()) for a, b in zip(own, served)]
    return {
        "pipeline": str(args.pipeline),
        "component": args.component,
        "model": str(source),
        "sentences": len(sentences),
        "tokens": sum(len(s) for s in sentences),
        "weights": [float(w) for w in mix.get_param("W")],
        "gamma": float(mix.get_param("g")[0]),
        "max_abs_difference": max(differences),
        "bar": 1e-5,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("spacy.served_mix", __doc__, model=False)
    parser.add_argument("--pipeline", type=Path, required=True, help="a pipeline trained with the ELMo listener")
    parser.add_argument("--component", default="tagger")
    parser.add_argument("--set", default="brown-pos", choices=("brown-pos", "msra-ner"), help="whose test sentences")
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=result_path("spacy_served_mix.json"))
    args = parser.parse_args(argv)
    result = run(args)
    write_json(args.out, result)
    print(
        f"{result['sentences']} sentences, {result['tokens']} tokens: served vs listener max |diff| "
        f"{result['max_abs_difference']:.2e} (bar 1e-5); wrote {args.out}"
    )


if __name__ == "__main__":
    main()
