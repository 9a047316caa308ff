#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (CPU only), as CI does.
#   1. .venv: CPU torch 2.13.0 + flashrl[test]; runs every test not marked vllm (slow ones included).
# Extra arguments go to pytest, e.g. `scripts/test.sh -x -k quant`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test]"
.venv/bin/python -m pytest -m "not vllm and not gpu" "$@"
