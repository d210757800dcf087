"""Recipe: benchmark eagle-tree against the Hugging Face baselines (the logic is eagle_tree.commands.bench).

    python decode/bench.py                                   # configs/bench-reference.yaml
    python decode/bench.py --config configs/bench-smoke.yaml # tiny models, about a minute
    python decode/bench.py repeats=5 sampling.temperature=0.7

Same as ``eagle-tree bench``, with the reference config as the default.
"""

import sys

from eagle_tree.commands.bench import main

DEFAULT_CONFIG = "configs/bench-reference.yaml"

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", DEFAULT_CONFIG, *argv]
    sys.exit(main(argv))
