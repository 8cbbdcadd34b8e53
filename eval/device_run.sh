#!/usr/bin/env bash
# Run on the lent GPU machine (the device tool), from the repository root:
#   bash eval/device_run.sh [bench_kernels.py args...]
# Installs carried wheels (.whl/, e.g. sageattention, diffusers) and this package without
# touching the network, prints the machine, runs the kernel benchmark, and copies logs to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
cd /tmp && python3 "$OLDPWD/eval/bench_kernels.py" "$@" --out "$OUT/kernels.md" 2>&1 | tee "$OUT/bench.log"
