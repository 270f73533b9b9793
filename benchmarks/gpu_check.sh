#!/usr/bin/env bash
# The one device check per GPU lease (about 8 minutes on an H200): see gpu_check.py for what it runs.
#
# Here, first (the GPU image has torch, transformers, peft, accelerate, scipy and protobuf, not the rest):
#   bash benchmarks/gpu_check.sh --wheels          (.whl/ is in .gitignore)
# Then with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Arguments after the script's name go to gpu_check.py (e.g. --only lora --part-seconds lora=300).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--wheels" ]; then
    rm -rf .whl
    # What hpsearch needs beyond the image, pure Python or manylinux, for the image's Python 3.12;
    # optuna-dashboard and bottle too: `start` refreshes the study note through optuna-dashboard.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any \
        optuna optuna-dashboard bottle sqlalchemy alembic mako colorlog tensorboardX cmaes psycopg2-binary || exit 1
    # bitsandbytes (the 4-bit part), about 43 MB: the wheels and the working tree travel within 64 MiB.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
        --platform manylinux_2_24_x86_64 "bitsandbytes>=0.45" || echo "no bitsandbytes wheel: the 4-bit part will say it is skipped"
    du -sh .whl
    total=$(( $(du -sb .whl | cut -f1) + $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) ))
    echo "wheels + working tree: $(( total / 1048576 )) MiB of 64"
    [ "$total" -lt $(( 64 * 1048576 )) ] || { echo "over the 64 MiB a call carries: drop bitsandbytes"; exit 1; }
    exit 0
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 benchmarks/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
# Sharded trials (issue 40), about a minute: the fsdp path on one rank over NCCL, its plan against the measured peak,
# and the memory plan of a Llama-3-8B full fine-tune against this GPU. HPSEARCH_SKIP_FSDP=1 leaves it out.
if [ "${HPSEARCH_SKIP_FSDP:-0}" != "1" ]; then
    python3 benchmarks/gpu_fsdp.py 2>&1 | tee "${OUT:-/tmp}/gpu_fsdp.log"
fi
