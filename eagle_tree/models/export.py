"""Write a draft head to a folder in a serving engine's layout: validated first, written atomically.

The layouts themselves (config and key names, validation) are :mod:`eagle_tree.models.layouts`;
``docs/INTEROP.md`` says which engine versions read them.
"""

from __future__ import annotations

import json
import re
import warnings
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
from eagle_tree.models.layouts import detect_layout, engine_default_layers, layout_config, layout_state, validate_layout
from eagle_tree.utils.atomic import atomic_dir

__all__ = ["export_head", "log_head_artifact", "older_engine_warnings"]


def older_engine_warnings(cfg: Eagle3Config, layout: str, num_layers: int | None = None) -> list[str]:
    """What an older engine release would ignore in this export (docs/INTEROP.md, version floors).

    vLLM 0.11.0 captures the layers (2, L // 2, L - 3) whatever the config names, and uses the
    target's lm_head in place of the draft's when the draft vocabulary is the whole target vocabulary;
    both are read correctly from vLLM 0.11.1. The 0.11.x releases have no feature norms before fc."""
    if layout != "vllm":
        return []
    out = []
    n = cfg.target_num_layers if num_layers is None else num_layers
    if n is None or n < 0 or tuple(cfg.feature_layers) != engine_default_layers(n):
        out.append(f"vLLM 0.11.0 ignores eagle_aux_hidden_state_layer_ids and captures the layers (2, L//2, L-3); "
                   f"this head reads {list(cfg.feature_layers)}: serve it with vLLM >= 0.11.1")
    if cfg.norm_before_fc or cfg.fc_norm:
        out.append("vLLM 0.11.x has no input_norm / fc_norm in its EAGLE-3 draft model and cannot load this head "
                   "(norm_before_fc / fc_norm, the speculators >= 0.5 / 0.7 variants): serve it with a vLLM release "
                   "that reads them")
    if cfg.draft_vocab_size == cfg.vocab_size:
        out.append("vLLM 0.11.0 replaces the lm_head of a head whose draft vocabulary is the whole target "
                   "vocabulary by the target's lm_head: serve it with vLLM >= 0.11.1")
    return out


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
    for message in older_engine_warnings(cfg, layout, num_layers):
        warnings.warn(message, UserWarning, stacklevel=2)
    return _write_atomically(Path(out), config, state)


def _write_atomically(out: Path, config: dict, state: dict) -> Path:
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def log_head_artifact(logger, head_dir: str | Path, name: str, config, acceptance_length: float | None) -> dict:
    """Log a saved head folder as a W&B ``model`` artifact (a no-op when the logger is disabled;
    offline runs keep it until ``wandb sync``). Metadata: ``config`` (the resolved run config),
    ``acceptance_length`` (the latest measured one, or None), ``layout`` and ``head_config`` (the
    head's config.json). Returns the metadata."""
    from eagle_tree.utils.config import config_to_dict

    head_dir = Path(head_dir)
    cfg_file = head_dir / CONFIG_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(f"log_head_artifact: {head_dir} holds no {CONFIG_NAME}; is it a saved head?")
    head_config = json.loads(cfg_file.read_text())
    metadata = {
        "config": config_to_dict(config) if config is not None else {},
        "acceptance_length": None if acceptance_length is None else float(acceptance_length),
        "layout": detect_layout(head_config),
        "head_config": head_config,
    }
    artifact_name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "draft-head"  # W&B's name rule
    logger.log_artifact(head_dir, artifact_name, "model", metadata)
    return metadata
