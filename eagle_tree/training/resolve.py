"""What a training config names, made concrete: the target model and tokenizer, the data files, the
held-out prompts ('toy' builds or reuses the toy target; 'stdlib:...' writes corpus chunks)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from eagle_tree.data.corpus import split_jsonl
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.data import DataConfig

__all__ = ["load_target", "resolve_data", "initial_head", "read_prompts", "read_copy_prompts"]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _toy_assets(cfg: TrainConfig):
    from eagle_tree.data.toy import build_toy

    return build_toy(cfg.target.toy, cfg.target.toy_cache_dir)


def load_target(cfg: TrainConfig):
    """(TargetModel, tokenizer) for ``cfg.target`` ('toy' builds or reuses the toy target)."""
    from eagle_tree.models.gguf import load_tokenizer
    from eagle_tree.models.target import TargetModel
    from eagle_tree.utils.checks import check_target_path

    if cfg.target.path != "toy":
        check_target_path(cfg.target.path, "target.path")
    path = str(_toy_assets(cfg).target) if cfg.target.path == "toy" else cfg.target.path
    target = TargetModel.from_pretrained(path, dtype=_DTYPES[cfg.target.dtype],
                                         feature_layers=cfg.target.feature_layers,
                                         attn_implementation=cfg.target.attn_implementation,
                                         prepack=cfg.target.prepack)
    for p in target.model.parameters():
        p.requires_grad_(False)
    return target, load_tokenizer(path)


def resolve_data(cfg: TrainConfig) -> DataConfig:
    """``cfg.data`` with the special paths ('toy', 'stdlib:...') replaced by local files."""
    data = copy.copy(cfg.data)
    if data.path == "toy":
        data.path = str(_toy_assets(cfg).train_file)
    elif isinstance(data.path, str) and data.path.startswith("stdlib:"):
        data.path = str(split_jsonl(data.path, Path(cfg.output_dir) / "data", chunk_chars=3 * data.max_length))
    elif isinstance(data.path, list):  # a list may mix 'stdlib:' specs with local files
        data.path = [str(split_jsonl(p, Path(cfg.output_dir) / "data", chunk_chars=3 * data.max_length))
                     if isinstance(p, str) and p.startswith("stdlib:") else p for p in data.path]
    return data


def initial_head(cfg: TrainConfig, target, examples, source: str | Path | None = None, report: bool = False):
    """The head a run starts from, with its draft vocabulary: ``source`` (a checkpoint being resumed) or
    ``model.init_from`` (a warm start) keeps that head's weights and vocabulary; otherwise a fresh head
    over the ``data.draft_vocab_size`` most frequent loss-masked tokens of ``examples``. The one place
    this choice is made: training and the feature caches built ahead of a study both call it."""
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.training.data import build_draft_vocab

    source = source or cfg.model.init_from
    if source is not None:
        return Eagle3DraftModel.from_pretrained(source, target=target).float().train()
    ids = build_draft_vocab(examples, target.vocab_size, cfg.data.draft_vocab_size)
    m = cfg.model
    head = Eagle3DraftModel.from_target(target, draft_vocab=ids, layers=target.feature_layers,
                                        seed=m.seed, init=m.init, init_parts=m.init_parts)
    if m.init == "target" and report:
        print(f"[eagle-tree train] head initialised from the target: {', '.join(head.init_report) or 'nothing'} "
              f"(of {', '.join(m.init_parts)})", flush=True)
    return head.float().train()


def read_prompts(cfg: TrainConfig) -> list[str]:
    """The held-out evaluation prompts (``eval.prompts``), the first ``eval.num_prompts``."""
    spec = cfg.eval.prompts
    if spec is None:
        return []
    from eagle_tree.utils.prompts import read_prompts as read_prompt_texts

    path = _toy_assets(cfg).prompts_file if spec == "toy" else Path(spec)
    prompts = read_prompt_texts(path)
    return prompts[: cfg.eval.num_prompts]


def read_copy_prompts(cfg: TrainConfig) -> list[str]:
    """The copying prompts (``eval.copy_prompts``: a style of eagle_tree.data.copying or a file)."""
    spec, n = cfg.eval.copy_prompts, cfg.eval.copy_num_prompts
    if spec is None:
        return []
    from eagle_tree.data.copying import COPY_STYLES, copy_prompts

    if spec in COPY_STYLES:
        return copy_prompts(spec, n, seed=0)
    from eagle_tree.utils.prompts import read_prompts as read_prompt_texts

    return read_prompt_texts(Path(spec))[:n]

