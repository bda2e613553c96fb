#!/usr/bin/env bash
# The one documented way to check GPU claims on the lent H200 (preinstalled jax, no venv):
#   bash scripts/gpu_check.sh [bench args...]
# runs every gpu-marked test, then the bench the args name: `python -m benchmarks.NAME REST` where
# the first arg names one of benchmarks/ (host-hit, storage-hit, scoring, restart, serve-overhead,
# kernels, ...: `-` read as `_`), else `python -m jhicache.bench` with the args.
# Results go to $OUT (the device tool's output folder) when it is set, else to ./out.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
JHICACHE_GPU_TESTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -25
if [ "$#" -gt 0 ]; then
  bench=(-m jhicache.bench "$@")
  name="${1//-/_}"
  if [ -e "benchmarks/$name.py" ] || [ -d "benchmarks/$name" ]; then
    bench=(-m "benchmarks.$name" "${@:2}")
  fi
  python3 "${bench[@]}" --out "$out/bench.json" 2> >(grep -v "it/s\]\|round/s\]\|request/s\]" >&2)
fi
