#!/usr/bin/env bash
# Run on the lent GPU machine (the device tool), from the repository root:
#   bash eval/device_run.sh COMMAND [ARGS...]     e.g. bash eval/device_run.sh python3 eval/bench_kernels.py
# Installs carried wheels (.whl/: sageattention, diffusers, ...) and this package (a real wheel
# install, not the source tree) without touching the network, prints the GPU, runs the command
# with its output teed to $OUT/run.log.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
"$@" 2>&1 | tee "$OUT/run.log"
