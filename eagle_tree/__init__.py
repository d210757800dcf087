"""eagle-tree: EAGLE-3-style speculative decoding with dynamic draft trees and exact verification.

The pure-tensor core (sampling, tree, verify) is imported eagerly; everything that needs
transformers, datasets, accelerate or wandb is imported on first attribute access, so
``import eagle_tree`` stays light.
"""

from __future__ import annotations

import importlib

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import VerifyResult, verify_tree

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily)
_LAZY = {
    "TargetModel": "models.target",
    "Eagle3DraftModel": "models.head",
    "Eagle3Config": "models.head_config",
    "TreeConfig": "decoding.drafting",
    "ContextConfig": "decoding.context",
    "SpeculativeDecoder": "decoding.decoder",
    "GenerateOutput": "decoding.decoder",
    "RoundStats": "decoding.rounds",
    "Request": "decoding.rounds",
    "RequestResult": "decoding.rounds",
    "BatchOutput": "decoding.rounds",
}

__all__ = [
    "SamplingConfig",
    "processed_probs",
    "Tree",
    "VerifyResult",
    "verify_tree",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'eagle_tree' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
