#!/usr/bin/env bash
# A real MLflow tracking server for the tracker test (tests/test_trackers.py starts `mlflow server` from it): the
# full mlflow package in a venv of its own, .venv-mlflow, since in the dev venv it would pin back mlflow-skinny,
# pyarrow and cryptography (pyproject.toml, [trackers]). The client the trainer logs with stays the dev venv's
# mlflow-skinny. ~2 min and ~0.9 GB the first time; nothing when the venv is there. Without it the test logs to
# MLflow's file store instead (and says so).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-mlflow
if [ -x "$venv/bin/mlflow" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q "mlflow>=3,<4"
"$venv/bin/mlflow" --version
