#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU (MLX's CUDA backend) or a Mac (Metal).
# Installs MLX's GPU backend and this project, runs the exactness tests on the GPU, then
# bench/gpu_check.py (step costs, roofline, projection, end-to-end runs checked identical).
#
#   bash bench/gpu_check.sh [gpu_check.py options]      # e.g. --model DIR --draft-model DIR
#
# WHEELS=DIR   install from the wheels in DIR (mlx, mlx-cuda-13, mlx-lm), no network
# TESTS=0      skip the tests; TEST_TIMEOUT=S caps them (default 240 s)
# OUT=DIR      where the report goes (tests.log, gpu_check.md, gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site
elif [ "$(uname)" = Darwin ]; then
  $PY -m pip install -q mlx mlx-lm
else
  $PY -m pip install -q 'mlx[cuda]' mlx-lm
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
$PY -c "import mlx.core as mx; print('MLX', mx.__version__, 'on', mx.default_device())"
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
if [ "${TESTS:-1}" != 0 ]; then
  # exactness on the GPU: every mode against plain decoding, twelve families (sliding windows,
  # recurrent layers, half precision), QuantSpec, trees, acceptance rules
  timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider --maxfail=20 \
    tests/test_families.py tests/test_quantspec.py tests/test_engine.py tests/test_verify.py \
    tests/test_tree.py 2>&1 | tee "$out/tests.log" | tail -25 || echo "tests: stopped (timeout or failures)"
fi
$PY bench/gpu_check.py --json "$out/gpu_check.json" "$@" | tee "$out/gpu_check.md"
