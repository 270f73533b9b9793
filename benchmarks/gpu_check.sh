#!/usr/bin/env bash
# The one device check per GPU lease (about 8 minutes on an H200): see gpu_check.py for what it runs.
#
# Here, first (the GPU image has torch, transformers, peft and accelerate, not the rest):
#   echo /.whl/ >> .git/info/exclude && bash benchmarks/gpu_check.sh --wheels
# Then with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--wheels" ]; then
    # Pure-Python wheels (bitsandbytes' is too large to carry within the 64 MiB limit).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
        optuna optuna-dashboard sqlalchemy alembic mako colorlog tensorboardX cmaes psycopg2-binary \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any
    du -sh .whl
    exit 0
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 benchmarks/gpu_check.py 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
