#!/usr/bin/env bash
# The oldest torch scaletrain declares (pyproject.toml: "torch>=X"), installed from the registry in a venv of its
# own, runs the default job and the DDP/FSDP/HSDP loss-parity test (or the test files given as arguments; .ci/run
# gives those two and leaves them out of its own run): a declared minimum is one that was run.
# GPU images ship older torches than CI's pin (the first H200 image had 2.11, whose torchrun agent lacked a field
# the launcher passed). Called by .ci/run after the main suite; ~3 min of install (a CUDA build of torch from PyPI,
# run on the CPU) and ~4 min of tests on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
min=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
if [ -z "$min" ]; then
  echo "min_torch: no \"torch>=X\" line in pyproject.toml" >&2
  exit 1
fi
venv=.venv-min-torch
python3 -m venv "$venv"
"$venv/bin/pip" install -q -e . pytest pytest-xdist "torch==$min.*"
"$venv/bin/python" -c "import torch; print('min_torch: torch', torch.__version__)"
if [ "$#" -eq 0 ]; then
  set -- tests/test_default_job.py tests/test_parity.py -m "not slow"
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
