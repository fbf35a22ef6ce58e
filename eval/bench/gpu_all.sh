#!/usr/bin/env bash
# Everything wanted from a GPU machine, in order, each part under its own timeout (docs/gpu_dispatch.md,
# "Everything on a GPU in one run"):
#   checks: the compiled kernels against their references (the verified-kernel table's evidence)
#           and the decode and routing kernels' speed: gpu_suite --sections correctness,routing,
#           latent_decode,moba_decode,dsa
#   speed:  gpu_suite --sections attention,long_attention,tiles,train_py
# Each part's gpu_suite.json (rewritten after every case, so a part cut off by its timeout keeps
# what it measured) and log land in $OUT as checks.json, checks.log, speed.json, speed.log, with
# nvidia-smi's report and summary.txt (each part's exit status): six files.
#
#   make gpu-carry                              # here: wheels, corpus and tokenizer into .gpu-carry/
#   bash eval/bench/gpu_all.sh                  # there, carrying .gpu-carry (the device tool's run)
#   bash eval/bench/gpu_all.sh --dry            # here: the same on a CPU, tiny shapes, interpreted
#
# CHECKS_S and SPEED_S (seconds; 240 and 330 by default) bound the parts; each suite's budget is
# 40 s less, so it writes its JSON before its timeout.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu_all}
DRY=()
PY=python3
if [ "${1:-}" = "--dry" ]; then
    DRY=(--dry)
    PY=${PY_DRY:-.venv/bin/python}
    export JAX_PLATFORMS=cpu
elif [ -d .gpu-carry/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu-carry/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
[ -d .gpu-carry/cache ] && export EFFATTN_CACHE=$PWD/.gpu-carry/cache
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
(nvidia-smi || echo "no nvidia-smi") >"$OUT/nvidia-smi.txt" 2>&1

part() {  # part NAME SECONDS SECTIONS
    local name=$1 limit=$2 sections=$3
    timeout "$limit" "$PY" -m eval.bench.gpu_suite --out "$WORK/$name" --sections "$sections" \
        --budget-s $((limit - 40)) "${DRY[@]}" >"$OUT/$name.log" 2>&1
    local status=$?
    cp "$WORK/$name/gpu_suite.json" "$OUT/$name.json" 2>/dev/null
    echo "$name: exit $status (limit ${limit} s)" | tee -a "$OUT/summary.txt"
}

part checks "${CHECKS_S:-240}" correctness,routing,latent_decode,moba_decode,dsa
part speed "${SPEED_S:-330}" attention,long_attention,tiles,train_py
