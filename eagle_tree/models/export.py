"""Write a draft head to a folder in a serving engine's layout: validated first, written atomically.

The layouts themselves (config and key names, validation) are :mod:`eagle_tree.models.layouts`;
``docs/INTEROP.md`` says which engine versions read them.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.head_config import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    Eagle3Config,
    check_head_matches_target,
    text_config,
)
from eagle_tree.models.layouts import layout_config, layout_state, validate_layout
from eagle_tree.utils.atomic import atomic_dir

__all__ = ["export_head"]


def export_head(
    head: Eagle3DraftModel | tuple[Eagle3Config, dict],
    out: str | Path,
    layout: str,
    *,
    target_config=None,
    verifier: str | None = None,
    speculative_tokens: int = 3,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a head (a model, or the (config, EAGLE-3-keyed state dict) of :func:`read_head`) to the
    folder ``out`` in ``layout``, validated first, atomically (a temporary folder beside ``out``, then a
    rename; an existing ``out`` is replaced only on success).

    target_config: the target's (Hugging Face) config: the head is checked against it and, for vLLM,
    its ``architectures`` name the verifier. verifier: the vLLM verifier's name or path.
    """
    cfg, weights = (head.config, head.state_dict()) if isinstance(head, Eagle3DraftModel) else head
    num_layers = None
    if target_config is not None:
        check_head_matches_target(cfg, text_config(target_config))
        num_layers = text_config(target_config).num_hidden_layers
    state = layout_state(weights, layout, dtype)
    dtype_name = str(state["fc.weight"].dtype).removeprefix("torch.")
    config = layout_config(cfg, layout, num_layers=num_layers, verifier=verifier,
                           verifier_architectures=getattr(target_config, "architectures", None),
                           speculative_tokens=speculative_tokens, dtype=dtype_name)
    back = validate_layout(layout, config, state, target_config)
    if asdict(back) != asdict(cfg):
        changed = [k for k, v in asdict(cfg).items() if asdict(back)[k] != v]
        raise ValueError(f"the {layout} config does not read back as the head's own config: {changed} differ")
    return _write_atomically(Path(out), config, state)


def _write_atomically(out: Path, config: dict, state: dict) -> Path:
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out
