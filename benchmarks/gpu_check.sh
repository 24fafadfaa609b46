#!/usr/bin/env bash
# The GPU check: run whenever a GPU is lent, on one GPU, from the repo root; under 8 minutes on one H200.
#   bash benchmarks/gpu_check.sh [OUT_DIR]          (default: $OUT, else gpu_check_out)
# It reproduces every figure of the first H200 run (issue 34): the default job, llama-1b bf16 eager / compiled /
# fp8 / AC full tokens/s (benchmarks/gpu_check.py), and the planner against measured step time and memory
# (benchmarks/gpu_planner.py); the tables go to OUT_DIR/*.md for BENCHMARKS.md, with the date and torch version.
#
# Wheels: the H200 image (Python 3.12, torch 2.11) lacks pydantic, pydantic-core, annotated-types,
# typing-inspection, tomli-w and torchao. Put cp312 manylinux wheels of them in .whl/ (torchao 0.18.*; see
# /work/.library/device/README.md for the pip download line) and carry .whl: they are installed to /tmp/site here.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/versions.txt"
timeout 60 python3 -m scaletrain.cli.main doctor > "$out/doctor.txt" 2>&1
echo "doctor: exit $? ($(( $(date +%s) - t0 )) s)"
timeout 330 python3 benchmarks/gpu_check.py --out "$out/check" --budget-s 240 2> "$out/check.log"
cp "$out/check/table.md" "$out/check.md" 2> /dev/null
echo "gpu_check.py done ($(( $(date +%s) - t0 )) s)"
timeout 150 python3 benchmarks/gpu_planner.py --out "$out/planner" --runs none:2,full:4,none:1 --steps 12 \
  --budget-s 70 2> "$out/planner.log"
cp "$out/planner/table.md" "$out/planner.md" 2> /dev/null
echo "gpu_planner.py done ($(( $(date +%s) - t0 )) s)"
