#!/usr/bin/env bash
# Train a larger biLM (configs/default-gpu-large.json: cell 1024, projection 256, ~7 minutes) on the borrowed GPU
# machine in ONE device call, and bring the weights back. That machine has no network, Python 3.12 with torch
# (CUDA 13) and the CPU onnxruntime; a call carries at most 64 MiB (the working tree included) and brings back at
# most 8 files of at most 16 MiB each, written under $OUT.
#
#   scripts/gpu-train.sh prepare              here: fetch the corpus if data/corpus lacks it, download the wheels the
#                                             training path imports (numpy, safetensors, tokenizers, tqdm: the .venv
#                                             versions, for CPython 3.12 manylinux x86_64), pack them with the
#                                             xz-compressed corpus files the config reads into .gpu-train/bundle.tar,
#                                             write .gpu-train/manifest.sha256, check that the tree and the bundle fit
#                                             in one call, and print the device call
#   scripts/gpu-train.sh train                there: check the bundle, unpack it into /tmp, install the wheels whose
#                                             module is missing into /tmp/elmo-train-site (pip --no-index --no-deps
#                                             --target), restore data/corpus, train into runs/gpu-large (CUDA when
#                                             torch sees one) and write into $OUT: model.safetensors.part-NN (float16,
#                                             15 MiB parts), config.json, vocab.txt, train_state.json, gpu-train.json
#                                             (timings, tokens/s, device, sha256s) and train.log: at most 8 files
#   scripts/gpu-train.sh receive FILES MODEL  here: check the parts against gpu-train.json, reassemble them and write
#                                             the model directory MODEL (config.json, vocab.txt, model.safetensors,
#                                             train_state.json, gpu-train.json, curve.png), loaded once as a check
#
# The device call (prepare prints it with the measured sizes):
#   run(command="bash scripts/gpu-train.sh train", carry=[".gpu-train/bundle.tar", ".gpu-train/manifest.sha256"],
#       timeout_s=560)
# then, here, with the folder the files came back in: scripts/gpu-train.sh receive FILES_AT runs/gpu-large
#
# Time: the config stops training at 420 s (validation and checkpoints included) and anneals by time; unpacking,
# installing and loading the data take under a minute before it, the final validation, the softmax-bias refit
# and the packing well under one after. A guard interrupts training GPU_TRAIN_DEADLINE_S (540) s after the start
# less GPU_TRAIN_RESERVE_S (20) for the packing: the last checkpoint (every 200 steps) comes back then.
#
# Rehearsal on the CPU (the test does this): GPU_TRAIN_TINY=1 runs the same three steps with configs/tiny.json's
# model shape, a slice of the corpus (GPU_TRAIN_TINY_LINES, 3000 lines per train file), a few steps, 1 thread and
# the installed packages (GPU_TRAIN_WHEELS=none), nothing written into data/ or runs/, e.g.
#   export GPU_TRAIN_TINY=1 GPU_TRAIN_DIR=/tmp/gt-carry; scripts/gpu-train.sh prepare \
#     && OUT=/tmp/gt-out scripts/gpu-train.sh train && scripts/gpu-train.sh receive /tmp/gt-out /tmp/gt-model
#
# Environment: GPU_TRAIN_CONFIG (configs/default-gpu-large.json); GPU_TRAIN_DIR (.gpu-train): what prepare writes
# and train reads; GPU_TRAIN_CORPUS (data/corpus): the corpus prepare packs; GPU_TRAIN_DATA (data/corpus; WORK/corpus
# when tiny): where train restores it, the config's data/corpus/ paths pointed there (a file already there must be
# the same); GPU_TRAIN_RUN (runs/gpu-large; WORK/run when tiny): the training run folder; GPU_TRAIN_WORK
# (/tmp/elmo-gpu-train); GPU_TRAIN_SITE (/tmp/elmo-train-site); GPU_TRAIN_WHEELS: download (default), none (tiny's
# default: what is installed) or a folder of *.whl; GPU_TRAIN_ALLOW_CPU=1 trains the full config without CUDA
# (refused otherwise); PYTHON: python3 for train, .venv/bin/python (if there) for prepare and receive;
# GPU_PYTHON_VERSION (3.12): the interpreter the wheels are downloaded for.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."

DIR="${GPU_TRAIN_DIR:-.gpu-train}"
CONFIG="${GPU_TRAIN_CONFIG:-configs/default-gpu-large.json}"
CORPUS="${GPU_TRAIN_CORPUS:-data/corpus}"
WORK="${GPU_TRAIN_WORK:-/tmp/elmo-gpu-train}"
SITE="${GPU_TRAIN_SITE:-/tmp/elmo-train-site}"
TINY="${GPU_TRAIN_TINY:-0}"
if [[ "$TINY" == "1" ]]; then  # a rehearsal here never writes into this checkout's data/ or runs/
    DATA="${GPU_TRAIN_DATA:-$WORK/corpus}"; RUN="${GPU_TRAIN_RUN:-$WORK/run}"
else
    DATA="${GPU_TRAIN_DATA:-data/corpus}"; RUN="${GPU_TRAIN_RUN:-runs/gpu-large}"
fi
if [[ "$TINY" == "1" ]]; then WHEELS="${GPU_TRAIN_WHEELS:-none}"; else WHEELS="${GPU_TRAIN_WHEELS:-download}"; fi
BUNDLE=bundle.tar
MANIFEST=manifest.sha256
CALL_LIMIT_MIB=64  # what one device call carries, the working tree included
SLACK_MIB=4
MAX_FILES=8        # what one device call brings back: 8 files of at most 16 MiB
PART_MIB=15
MAX_PARTS=$(( MAX_FILES - 5 ))  # besides the parts: config.json, vocab.txt, train_state.json, gpu-train.json, train.log
CARRIED_PACKAGES=(numpy safetensors tokenizers tqdm)  # what the training path imports besides torch (no matplotlib)

die() { echo "gpu-train: $1" >&2; exit "${2:-1}"; }

local_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; elif [[ -x .venv/bin/python ]]; then echo .venv/bin/python
    else echo python3; fi
}

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# Expected sha256 of NAME in the manifest FILE (empty when not listed).
expected_sha() { awk -v name="$2" '$2 == name { print $1 }' "$1"; }

# Bytes a device call spends on the working tree (tracked and untracked-not-ignored files).
tree_bytes() {
    git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
        | awk '{ total += $1 } END { print total + 0 }'
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# At most LIMIT evenly spaced lines of FILE (the tiny rehearsal's slice).
slice_lines() {
    local file="$1" limit="$2" n step
    n=$(wc -l <"$file")
    step=$(( (n + limit - 1) / limit )); (( step >= 1 )) || step=1
    awk -v s="$step" '(NR - 1) % s == 0' "$file"
}

# The corpus files the config reads (basenames under data/corpus/), one per line.
config_corpus_files() {
    "$1" - "$CONFIG" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))["data"]
train = data["train"] if isinstance(data["train"], list) else [data["train"]]
names = []
for path in [*train, data["valid"], data["vocab"]]:
    if not path.startswith("data/corpus/"):
        sys.exit(f"gpu-train: {sys.argv[1]}: {path} is not under data/corpus/ (only that folder travels)")
    if path[len("data/corpus/"):] not in names:
        names.append(path[len("data/corpus/"):])
print("\n".join(names))
EOF
}

# The carried packages pinned to the versions PYTHON holds (so the machine behaves as here), one per line.
wheel_pins() {
    "$1" - "${CARRIED_PACKAGES[@]}" <<'EOF'
import importlib.metadata, sys
print("\n".join(f"{name}=={importlib.metadata.version(name)}" for name in sys.argv[1:]))
EOF
}

download_wheels() {
    local into="$1" version="${GPU_PYTHON_VERSION:-3.12}"
    shift
    local -a pins=("$@")
    echo "downloading for CPython $version (the .venv versions): ${pins[*]}"
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --abi "cp${version/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$into" "${pins[@]}"
}

# -- prepare (here) ------------------------------------------------------------------------------------------------
prepare() {
    local python stage name
    python="$(local_python)"
    [[ -f "$CONFIG" ]] || die "no config $CONFIG"
    if [[ ! -f "$CORPUS/train.txt" ]]; then
        [[ "$CORPUS" == data/corpus ]] || die "no $CORPUS/train.txt"
        echo "no data/corpus/train.txt: elmo data fetch --out data/corpus"
        "$python" -m elmo.cli data fetch --out data/corpus
    fi
    [[ "$TINY" == "1" ]] || model_parts "$python" "$CONFIG" "$CORPUS/vocab.txt"  # the weights fit the way back
    stage="$DIR/stage"
    rm -rf "$stage" "${DIR:?}/$BUNDLE" "$DIR/$MANIFEST"
    mkdir -p "$stage/corpus" "$stage/wheels" "$DIR/restored"
    rm -rf "${DIR:?}/restored"/*

    # The corpus files as the machine restores them (DIR/restored), and what travels of them (xz in stage/corpus).
    # train.txt is train.en.txt then train.zh.txt: with train.zh.txt travelling anyway, train.en.txt goes instead.
    local -a needed travel
    mapfile -t needed < <(config_corpus_files "$python")
    travel=("${needed[@]}")
    local rebuild=0
    if [[ " ${needed[*]} " == *" train.txt "* && -f "$CORPUS/train.en.txt" && -f "$CORPUS/train.zh.txt" ]] \
        && cat "$CORPUS/train.en.txt" "$CORPUS/train.zh.txt" | cmp -s - "$CORPUS/train.txt"; then
        rebuild=1
        travel=(train.en.txt)
        for name in "${needed[@]}"; do [[ "$name" == train.txt ]] || travel+=("$name"); done
        [[ " ${travel[*]} " == *" train.zh.txt "* ]] || travel+=(train.zh.txt)
    fi
    for name in "${travel[@]}"; do
        [[ -f "$CORPUS/$name" ]] || die "no $CORPUS/$name (the config reads it)"
        if [[ "$TINY" == "1" && "$name" == valid* ]]; then
            slice_lines "$CORPUS/$name" 500 >"$DIR/restored/$name"
        elif [[ "$TINY" == "1" && "$name" != vocab.txt ]]; then
            slice_lines "$CORPUS/$name" "${GPU_TRAIN_TINY_LINES:-3000}" >"$DIR/restored/$name"
        else
            cp "$CORPUS/$name" "$DIR/restored/$name"
        fi
        xz -T1 -6 -c "$DIR/restored/$name" >"$stage/corpus/$name.xz"
    done
    if (( rebuild )); then
        cat "$DIR/restored/train.en.txt" "$DIR/restored/train.zh.txt" >"$DIR/restored/train.txt"
    fi
    echo "corpus: ${needed[*]} from $CORPUS$( (( rebuild )) && echo " (train.txt rebuilt there from" \
        "train.en.txt + train.zh.txt)")$([[ "$TINY" == "1" ]] && echo ", tiny slice")"

    case "$WHEELS" in
        none) echo "wheels: none (GPU_TRAIN_WHEELS=none: the machine's own packages)" ;;
        download)
            local -a pins
            local pin
            mapfile -t pins < <(wheel_pins "$python")
            mkdir -p "$DIR/wheels"  # a cache: pip download skips the wheels already there
            download_wheels "$DIR/wheels" "${pins[@]}"
            for pin in "${pins[@]}"; do
                compgen -G "$DIR/wheels/${pin%%==*}-${pin##*==}-*.whl" >/dev/null || die "no wheel for $pin"
                cp "$DIR/wheels/${pin%%==*}-${pin##*==}"-*.whl "$stage/wheels/"
            done ;;
        *) compgen -G "$WHEELS/*.whl" >/dev/null || die "no *.whl in $WHEELS"; cp "$WHEELS"/*.whl "$stage/wheels/" ;;
    esac
    if [[ "$TINY" == "1" ]]; then echo tiny >"$stage/mode.txt"; else echo full >"$stage/mode.txt"; fi

    # Sorted names and fixed metadata: the same inputs give the same bundle (and sha256) every time.
    (cd "$stage" && find . -type f -printf '%P\n' | LC_ALL=C sort \
        | tar -cf - --owner=0 --group=0 --numeric-owner --mtime=@0 -T -) >"$DIR/$BUNDLE"
    {
        (cd "$DIR" && sha256sum "$BUNDLE")
        for name in $(cd "$DIR/restored" && ls | LC_ALL=C sort); do
            echo "$(sha_of "$DIR/restored/$name")  corpus/$name"
        done
    } >"$DIR/$MANIFEST"
    rm -rf "$stage" "${DIR:?}/restored"

    local tree bundle total limit
    tree="$(tree_bytes)"
    bundle=$(( $(stat -c %s "$DIR/$BUNDLE") + $(stat -c %s "$DIR/$MANIFEST") ))
    total=$(( tree + bundle ))
    limit=$(( (CALL_LIMIT_MIB - SLACK_MIB) * 1048576 ))
    echo "sizes: working tree $(mib "$tree") MiB + bundle and manifest $(mib "$bundle") MiB = $(mib "$total") MiB" \
        "(limit $CALL_LIMIT_MIB MiB per call, $SLACK_MIB MiB kept as slack)"
    if (( total > limit )); then
        rm -f "${DIR:?}/$BUNDLE" "$DIR/$MANIFEST"
        local why="the working tree ($(mib "$tree") MiB) and $DIR ($(mib "$bundle") MiB) come to $(mib "$total") MiB:"
        why+=" over the $(( CALL_LIMIT_MIB - SLACK_MIB )) MiB a device call may carry here ($CALL_LIMIT_MIB MiB less"
        die "$why $SLACK_MIB MiB slack). Make the tree smaller (untracked files travel too)."
    fi

    echo "the device call:"
    echo "  run(command=\"bash scripts/gpu-train.sh train\", carry=[\"$DIR/$BUNDLE\", \"$DIR/$MANIFEST\"]," \
        "timeout_s=560)"
    [[ "$TINY" == "1" ]] && echo "tiny bundle: rehearse here with" \
        "OUT=FILES_DIR GPU_TRAIN_TINY=1 GPU_TRAIN_DIR=$DIR scripts/gpu-train.sh train"
    echo "then: scripts/gpu-train.sh receive FILES_AT MODEL_DIR"
}

# The float16 model.safetensors of CONFIG's model with VOCAB's size: prints its MiB and parts; fails past MAX_PARTS.
model_parts() {
    "$1" - "$2" "$3" "$PART_MIB" "$MAX_PARTS" <<'EOF'
import json, math, sys
from elmo.model.bilm import BiLM
from elmo.model.config import ModelConfig
config, vocab, part_mib, max_parts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
n_vocab = sum(1 for _ in open(vocab, encoding="utf-8"))
model = json.load(open(config))["model"]
bilm = BiLM(ModelConfig.from_dict({**model, "vocab_size": n_vocab}, source=config))
size = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in bilm.state_dict().values())
parts = math.ceil(size / (part_mib * 1048576))
print(f"model: {sum(p.numel() for p in bilm.parameters()) / 1e6:.1f} M parameters, "
      f"{size / 1048576:.1f} MiB in float16: {parts} part(s) of at most {part_mib} MiB", file=sys.stderr)
if parts > max_parts:
    sys.exit(f"gpu-train: {config}: {parts} parts of {part_mib} MiB, but only {max_parts} fit beside the other 5 "
             "files a call brings back (8 files at most)")
EOF
}

# -- train (there) -------------------------------------------------------------------------------------------------
now() { date +%s.%N; }

train_steps() {
    local python="${PYTHON:-python3}" started t0 t1 t2 t3 t4 t5 sha expected name
    started="$(now)"
    echo "gpu-train: $(date -u +%FT%TZ) on $(hostname); GPU_TRAIN_TINY=$TINY"
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1 || true; else echo "nvidia-smi: not found"; fi
    rm -rf "$WORK" && mkdir -p "$WORK/bundle"
    # torch and the device it trains on (elmo.train.loop takes CUDA whenever torch sees it)
    "$python" - "$WORK/device.json" <<'EOF'
import json, sys
import torch
cuda = torch.cuda.is_available()
device = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "cuda_available": cuda,
          "device": torch.cuda.get_device_name(0) if cuda else "cpu",
          "device_count": torch.cuda.device_count() if cuda else 0}
print("torch", json.dumps(device))
json.dump(device, open(sys.argv[1], "w"))
EOF
    if [[ "$TINY" != "1" && "${GPU_TRAIN_ALLOW_CPU:-0}" != "1" ]] \
        && grep -q '"cuda_available": false' "$WORK/device.json"; then
        die "torch sees no CUDA device: refusing a 7-minute CPU run (GPU_TRAIN_ALLOW_CPU=1 forces it)"
    fi
    [[ -f "$DIR/$MANIFEST" && -f "$DIR/$BUNDLE" ]] || die "carry $DIR/$BUNDLE and $DIR/$MANIFEST (run prepare here)"
    sha="$(sha_of "$DIR/$BUNDLE")"
    expected="$(expected_sha "$DIR/$MANIFEST" "$BUNDLE")"
    [[ "$sha" == "$expected" ]] \
        || die "$DIR/$BUNDLE does not match $DIR/$MANIFEST (corrupted in transfer?): carry it again"
    t0="$(now)"

    tar -xf "$DIR/$BUNDLE" -C "$WORK/bundle"
    local mode
    mode="$(cat "$WORK/bundle/mode.txt")"
    if [[ "$mode" == tiny && "$TINY" != "1" ]]; then
        die "the bundle is a tiny rehearsal's (prepared with GPU_TRAIN_TINY=1): prepare it again without"
    fi
    [[ "$mode" == full && "$TINY" == "1" ]] && echo "tiny run on a full bundle"
    t1="$(now)"

    # Wheels: only those whose module the machine lacks, into a private folder (no network: --no-index).
    local -a missing=()
    local wheel module
    for wheel in "$WORK"/bundle/wheels/*.whl; do
        [[ -e "$wheel" ]] || continue
        module="$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')"
        if env -u PYTHONPATH "$python" -c "import $module" 2>/dev/null; then
            echo "have $module" \
                "$(env -u PYTHONPATH "$python" -c "import $module; print(getattr($module, '__version__', '?'))")"
        else
            missing+=("$wheel")
        fi
    done
    mkdir -p "$SITE"
    if (( ${#missing[@]} )); then
        echo "installing into $SITE: $(for wheel in "${missing[@]}"; do basename "$wheel"; done | tr '\n' ' ')"
        if env -u PYTHONPATH "$python" -m pip --version >/dev/null 2>&1; then
            env -u PYTHONPATH "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade \
                --target "$SITE" "${missing[@]}"
        else  # no pip: a wheel is a zip of its site-packages entries
            "$python" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
                "$SITE" "${missing[@]}"
        fi
    fi
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    t2="$(now)"

    # The corpus: decompressed, train.txt rebuilt when only its parts travelled, each file checked, then put in
    # DATA, where a file already there must be the same (a checkout's own corpus is never overwritten).
    local restored="$WORK/restored"
    mkdir -p "$restored" "$DATA"
    for name in "$WORK"/bundle/corpus/*.xz; do
        "$python" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
            "$name" "$restored/$(basename "$name" .xz)"
    done
    if [[ -n "$(expected_sha "$DIR/$MANIFEST" corpus/train.txt)" && ! -e "$WORK/bundle/corpus/train.txt.xz" ]]; then
        cat "$restored/train.en.txt" "$restored/train.zh.txt" >"$restored/train.txt"
    fi
    while read -r expected name; do
        [[ "$name" == corpus/* ]] || continue
        name="${name#corpus/}"
        [[ "$(sha_of "$restored/$name")" == "$expected" ]] || die "$name does not match $MANIFEST after unpacking"
        if [[ -e "$DATA/$name" ]]; then
            [[ "$(sha_of "$DATA/$name")" == "$expected" ]] \
                || die "$DATA/$name exists with other content: set GPU_TRAIN_DATA to another folder"
        else
            mv "$restored/$name" "$DATA/$name"
        fi
    done <"$DIR/$MANIFEST"
    echo "corpus restored in $DATA: $(awk '$2 ~ /^corpus\// { sub("corpus/", "", $2); print $2 }' "$DIR/$MANIFEST" \
        | tr '\n' ' ')"
    t3="$(now)"

    # The effective config: data paths into DATA; configs/tiny.json's shape for a rehearsal.
    "$python" - "$CONFIG" "$WORK/config.json" "$DATA" "$TINY" <<'EOF'
import json, sys
config, out, data, tiny = sys.argv[1:5]
cfg = json.load(open(config))
relocate = lambda p: data.rstrip("/") + "/" + p[len("data/corpus/"):] if p.startswith("data/corpus/") else p
train = cfg["data"]["train"]
cfg["data"]["train"] = [relocate(p) for p in train] if isinstance(train, list) else relocate(train)
cfg["data"]["valid"], cfg["data"]["vocab"] = relocate(cfg["data"]["valid"]), relocate(cfg["data"]["vocab"])
if tiny == "1":  # configs/tiny.json's model, a few steps on one thread; a test corpus may lack Chinese
    cfg["model"] = json.load(open("configs/tiny.json"))["model"]
    train = cfg["data"]["train"] if isinstance(cfg["data"]["train"], list) else [cfg["data"]["train"]]
    cfg["data"]["train"] = [p for p in train if open(p, "rb").read(1)]
    cfg["data"].update(max_sentence_tokens=30, valid_tokens=2000)
    cfg["train"].update(tokens_per_batch=600, n_negatives=256, max_steps=6, max_time_s=120, warmup_steps=2,
                        log_every=2, valid_every=3, checkpoint_every=3, threads=1, calibrate_bias_tokens=2000)
json.dump(cfg, open(out, "w"), indent=2)
EOF
    model_parts "$python" "$WORK/config.json" "$DATA/vocab.txt"
    t4="$(now)"

    # Training, guarded: interrupted (SIGINT) in time for the packing; the last checkpoint then comes back.
    local deadline="${GPU_TRAIN_DEADLINE_S:-540}" reserve="${GPU_TRAIN_RESERVE_S:-20}" left train_rc=0
    left="$(awk -v d="$deadline" -v r="$reserve" -v s="$started" -v n="$t4" 'BEGIN { printf "%d", d - r - (n - s) }')"
    (( left > 0 )) || die "no time left to train (GPU_TRAIN_DEADLINE_S=$deadline)"
    touch "$WORK/train-started"
    echo "elmo train --config $CONFIG (as $WORK/config.json) --out $RUN, at most $left s"
    timeout -s INT -k 15 "$left" "$python" -c 'import sys; from elmo.cli import main; sys.exit(main(sys.argv[1:]))' \
        train --config "$WORK/config.json" --out "$RUN" || train_rc=$?
    [[ -f "$RUN/train_state.json" && "$RUN/train_state.json" -nt "$WORK/train-started" ]] \
        || die "training (exit $train_rc) left no checkpoint in $RUN"
    (( train_rc == 0 )) || echo "gpu-train: training exited $train_rc: packing the last checkpoint"
    t5="$(now)"

    "$python" - "$RUN" "$OUT" "$WORK" "$PART_MIB" "$train_rc" "$CONFIG" "$started" "$t0" "$t1" "$t2" "$t3" "$t4" "$t5" \
        <<'EOF'
import hashlib, json, shutil, sys, tempfile, time
from pathlib import Path
from elmo.model.checkpoint import load_model, load_vocab, save_model
run, out, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
part_bytes, train_rc, config = int(sys.argv[4]) * 1048576, int(sys.argv[5]), sys.argv[6]
started, *marks = (float(v) for v in sys.argv[7:])
with tempfile.TemporaryDirectory(dir=work) as tmp:
    save_model(load_model(run), tmp, load_vocab(run), fp16=True)
    weights = (Path(tmp) / "model.safetensors").read_bytes()
    for name in ("config.json", "vocab.txt"):
        shutil.copy(Path(tmp) / name, out / name)
shutil.copy(run / "train_state.json", out / "train_state.json")
parts = []
for index, offset in enumerate(range(0, len(weights), part_bytes)):
    chunk = weights[offset : offset + part_bytes]
    name = f"model.safetensors.part-{index:02d}"
    (out / name).write_bytes(chunk)
    parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
state = json.loads((run / "train_state.json").read_text())
valid = [h for h in state["history"] if "valid_avg_ppl" in h]
rates = [h["tokens_per_s"] for h in state["history"] if "tokens_per_s" in h]
names = ("device_and_bundle_check_s", "unpack_s", "install_wheels_s", "restore_corpus_s", "config_s", "train_s")
bounds = [started, *marks]
report = {
    "config": config,
    "train_exit_code": train_rc,
    "interrupted": train_rc != 0,
    **json.loads((work / "device.json").read_text()),
    "step": state["step"],
    "tokens": state["tokens"],
    "train_elapsed_s": round(state["elapsed_s"], 1),
    "tokens_per_s": round(state["tokens"] / max(state["elapsed_s"], 1e-9), 1),
    "tokens_per_s_median_window": sorted(rates)[len(rates) // 2] if rates else None,  # training steps only
    "final_valid": valid[-1] if valid else None,
    "final_senses": next(({k: v for k, v in h.items() if k.startswith("sense_")}
                          for h in reversed(valid) if "sense_en_best" in h), None),
    "bias_calibrated": state.get("bias_calibrated"),
    "timings_s": {**{n: round(b - a, 1) for n, a, b in zip(names, bounds, bounds[1:])},
                  "pack_s": round(time.time() - bounds[-1], 1), "total_s": round(time.time() - started, 1)},
    "model_safetensors": {"dtype": "float16", "bytes": len(weights), "sha256": hashlib.sha256(weights).hexdigest()},
    "parts": parts,
}
(out / "gpu-train.json").write_text(json.dumps(report, indent=2) + "\n")
print("gpu-train:", json.dumps({k: report[k] for k in ("device", "step", "tokens", "tokens_per_s", "timings_s")}))
EOF
    local count=0 file  # train.log (being written) included
    for file in "$OUT"/*; do
        count=$(( count + 1 ))
        (( $(stat -c %s "$file") <= 16 * 1048576 )) || echo "gpu-train: $file is over 16 MiB: it will not come back"
    done
    (( count <= MAX_FILES )) || echo "gpu-train: $count files in $OUT: over the $MAX_FILES that come back"
    echo "in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    return "$train_rc"
}

# The steps run in a process of their own (set -e holds there), everything they print tee'd into $OUT/train.log.
train() {
    [[ -n "${OUT:-}" ]] || die "OUT is not set (the device call sets it: the folder whose files come back)"
    mkdir -p "$OUT"
    local rc=0
    bash "$SELF" _train_steps 2>&1 | tee "$OUT/train.log" || rc=$?
    exit "$rc"
}

# -- receive (here) ------------------------------------------------------------------------------------------------
receive() {
    local files="${1:-}" model="${2:-}" python
    [[ -n "$files" && -n "$model" ]] || die "usage: $0 receive FILES_DIR MODEL_DIR" 2
    [[ -f "$files/gpu-train.json" ]] || die "no $files/gpu-train.json: not the files of a gpu-train run"
    if [[ -e "$model" ]] && [[ -n "$(ls -A "$model")" ]]; then
        die "$model exists and is not empty: receive into a new folder (a shipped model is replaced by hand)"
    fi
    python="$(local_python)"
    "$python" - "$files" "$model" <<'EOF'
import hashlib, json, os, shutil, sys, tempfile
from pathlib import Path
files, model = Path(sys.argv[1]), Path(sys.argv[2])
report = json.loads((files / "gpu-train.json").read_text())
weights = bytearray()
for part in report["parts"]:
    path = files / part["name"]
    if not path.is_file():
        sys.exit(f"gpu-train: {path} is missing: the run's files did not all come back")
    data = path.read_bytes()
    if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
        sys.exit(f"gpu-train: {path} does not match its sha256 in gpu-train.json (damaged in transfer?): "
                 "fetch the files again")
    weights += data
expected = report["model_safetensors"]["sha256"]
if hashlib.sha256(weights).hexdigest() != expected:
    sys.exit(f"gpu-train: the reassembled model.safetensors does not match sha256 {expected} in gpu-train.json")
for name in ("config.json", "vocab.txt", "train_state.json"):
    if not (files / name).is_file():
        sys.exit(f"gpu-train: {files / name} is missing: the run's files did not all come back")
model.parent.mkdir(parents=True, exist_ok=True)
staging = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=model.parent))
try:
    (staging / "model.safetensors").write_bytes(weights)
    for name in ("config.json", "vocab.txt", "train_state.json", "gpu-train.json"):
        shutil.copy(files / name, staging / name)
    from elmo.errors import ElmoError
    from elmo.model.checkpoint import load_model_and_vocab
    from elmo.train.loop import plot_curve

    try:
        bilm, vocab = load_model_and_vocab(staging)
    except ElmoError as exc:
        sys.exit(f"gpu-train: the received model does not load: {exc}")
    plot_curve(json.loads((staging / "train_state.json").read_text())["history"], staging / "curve.png")
    if model.exists():
        model.rmdir()
    os.replace(staging, model)
finally:
    shutil.rmtree(staging, ignore_errors=True)
final = report.get("final_valid") or {}
print(f"gpu-train: {model}: {bilm.num_parameters(True) / 1e6:.1f} M parameters, vocab {len(vocab)}, "
      f"{report['step']} steps on {report['device']}, {report['tokens_per_s']:.0f} tokens/s, "
      f"valid avg ppl {final.get('valid_avg_ppl')}")
EOF
    echo "next: elmo export --model $model; elmo eval-lm --model $model ...; compare with models/default" \
        "(held-out perplexity vs KN-3, elmo mix report) before it replaces anything"
}

case "${1:-}" in
    prepare) prepare ;;
    train) train ;;
    _train_steps) train_steps ;;
    receive) shift; receive "$@" ;;
    *) die "usage: $0 prepare | train | receive FILES_DIR MODEL_DIR" 2 ;;
esac
