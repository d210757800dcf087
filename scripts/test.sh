#!/usr/bin/env bash
# Set up a virtual environment and run the test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0          # the local CPU build first; a bare torch pulls a CUDA build
pip install -q -e '.[dev]'
ruff check .
python -m pytest -q
