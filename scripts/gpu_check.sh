#!/usr/bin/env bash
# The GPU check of one lease (scripts/gpu_check.py says what it runs), from the repository root:
#   bash scripts/gpu_check.sh [--dry-run] [--steps a,b,...]
# On the device machine: make the wheels it lacks here first (bash ../shared/gpu/make_wheels.sh -> .whl/),
# then one `run` call with carry [".whl"] and command `bash scripts/gpu_check.sh`; the record comes back in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  # the image has torch, lightning, timm...; the rest comes as wheels (no network there)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl \
    && export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "gpu_check: installing the carried wheels failed; going on with what is installed"
fi
export OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
exec "$PY" scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
