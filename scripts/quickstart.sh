#!/usr/bin/env bash
# Set up a virtual environment and run the main job: train an EAGLE-3 head on the shipped
# reference target for a few minutes, then compare plain, chain and tree decoding (results/quickstart/).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0          # the local CPU build first; a bare torch pulls a CUDA build
pip install -q -e .
eagle-tree quickstart "$@"
