"""A training study: variants of one training config, each trained for the same wall-clock budget, with
held-out acceptance length, copying acceptance length and top-1 agreement against training minutes.

Every variant is the base config (a training YAML) plus the study's common overrides plus its own
overrides, run with ``schedule.max_minutes`` (the budget, timed and resolved to steps) and evaluated at
equal training minutes (``eval.every_minutes``). Each variant is its own W&B run (tagged with the study's
name); the study writes, into ``output_dir``:

    VARIANT/            the variant's training run (head in VARIANT/final, train_summary.json)
    results.json        per variant: its overrides, budget, steps and the evaluation points
    table.md            the final figures per variant, ready to paste into docs/TRAINING.md
    curves.png          acceptance lengths and top-1 agreement against training minutes

A variant whose folder already holds a finished run (train_summary.json) with the same resolved config is
kept, so an interrupted study continues where it stopped. Before any variant trains, the feature caches
the variants lack are built, each example's target forward once for every variant of the same target
and data (variants that differ in draft vocabulary need caches of their own, but not forwards of their
own); ``features_only=true`` stops there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle_tree.utils.tracking import WandbConfig

__all__ = ["StudyConfig", "run_study", "variant_config", "build_feature_caches", "study_table", "curves_plot"]

METRICS = (("acceptance_length_chain", "held-out chain"), ("acceptance_length_tree", "held-out tree"),
           ("acceptance_length_copy_chain", "copying chain"), ("acc_0", "held-out top-1 agreement, step 0"))


@dataclass
class StudyConfig:
    """Train variants of a training config for equal wall-clock budgets and compare them."""

    output_dir: str = "results/study"
    """folder of the variants' runs, results.json, table.md and curves.png"""
    name: str = "study"
    """the study's name: W&B tag of every variant's run and title of the table"""
    base: str = "configs/train-reference.yaml"
    """the training config every variant starts from"""
    common: list[str] = field(default_factory=list)
    """dotted overrides applied to every variant (after the base, before the variant's own)"""
    variants: dict[str, list[str]] = field(default_factory=lambda: {"baseline": []})
    """variant name -> its dotted overrides"""
    only: list[str] = field(default_factory=list)
    """run only these variants (empty: all)"""
    minutes: float = 12.0
    """training budget of every variant (schedule.max_minutes; evaluations not counted)"""
    eval_every_minutes: float = 2.0
    """evaluate every this many training minutes (and at the start and the end)"""
    threads: int = 2
    """torch CPU threads of every variant"""
    seed: int = 0
    """seed of every variant (data order and head initialisation): rerun the study with another seed to see how far
    the figures move by chance"""
    rerun: bool = False
    """train every variant again, even one whose folder holds a finished run of the same config"""
    features_only: bool = False
    """build the variants' missing feature caches (features.source=cache) and stop before training"""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases: every variant is a run named NAME-VARIANT and tagged NAME, plus one run with the table"""

    def __post_init__(self) -> None:
        from eagle_tree.utils.checks import check_ranges
        from eagle_tree.utils.config import ConfigValueError

        check_ranges(self, threads=1, seed=0)
        for key in ("minutes", "eval_every_minutes"):
            if not getattr(self, key) > 0:
                raise ConfigValueError(key, f"must be > 0, got {getattr(self, key)!r}")
        if not self.variants:
            raise ValueError("variants must name at least one variant, e.g. {baseline: []}")
        unknown = [v for v in self.only if v not in self.variants]
        if unknown:
            raise ValueError(f"only names unknown variant(s) {unknown}; the variants are {list(self.variants)}")
        bad = [v for v in self.variants if not v or "/" in v or v.startswith(".")]
        if bad:
            raise ValueError(f"variant names {bad} cannot name a folder; use letters, digits, '-' and '_'")


def variant_config(study: StudyConfig, name: str):
    """The resolved TrainConfig of variant ``name``."""
    from eagle_tree.training.config import TrainConfig
    from eagle_tree.utils.config import load_config

    w = study.wandb
    fixed = [f"output_dir={Path(study.output_dir) / name}", f"threads={study.threads}", f"seed={study.seed}",
             f"model.seed={study.seed}", "overwrite=true",
             "resume=null", "progress=false", "schedule.epochs=null", f"schedule.max_minutes={study.minutes}",
             "eval.every=0", f"eval.every_minutes={study.eval_every_minutes}", "eval.at_start=true",
             "eval.at_end=true", "checkpoint.every=0", f"wandb.mode={w.mode}", f"wandb.project={w.project}",
             f"wandb.name={study.name}-{name}", f"wandb.tags=[{study.name}, {name}]"]
    if w.entity:
        fixed.append(f"wandb.entity={w.entity}")
    if w.dir:
        fixed.append(f"wandb.dir={w.dir}")
    return load_config(TrainConfig, study.base, [*fixed, *study.common, *study.variants[name]])


def build_feature_caches(configs: list, threads: int = 1, progress: bool = True) -> list[Path]:
    """Build the missing feature caches of training configs with ``features.source=cache``: configs that
    share the target and the data share each example's target forward. Returns the cache folders."""
    import torch

    from eagle_tree.training.feature_cache import FeatureCache
    from eagle_tree.training.resolve import initial_head, load_target, resolve_data
    from eagle_tree.utils.config import config_to_dict

    groups: dict[str, list] = {}
    for cfg in configs:
        if cfg.features.source != "cache" or not cfg.features.cache_dir or _complete(cfg.features.cache_dir):
            continue  # a complete cache's fingerprint is checked when its variant trains
        data = {k: v for k, v in config_to_dict(cfg.data).items() if k != "draft_vocab_size"}
        key = json.dumps([config_to_dict(cfg.target), data, cfg.features.examples_per_shard], default=str)
        groups.setdefault(key, []).append(cfg)
    folders = []
    torch.set_num_threads(threads)
    for cfgs in groups.values():
        unique = {str(Path(c.features.cache_dir).expanduser()): c for c in cfgs}
        first = next(iter(unique.values()))
        target, tokenizer = load_target(first)
        examples = resolve_data(first).load(tokenizer)
        # each variant's draft vocabulary, chosen exactly as its training run will choose it
        caches = [(folder, initial_head(cfg, target, examples).draft_to_target.cpu())
                  for folder, cfg in unique.items()]
        print(f"[study] feature caches {', '.join(unique)}: one target forward per example for "
              f"{len(caches)} cache(s)", flush=True)
        FeatureCache.build_many(caches, target, examples, examples_per_shard=first.features.examples_per_shard,
                                progress=progress)
        folders += [Path(f) for f in unique]
    return folders


def _complete(folder: str) -> bool:
    from eagle_tree.training.feature_cache import FeatureCache, StaleCacheError

    try:
        return not FeatureCache(Path(folder).expanduser()).missing_shards()
    except (FileNotFoundError, StaleCacheError, ValueError, OSError):
        return False


def _finished(cfg) -> dict | None:
    """The summary of a finished run of exactly this config in its output_dir, or None."""
    from eagle_tree.utils.config import config_to_dict

    out = Path(cfg.output_dir)
    summary, saved = out / "train_summary.json", out / "final" / "config.yaml"
    if not (summary.is_file() and saved.is_file()):
        return None
    import yaml

    mine = json.loads(json.dumps(config_to_dict(cfg), default=str))
    theirs = yaml.safe_load(saved.read_text())
    for key in ("overwrite", "resume", "progress"):
        mine.pop(key, None), theirs.pop(key, None)
    return json.loads(summary.read_text()) if mine == theirs else None


def _points(summary: dict) -> list[dict]:
    points = []
    for ev in summary["evals"]:
        p = {"step": ev["step"], "minutes": round(ev.get("train_minutes", 0.0), 4)}
        for key, _ in METRICS[:3]:
            if key in ev:
                p[key] = ev[key]
        if ev.get("agreement"):
            p["acc_0"] = ev["agreement"][0]
            p["agreement"] = ev["agreement"]
        if ev.get("overlap"):
            p["sampled_acceptance"] = ev["overlap"]
        points.append(p)
    return points


def run_study(study: StudyConfig) -> dict:
    """Train (or keep) every variant, then write results.json, table.md and curves.png; return the results."""
    from eagle_tree.training.loop import train
    from eagle_tree.utils.atomic import write_text
    from eagle_tree.utils.config import config_to_dict, save_config
    from eagle_tree.utils.tracking import RunLogger

    out = Path(study.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(study, out / "study.yaml")
    names = study.only or list(study.variants)
    configs = {name: variant_config(study, name) for name in names}  # every variant checked before any trains
    unfinished = [cfg for cfg in configs.values() if study.rerun or _finished(cfg) is None]
    build_feature_caches(unfinished, threads=study.threads)
    if study.features_only:
        print("[study] features_only: the feature caches are built; rerun without it to train", flush=True)
        return {"study": config_to_dict(study), "variants": {}}
    results: dict = {"study": config_to_dict(study), "variants": {}}
    for i, name in enumerate(names, 1):
        cfg = configs[name]
        summary = None if study.rerun else _finished(cfg)
        print(f"[study] {i}/{len(names)} {name}: " + ("kept (finished run of the same config)" if summary else
              f"training for {study.minutes:g} min ({' '.join(study.variants[name]) or 'base config'})"), flush=True)
        if summary is None:
            train(cfg)
            summary = json.loads((Path(cfg.output_dir) / "train_summary.json").read_text())
        results["variants"][name] = {
            "overrides": study.variants[name], "steps": summary["steps"], "budget": summary.get("budget"),
            "train_s": summary.get("train_s"), "points": _points(summary),
            "shapes": {"chain": cfg.eval.chain_length,
                       "tree": f"d{cfg.eval.tree_depth} k{cfg.eval.tree_top_k} n{cfg.eval.tree_total_tokens}",
                       "copy_chain": cfg.eval.copy_chain_length}}
        write_text(out / "results.json", json.dumps(results, indent=1) + "\n")  # after every variant
    write_text(out / "table.md", study_table(results) + "\n")
    curves_plot(results, out / "curves.png")
    with RunLogger(study.wandb, run_config=config_to_dict(study), job_type="study") as logger:
        for name, v in results["variants"].items():
            final = v["points"][-1] if v["points"] else {}
            logger.summary({f"study/{name}/{k}": final[k] for k, _ in METRICS if k in final})
        logger.log_image("study/curves_png", out / "curves.png")
    print(study_table(results))
    print(f"\n[study] wrote {out / 'table.md'}, {out / 'curves.png'}, {out / 'results.json'}")
    return results


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def study_table(results: dict) -> str:
    """One row per variant: budget, steps, and the first and final evaluation's figures."""
    variants = results["variants"]
    shapes = next(iter(variants.values()))["shapes"] if variants else {"chain": "?", "tree": "?", "copy_chain": "?"}
    study = results["study"]
    lines = [f"Study `{study['name']}`: {study['minutes']:g} training minutes per variant, {study['threads']} "
             f"threads; held-out acceptance length (greedy, committed tokens per round) with a chain of "
             f"{shapes['chain']} and a tree {shapes['tree']}, the copying set with a chain of {shapes['copy_chain']}, "
             "top-1 agreement with the target at draft step 0 on the held-out prompts (at step 0 of training -> "
             "at the end).", "",
             "| variant | overrides | steps | s / step | chain | tree | copying chain | top-1 agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in variants.items():
        first, last = (v["points"][0], v["points"][-1]) if v["points"] else ({}, {})
        step_s = (v.get("budget") or {}).get("measured_step_s")
        agree = f"{_fmt(first.get('acc_0'))} -> {_fmt(last.get('acc_0'))}"
        overrides = ", ".join(f"`{o}`" for o in v["overrides"]) or "(base)"
        lines.append(f"| {name} | {overrides} | {v['steps']} | {_fmt(step_s)} | "
                     f"{_fmt(last.get('acceptance_length_chain'))} | {_fmt(last.get('acceptance_length_tree'))} | "
                     f"{_fmt(last.get('acceptance_length_copy_chain'))} | {agree} |")
    return "\n".join(lines)


def curves_plot(results: dict, path: Path) -> Path:
    """One panel per metric, one line per variant, against training minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, METRICS, strict=True):
        drawn = False
        for name, v in results["variants"].items():
            pts = [p for p in v["points"] if key in p]
            if pts:
                ax.plot([p["minutes"] for p in pts], [p[key] for p in pts], marker="o", ms=3, label=name)
                drawn = True
        if not drawn:  # say so rather than leave an empty frame (e.g. no copying prompts in this study)
            ax.text(0.5, 0.5, "not measured in this study", ha="center", va="center", transform=ax.transAxes,
                    color="0.4")
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(title)
        ax.set_xlabel("training minutes")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{results['study']['name']}: equal budgets of {results['study']['minutes']:g} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
