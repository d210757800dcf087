#!/usr/bin/env bash
# The prepared device check (docs/MEASURING.md, "The device check"): exactness on the device, the
# round split of three targets, a head training step; writes DIR/gpu_check.json and DIR/gpu_check.md
# and prints a summary. Exit status 0 when every section passed.
#
#   bash scripts/gpu_check.sh [--out DIR] [--device cpu|cuda] [--small] [--budget-s S] [--only SECTION...]
#   bash scripts/gpu_check.sh --fetch-wheels   # before lending the tree to a machine without a registry
#
# On a machine whose image lacks what the package needs (no network there), it installs the wheels in
# .gpu-wheels/ (fetched beforehand with --fetch-wheels, an ignored folder that travels with the tree)
# without dependencies: transformers >= 5.24 (the forward's `cache` argument; 5.17 calls it
# `past_key_values`), and huggingface_hub when the image's is older than that transformers needs.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
TRANSFORMERS=5.24.0
HUB=1.33.0
PY=${PYTHON:-$(command -v python || command -v python3)}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  "$PY" -m pip download --no-deps -d "$WHEELS" "transformers==$TRANSFORMERS" "huggingface_hub==$HUB"
  ls -l "$WHEELS"
  exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the working tree, whether or not the install below works
export TOKENIZERS_PARALLELISM=false

needs_transformers() {
  "$PY" - <<'EOF'
import inspect, sys
try:
    from transformers import LlamaForCausalLM
except Exception:
    sys.exit(0)
sys.exit(0 if "cache" not in inspect.signature(LlamaForCausalLM.forward).parameters else 1)
EOF
}
needs_hub() {
  "$PY" - <<'EOF'
import sys
try:
    import huggingface_hub
    from packaging.version import Version
except Exception:
    sys.exit(0)
sys.exit(0 if Version(huggingface_hub.__version__) < Version("1.31") else 1)
EOF
}

if needs_transformers; then
  wheel=$(ls "$WHEELS"/transformers-*.whl 2>/dev/null | tail -1 || true)
  if [[ -z "$wheel" ]]; then
    echo "gpu_check: this transformers has no 'cache' forward argument (the package needs >= $TRANSFORMERS) and" \
         "$WHEELS/ holds no transformers wheel: run 'bash scripts/gpu_check.sh --fetch-wheels' where a registry" \
         "is reachable and let $WHEELS/ travel with the tree" >&2
    exit 2
  fi
  if needs_hub; then
    "$PY" -m pip install -q --no-deps --no-index "$WHEELS"/huggingface_hub-*.whl
  fi
  "$PY" -m pip install -q --no-deps --no-index "$wheel"
  echo "gpu_check: installed $(basename "$wheel") without dependencies"
fi

if ! "$PY" -c "import importlib.metadata as m; m.version('eagle-tree')" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "gpu_check: 'pip install --no-deps -e .' failed here (no setuptools?); running from the working tree"
fi

exec "$PY" -m eagle_tree.commands.gpu_check "$@"
