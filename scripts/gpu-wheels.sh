#!/usr/bin/env bash
# Carry onnxruntime-gpu (and the gRPC wheels the served check needs) to the borrowed GPU machine: it has no network,
# Python 3.12 with torch (CUDA 13, whose nvidia-* wheels bring the CUDA/cuDNN libraries) and the CPU `onnxruntime`,
# and each device call carries at most 64 MiB, the working tree included. The ~245 MiB onnxruntime-gpu wheel goes
# in parts, one per call, kept between calls in /tmp on that machine (it stays warm 30 s after a call).
#
#   scripts/gpu-wheels.sh prepare [WHEEL_DIR]   here: download the wheels (or take WHEEL_DIR/*.whl), bundle them
#                                               into one tar, split it into .gpu-parts/wheels.tar.part-NNN and write
#                                               .gpu-parts/manifest.sha256 (bundle and parts); prints the calls
#   scripts/gpu-wheels.sh receive               there: check the carried part(s) against the manifest, keep them in
#                                               /tmp/elmo-gpu-parts; once all are in, reassemble, check the bundle's
#                                               sha256 and install it into the private folder /tmp/elmo-gpu-site
#                                               (pip --no-index --no-deps --target), linking torch's nvidia libraries
#                                               in beside onnxruntime, where onnxruntime.preload_dlls looks for them.
#                                               Exit 0: installed; 3: parts still missing; 1: a part or the bundle is
#                                               corrupt (carry it again).
#
# The device calls, back to back (an idle machine is given back after 30 s, and /tmp with it: then start again),
# one per part, the same command each time; the last one also runs the check (scripts/gpu-check.sh, GPU_SITE):
#   run(command="scripts/gpu-wheels.sh receive && GPU_SITE=/tmp/elmo-gpu-site scripts/gpu-check.sh",
#       carry=[".gpu-parts/manifest.sha256", ".gpu-parts/wheels.tar.part-000"], timeout_s=...)
#   ... the same with part-001, part-002, ... (rc 3 until the last part is in)
#
# Environment: GPU_PARTS (.gpu-parts): where prepare writes and receive finds what was carried; GPU_PARTS_STORE
# (/tmp/elmo-gpu-parts); GPU_SITE (/tmp/elmo-gpu-site); PART_MIB (default: 64 MiB less what the working tree sends,
# less 4 MiB of slack); PYTHON (python3); GPU_PYTHON_VERSION (3.12): the interpreter the wheels are downloaded for.
set -euo pipefail
cd "$(dirname "$0")/.."

PARTS="${GPU_PARTS:-.gpu-parts}"
STORE="${GPU_PARTS_STORE:-/tmp/elmo-gpu-parts}"
SITE="${GPU_SITE:-/tmp/elmo-gpu-site}"
PYTHON="${PYTHON:-python3}"
BUNDLE=wheels.tar
MANIFEST=manifest.sha256
CALL_LIMIT_MIB=64

die() { echo "gpu-wheels: $*" >&2; exit "${2:-1}"; }

# The requirements to carry: onnxruntime-gpu at the `gpu` extra's pin (its nvidia-* dependencies are torch's on that
# machine), and the gRPC/protobuf pins of the `serve` extra, which the machine may hold in other versions.
carried_requirements() {
    "$PYTHON" - <<'EOF'
import re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
wanted = {"onnxruntime-gpu", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf"}
for requirement in extras["gpu"] + extras["serve"]:
    plain = re.sub(r"\[[^\]]*\]", "", requirement.split("#")[0]).strip()  # --no-deps: extras bring nothing
    if re.split(r"[<>=!~ ;]", plain, maxsplit=1)[0].lower() in wanted:
        print(plain)
EOF
}

download() {
    local into="$1" version="${GPU_PYTHON_VERSION:-3.12}"
    local -a requirements
    mapfile -t requirements < <(carried_requirements | sort -u)
    echo "downloading for CPython $version: ${requirements[*]}"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --abi "cp${version/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$into" "${requirements[@]}"
}

# MiB a device call spends on the working tree (tracked and untracked-not-ignored files): the parts get the rest.
tree_mib() {
    git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
        | awk '{ total += $1 } END { print int(total / 1048576) + 1 }'
}

prepare() {
    local wheels="${1:-}"
    if [[ -z "$wheels" ]]; then
        wheels="$PARTS/wheels"
        mkdir -p "$wheels"
        download "$wheels"
    fi
    compgen -G "$wheels/*.whl" >/dev/null || die "no *.whl in $wheels"
    local part_mib="${PART_MIB:-$(( CALL_LIMIT_MIB - $(tree_mib) - 4 ))}"
    (( part_mib >= 1 )) || die "no room for a part: the working tree alone fills a call"
    mkdir -p "$PARTS"
    rm -f "$PARTS/$BUNDLE" "$PARTS/$BUNDLE".part-* "$PARTS/$MANIFEST"
    # Sorted names and fixed metadata: the same wheels give the same bundle (and sha256) every time.
    (cd "$wheels" && find . -maxdepth 1 -name '*.whl' -printf '%P\n' | LC_ALL=C sort \
        | tar -cf - --owner=0 --group=0 --numeric-owner --mtime=@0 -T -) >"$PARTS/$BUNDLE"
    split -b "${part_mib}M" -d -a 3 "$PARTS/$BUNDLE" "$PARTS/$BUNDLE.part-"
    (cd "$PARTS" && sha256sum "$BUNDLE" "$BUNDLE".part-* >"$MANIFEST")
    rm "$PARTS/$BUNDLE"
    echo "$(ls "$PARTS"/$BUNDLE.part-* | wc -l) parts of at most $part_mib MiB in $PARTS; one device call each:"
    for part in "$PARTS"/$BUNDLE.part-*; do
        echo "  run(command=\"scripts/gpu-wheels.sh receive && GPU_SITE=$SITE scripts/gpu-check.sh\"," \
            "carry=[\"$PARTS/$MANIFEST\", \"$part\"])"
    done
}

# Expected sha256 of NAME in MANIFEST (empty when not listed).
expected_sha() { awk -v name="$2" '$2 == name { print $1 }' "$1"; }

actual_sha() { sha256sum "$1" | cut -d' ' -f1; }

# Keep the carried parts that match the manifest; a new bundle (another manifest) starts the store afresh.
store_carried_parts() {
    mkdir -p "$STORE"
    if ! cmp -s "$PARTS/$MANIFEST" "$STORE/$MANIFEST"; then
        rm -rf "${STORE:?}"/*
        cp "$PARTS/$MANIFEST" "$STORE/$MANIFEST"
    fi
    local part name
    for part in "$PARTS"/$BUNDLE.part-*; do
        [[ -e "$part" ]] || continue
        name="$(basename "$part")"
        [[ "$(actual_sha "$part")" == "$(expected_sha "$STORE/$MANIFEST" "$name")" ]] \
            || die "$name does not match $MANIFEST (corrupted in transfer?): carry it again"
        cp "$part" "$STORE/$name.tmp" && mv "$STORE/$name.tmp" "$STORE/$name"
    done
}

# The parts the manifest lists that the store lacks, one per line.
missing_parts() {
    awk -v bundle="$BUNDLE" '$2 != bundle { print $2 }' "$STORE/$MANIFEST" | while read -r name; do
        [[ -e "$STORE/$name" ]] || echo "$name"
    done
}

# torch's nvidia-* wheels (CUDA 13, cuDNN 9) as SITE/nvidia: preload_dlls looks in onnxruntime's own site-packages.
link_nvidia_libraries() {
    [[ -d "$SITE/nvidia" && ! -L "$SITE/nvidia" ]] && return 0  # the bundle brought its own
    local found
    found="$(env -u PYTHONPATH "$PYTHON" - <<'EOF'
import sys
from pathlib import Path
for entry in sys.path:
    if any((Path(entry) / "nvidia").glob("*/lib/libcudart.so.*")):
        print(Path(entry) / "nvidia")
        break
EOF
)"
    if [[ -z "$found" ]]; then
        echo "no nvidia/*/lib/libcudart.so.* on $PYTHON's path: the CUDA libraries must come from the system"
        return 0
    fi
    ln -sfn "$found" "$SITE/nvidia"
    echo "CUDA/cuDNN libraries: $SITE/nvidia -> $found"
}

receive() {
    [[ -f "$PARTS/$MANIFEST" ]] || die "no $PARTS/$MANIFEST carried: carry it with every part"
    store_carried_parts
    local missing
    missing="$(missing_parts)"
    if [[ -n "$missing" ]]; then
        echo "kept in $STORE; still missing: $(echo "$missing" | tr '\n' ' ')"
        exit 3
    fi
    local sha
    sha="$(expected_sha "$STORE/$MANIFEST" "$BUNDLE")"
    if [[ "$(cat "$SITE/.bundle-sha256" 2>/dev/null)" == "$sha" ]]; then
        echo "bundle $sha already installed in $SITE"
        return 0
    fi
    cat "$STORE"/$BUNDLE.part-* >"$STORE/$BUNDLE"
    if [[ "$(actual_sha "$STORE/$BUNDLE")" != "$sha" ]]; then
        rm -rf "${STORE:?}"/*
        die "the reassembled bundle does not match its sha256: carry every part again"
    fi
    rm -rf "$STORE/wheels" && mkdir -p "$STORE/wheels"
    tar -xf "$STORE/$BUNDLE" -C "$STORE/wheels"
    rm "$STORE/$BUNDLE"
    env -u PYTHONPATH "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
        "$STORE"/wheels/*.whl
    link_nvidia_libraries
    echo "$sha" >"$SITE/.bundle-sha256"
    echo "installed into $SITE: $(cd "$STORE/wheels" && ls | tr '\n' ' ')"
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    receive) receive ;;
    *) die "usage: $0 prepare [WHEEL_DIR] | receive" 2 ;;
esac
