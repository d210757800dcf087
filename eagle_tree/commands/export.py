"""``eagle-tree export --to {eagle3,sglang,vllm} CHECKPOINT OUT``: a head in a serving engine's layout.

CHECKPOINT is a head folder in any layout eagle-tree reads (its own ``save_pretrained``, EAGLE-3,
SGLang or vLLM speculators). The export is validated (weights present with the shapes the config
implies, ``d2t`` / ``t2d`` agreeing, the engine's view of the feature layers equal to the head's, and
with ``target`` the head against the target's config) and then written atomically. Exit status 2
and nothing written when a check fails.

OUT is checked before any work: it must be new, empty, or an earlier export of the same layout
holding nothing else (the export replaces the whole folder); anything else needs ``--overwrite``, and
a regular file is always refused. Each export marks its folder (eagle_tree.utils.outputs).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eagle_tree.commands.flags import parse_flags

NEXT_STEP = {
    "vllm": "vllm serve {target} --speculative-config "
            "'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": {k}}}'",
    "sglang": "python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path {out} --speculative-num-steps {k} "
              "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32",
    "eagle3": "EaModel.from_pretrained(base_model_path='{target}', ea_model_path='{out}') (EAGLE repository)",
}


@dataclass
class ExportConfig:
    """Write a draft head in the layout a serving engine loads (EAGLE-3, SGLang or vLLM speculators),
    validated first, atomically. See docs/INTEROP.md.

    eagle-tree export --to LAYOUT CHECKPOINT OUT [--target T] [--dtype D] [--overwrite]
    eagle-tree export to=LAYOUT checkpoint=CHECKPOINT out=OUT [key=value ...]     (the same)"""

    to: Literal["eagle3", "sglang", "vllm"]
    """Layout to write."""
    checkpoint: str
    """Head folder to read (config.json + model.safetensors), any layout eagle-tree reads."""
    out: str
    """Folder to write: absent, empty, or an earlier export of the same layout (replaced atomically)."""
    target: str | None = None
    """Target model folder or hub id: the head is checked against its config, which also resolves the
    default feature layers of heads that name none."""
    verifier: str | None = None
    """vLLM: the verifier's name or path written into the config (default: target)."""
    speculative_tokens: int = 3
    """vLLM: default draft tokens per step."""
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    """Cast the weights (default: keep)."""
    overwrite: bool = False
    """Replace `out` even when it holds something else than an earlier export of this layout."""


EXPORT_FILES = ("config.json", "model.safetensors")


def export_kind(layout: str) -> str:
    return f"eagle-tree export --to {layout}"


def is_export_of(layout: str):
    """Whether a folder without a marker is an export of ``layout`` (written before exports were
    marked): only the export's files, a config recording the head (``eagle_tree``), of that layout."""

    def recognise(path: Path) -> bool:
        if not {p.name for p in path.iterdir()} <= set(EXPORT_FILES):
            return False
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return (isinstance(config, dict) and "eagle_tree" in config
                and ("speculators_model_type" in config) == (layout == "vllm"))

    return recognise


def main(argv: list[str]) -> int:
    cfg = parse_flags(ExportConfig, argv, prog="eagle-tree export", positional=("checkpoint", "out"))
    from eagle_tree.utils.outputs import OutputPathError, check_output_dir, mark_output_dir

    kind = export_kind(cfg.to)
    try:
        check_output_dir(cfg.out, kind, writes=EXPORT_FILES, replaces_folder=True, overwrite=cfg.overwrite,
                         option="--overwrite", recognise=is_export_of(cfg.to))
    except OutputPathError as exc:
        print(f"eagle-tree export: {exc}", file=sys.stderr)
        return 2
    import torch

    from eagle_tree.models.export import export_head
    from eagle_tree.models.layouts import read_head
    from eagle_tree.utils.checks import check_finite_weights, check_target_path

    try:
        target_config, layers = None, None
        if cfg.target:
            from transformers import AutoConfig

            check_target_path(cfg.target, "--target")
            target_config = AutoConfig.from_pretrained(cfg.target)
            layers = target_config.get_text_config(decoder=True).num_hidden_layers
        head = read_head(cfg.checkpoint, target_num_layers=layers)
        check_finite_weights(head[1], f"the head in {cfg.checkpoint}")
        out = export_head(head, cfg.out, cfg.to, target_config=target_config,
                          verifier=cfg.verifier or cfg.target, speculative_tokens=cfg.speculative_tokens,
                          dtype=getattr(torch, cfg.dtype) if cfg.dtype else None)
        mark_output_dir(out, kind)
    except (ValueError, OSError) as exc:
        print(f"eagle-tree export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the {cfg.to} layout of {cfg.checkpoint} to {out}")
    print("next: " + NEXT_STEP[cfg.to].format(target=cfg.target or "TARGET", out=out, k=cfg.speculative_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
