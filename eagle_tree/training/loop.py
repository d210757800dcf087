"""Training an EAGLE-3 head: config schema, data stream, the accelerate loop, checkpoints and evaluation.

Flow (ARCHITECTURE.md, "Training flow")::

    examples (data.py) -> per micro-batch: target features + logits, online (feature_cache.example_targets
    under no_grad) or from a FeatureCache -> ttt_forward (the training-time test) -> accelerate
    (one CPU process up to DDP / FSDP, mixed precision, gradient accumulation, clipping, warm-up and
    cosine / linear decay) -> checkpoints (atomic, full resume) -> W&B (RunLogger) with the real
    acceptance length measured by SpeculativeDecoder every ``eval.every`` steps.

Data order. Micro-batches come from ``data.batches(examples, optim.batch_size, seed, epoch)`` epoch after
epoch; optimiser step ``n`` consumes the next ``world * grad_accum`` of them, micro-batch ``k`` of the
step going to rank ``k % world`` (accumulation slot ``k // world``). The position (epoch, batch) is
saved in every checkpoint, so a resumed run sees exactly the batches the uninterrupted run would have.
With this order, two DDP processes give the same update as one process with twice the accumulation.

Loss normalisation: each micro-batch's loss is ttt_forward's (per-step mean over its valid positions,
weighted ``decay ** s``); micro-batches and ranks are averaged with equal weight.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from eagle_tree.reference.toy import ToyConfig
from eagle_tree.training.data import DataConfig
from eagle_tree.utils.tracking import WandbConfig

STATE_NAME = "training_state.pt"
CONFIG_NAME = "config.yaml"

__all__ = [
    "TargetSection", "ModelSection", "OptimSection", "ScheduleSection", "TTTSection", "FeatureSection",
    "EvalSection", "CheckpointSection", "TrainConfig", "TrainResult", "train", "lr_factor",
    "resolve_mixed_precision", "DataStream", "TTTLoss", "latest_checkpoint", "evaluate_acceptance",
    "load_target", "resolve_data", "read_prompts", "batch_targets", "pad_targets",
]


# ============================================================================= config schema


@dataclass
class TargetSection:
    """The frozen target model."""

    path: str = field(default="toy", metadata={
        "help": "'toy' (a tiny target with learnable structure, built locally by eagle_tree.reference.toy), or a local "
                "folder / hub id loaded with AutoModelForCausalLM + AutoTokenizer"})
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={
        "help": "dtype the target is loaded and run in (features are cached in it)"})
    feature_layers: list[int] | None = field(default=None, metadata={
        "help": "the three layers whose input hidden states are fused (default 2, L//2, L-3)"})
    attn_implementation: Literal["sdpa", "eager"] = field(default="sdpa", metadata={
        "help": "attention implementation of the target"})
    toy: ToyConfig = field(default_factory=ToyConfig, metadata={"help": "the toy target (path=toy)"})
    toy_cache_dir: str | None = field(default=None, metadata={
        "help": "where toy targets are cached (default $EAGLE_TREE_CACHE/toy or ~/.cache/eagle_tree/toy)"})


@dataclass
class ModelSection:
    """The draft head."""

    init_from: str | None = field(default=None, metadata={
        "help": "warm start: load the weights (and draft vocabulary) of this head folder; optimiser, schedule "
                "and data position start fresh"})
    seed: int = field(default=0, metadata={"help": "seed of the head's initialisation"})


@dataclass
class OptimSection:
    """Optimiser and precision."""

    lr: float = field(default=3e-4, metadata={"help": "peak learning rate (AdamW)"})
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={"help": "AdamW betas"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on matrices (not norms)"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0: no clipping)"})
    batch_size: int = field(default=8, metadata={"help": "examples per micro-batch per process"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches accumulated per optimiser step"})
    mixed_precision: Literal["no", "bf16", "fp16"] = field(default="no", metadata={
        "help": "autocast precision of the head's forward (no, bf16, fp16); falls back to 'no' with a notice "
                "where the device lacks it (fp16 on CPU, bf16 on CPUs without bf16 instructions)"})


@dataclass
class ScheduleSection:
    """Length of the run and the learning-rate schedule."""

    max_steps: int = field(default=1000, metadata={"help": "optimiser steps (ignored when epochs is set)"})
    epochs: float | None = field(default=None, metadata={"help": "passes over the data; sets max_steps"})
    kind: Literal["cosine", "linear", "constant"] = field(default="cosine", metadata={
        "help": "decay after warm-up: cosine or linear down to min_lr_ratio * lr, or constant"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warm-up steps from lr / warmup_steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final learning rate as a fraction of lr"})


@dataclass
class TTTSection:
    """The training-time test (ttt.ttt_forward)."""

    steps: int = field(default=7, metadata={"help": "unrolled draft steps per position"})
    decay: float = field(default=0.8, metadata={"help": "weight of step s is decay ** s"})


@dataclass
class FeatureSection:
    """Where target features and distributions come from."""

    source: Literal["online", "cache"] = field(default="online", metadata={
        "help": "online: target forward under no_grad in the loop; cache: written once to cache_dir (resumable, "
                "fingerprinted) and read back"})
    cache_dir: str | None = field(default=None, metadata={
        "help": "feature cache folder (default OUTPUT_DIR/feature_cache)"})
    examples_per_shard: int = field(default=256, metadata={"help": "examples per safetensors shard"})


@dataclass
class EvalSection:
    """Real acceptance length measured with SpeculativeDecoder (greedy) on held-out prompts."""

    every: int = field(default=0, metadata={"help": "evaluate every N optimiser steps (0: only at the end)"})
    at_start: bool = field(default=False, metadata={"help": "also evaluate the untrained head at step 0"})
    at_end: bool = field(default=True, metadata={"help": "evaluate the final head"})
    prompts: str | None = field(default=None, metadata={
        "help": "held-out prompts: .jsonl with a 'prompt' field or .txt one per line; 'toy' for the toy's; "
                "null: no decoding evaluation"})
    num_prompts: int = field(default=8, metadata={"help": "use the first N prompts"})
    max_prompt_tokens: int = field(default=256, metadata={"help": "keep the last N tokens of a longer prompt"})
    max_new_tokens: int = field(default=64, metadata={"help": "output budget per prompt"})
    chain_length: int = field(default=5, metadata={"help": "draft tokens per round in chain mode"})
    tree_depth: int = field(default=6, metadata={"help": "tree mode: levels below the root"})
    tree_top_k: int = field(default=8, metadata={"help": "tree mode: children per expanded node"})
    tree_total_tokens: int = field(default=48, metadata={"help": "tree mode: nodes kept after the rerank"})


@dataclass
class CheckpointSection:
    """Checkpoints under OUTPUT_DIR/checkpoints/step-N."""

    every: int = field(default=0, metadata={"help": "save every N optimiser steps (0: only the final head)"})
    keep_last: int | None = field(default=2, metadata={"help": "keep the newest N checkpoints (null: all)"})


@dataclass
class TrainConfig:
    """Train an EAGLE-3 draft head with the training-time test."""

    output_dir: str = field(default="runs/train", metadata={
        "help": "run folder: checkpoints/step-N, final (the head), config.yaml, train_summary.json"})
    target: TargetSection = field(default_factory=TargetSection, metadata={"help": "the frozen target"})
    data: DataConfig = field(default_factory=lambda: DataConfig(path="toy"), metadata={
        "help": "training data (data.DataConfig); path 'toy' = the toy corpus, 'stdlib:MANIFEST#SPLIT' = a "
                "split of the standard-library corpus pinned by a corpus manifest"})
    model: ModelSection = field(default_factory=ModelSection, metadata={"help": "the draft head"})
    optim: OptimSection = field(default_factory=OptimSection, metadata={"help": "optimiser and precision"})
    schedule: ScheduleSection = field(default_factory=ScheduleSection, metadata={"help": "steps and schedule"})
    ttt: TTTSection = field(default_factory=TTTSection, metadata={"help": "training-time test"})
    features: FeatureSection = field(default_factory=FeatureSection, metadata={"help": "online or cached"})
    eval: EvalSection = field(default_factory=EvalSection, metadata={"help": "acceptance-length evaluation"})
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection, metadata={"help": "checkpoints"})
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"help": "Weights & Biases logging"})
    resume: str | None = field(default=None, metadata={
        "help": "'latest' (newest checkpoint under output_dir, or a fresh start if none) or a checkpoint folder: "
                "restores head, optimiser, schedule, RNG and data position"})
    seed: int = field(default=0, metadata={"help": "seed of the data order and of the RNGs"})
    cpu: bool = field(default=False, metadata={"help": "run on CPU even when an accelerator is present"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads per process (null: torch's)"})
    log_every: int = field(default=1, metadata={"help": "log training metrics every N steps"})
    progress: bool = field(default=True, metadata={"help": "show a tqdm progress bar"})


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    steps: int
    tokens: int
    wall_s: float
    metrics: dict  # the last logged training metrics
    evals: list[dict]  # {"step", "acceptance_length_chain", "acceptance_length_tree", ...}
    run_dir: Path | None  # the W&B run folder (None when disabled)
    world_size: int = 1
    tokens_per_rank: list[int] = field(default_factory=list)


# ============================================================================= pieces


def lr_factor(step: int, s: ScheduleSection, total_steps: int) -> float:
    """Multiplier of the peak lr at optimiser step ``step`` (0-based): linear warm-up, then the decay."""
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return 1.0
    progress = min(1.0, (step - s.warmup_steps) / max(1, total_steps - s.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if s.kind == "cosine" else 1.0 - progress
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * shape


def cpu_supports_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch
        return False


def resolve_mixed_precision(requested: str, device_type: str, cpu_bf16: bool | None = None) -> tuple[str, str | None]:
    """(mode to use, notice or None). fp16 needs an accelerator; bf16 on CPU needs bf16 instructions."""
    if device_type != "cpu" or requested == "no":
        return requested, None
    if requested == "fp16":
        return "no", "mixed_precision=fp16 needs a GPU; training in float32 on CPU"
    has_bf16 = cpu_supports_bf16() if cpu_bf16 is None else cpu_bf16
    if not has_bf16:
        return "no", "this CPU has no bf16 instructions (AVX512-BF16 / AMX); training in float32 instead of bf16"
    return requested, None


class DataStream:
    """Micro-batches epoch after epoch in the order fixed by (seed, epoch); the position is resumable."""

    def __init__(self, examples, batch_size: int, seed: int, pad_id: int, epoch: int = 0, index: int = 0):
        self.examples, self.batch_size, self.seed, self.pad_id = examples, batch_size, seed, pad_id
        self.epoch, self.index = epoch, index
        self._it: Iterator | None = None

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def next(self):
        from eagle_tree.training.data import batches

        while True:
            if self._it is None:
                self._it = batches(self.examples, self.batch_size, self.seed, self.epoch, pad_id=self.pad_id,
                                   start=self.index)
            batch = next(self._it, None)
            if batch is not None:
                self.index = batch.index + 1
                return batch
            self.epoch, self.index, self._it = self.epoch + 1, 0, None

    def take(self, n: int) -> list:
        return [self.next() for _ in range(n)]


class TTTLoss(nn.Module):
    """The head wrapped so that DDP / FSDP see one ``forward``: inputs -> (loss, TTTOutput)."""

    def __init__(self, draft, steps: int, decay: float):
        super().__init__()
        self.draft, self.steps, self.decay = draft, steps, decay

    def forward(self, features, input_ids, loss_mask, target_logits, lengths):
        from eagle_tree.training.ttt import ttt_forward

        features = features.to(self.draft.fc.weight.dtype)
        out = ttt_forward(self.draft, features, input_ids, loss_mask, target_logits, self.steps, self.decay, lengths)
        out.logits = []  # (B, T, Vd) per step: autograd keeps what backward needs, drop the rest now
        return out.loss, out


def pad_targets(rows: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example (features (T_i, 3H), logits (T_i, V)) -> right-padded (B, width, 3H), (B, width, V).
    Padding is zeros (finite logits, so the masked-out padded positions stay NaN-free)."""
    f0, z0 = rows[0]
    features = f0.new_zeros((len(rows), width, f0.shape[-1]))
    logits = z0.new_zeros((len(rows), width, z0.shape[-1]))
    for i, (f, z) in enumerate(rows):
        features[i, : f.shape[0]] = f
        logits[i, : z.shape[0]] = z
    return features, logits


def batch_targets(batch, target=None, cache=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (B, T, 3H), logits (B, T, V) float32) of a data.Batch, online or from a FeatureCache."""
    from eagle_tree.training.feature_cache import example_targets

    rows = []
    for row, i in enumerate(batch.indices):
        if cache is not None:
            rows.append(cache.targets(i))
        else:
            ids = batch.input_ids[row, : int(batch.lengths[row])]
            rows.append(example_targets(target, ids))
    features, logits = pad_targets(rows, batch.input_ids.shape[1])
    return (features, logits) if device is None else (features.to(device), logits.to(device))


# ============================================================================= target and data


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _toy_assets(cfg: TrainConfig):
    from eagle_tree.reference.toy import build_toy

    return build_toy(cfg.target.toy, cfg.target.toy_cache_dir)


def load_target(cfg: TrainConfig):
    """(TargetModel, tokenizer) for ``cfg.target`` ('toy' builds or reuses the toy target)."""
    from transformers import AutoTokenizer

    from eagle_tree.models.target import TargetModel

    path = str(_toy_assets(cfg).target) if cfg.target.path == "toy" else cfg.target.path
    target = TargetModel.from_pretrained(path, dtype=_DTYPES[cfg.target.dtype],
                                         feature_layers=cfg.target.feature_layers,
                                         attn_implementation=cfg.target.attn_implementation)
    for p in target.model.parameters():
        p.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(path)


def _stdlib_jsonl(spec: str, out_dir: Path, chunk_chars: int = 2000) -> Path:
    """'stdlib:MANIFEST#SPLIT' -> a jsonl of {"text"} chunks (whole lines, about ``chunk_chars`` each) of
    that split of the standard-library corpus (eagle_tree.reference.corpus, files checked against the manifest);
    written once under ``out_dir``. Chunks of about 3 * max_length characters keep most of the text
    within max_length tokens (a 1024-entry BPE averages about 3 characters per token on Python)."""
    from eagle_tree.reference import corpus

    manifest_path, _, split = spec.removeprefix("stdlib:").partition("#")
    split = split or "train"
    manifest = corpus.Manifest.load(manifest_path)
    out = out_dir / f"stdlib-{split}-{chunk_chars}.jsonl"
    if out.is_file():
        return out
    rows = []
    for _, text in corpus.load_split(manifest, split):
        chunk: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            chunk.append(line)
            size += len(line)
            if size >= chunk_chars:
                rows.append("".join(chunk))
                chunk, size = [], 0
        if "".join(chunk).strip():
            rows.append("".join(chunk))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    os.replace(tmp, out)
    return out


def resolve_data(cfg: TrainConfig) -> DataConfig:
    """``cfg.data`` with the special paths ('toy', 'stdlib:...') replaced by local files."""
    data = copy.copy(cfg.data)
    if data.path == "toy":
        data.path = str(_toy_assets(cfg).train_file)
    elif isinstance(data.path, str) and data.path.startswith("stdlib:"):
        data.path = str(_stdlib_jsonl(data.path, Path(cfg.output_dir) / "data", chunk_chars=3 * data.max_length))
    elif isinstance(data.path, list):  # a list may mix 'stdlib:' specs with local files
        data.path = [str(_stdlib_jsonl(p, Path(cfg.output_dir) / "data", chunk_chars=3 * data.max_length))
                     if isinstance(p, str) and p.startswith("stdlib:") else p for p in data.path]
    return data


def read_prompts(cfg: TrainConfig) -> list[str]:
    """The held-out evaluation prompts (``eval.prompts``), the first ``eval.num_prompts``."""
    spec = cfg.eval.prompts
    if spec is None:
        return []
    path = _toy_assets(cfg).prompts_file if spec == "toy" else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"eval.prompts: no prompt file {str(path)!r}")
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = [line for line in path.read_text().splitlines() if line.strip()]
    return prompts[: cfg.eval.num_prompts]


# ============================================================================= evaluation


@torch.no_grad()
def _save_untuned_decoding_defaults(folder: Path, ev: EvalSection) -> None:
    """decoding.json beside the final head: the evaluation's tree shape, marked untuned (the bench's
    tuning with head_defaults=true replaces it with measured shapes)."""
    from eagle_tree.decoding.drafting import TreeConfig
    from eagle_tree.decoding.shapes import save_decoding_defaults

    tree = TreeConfig(depth=ev.tree_depth, top_k=ev.tree_top_k, total_tokens=ev.tree_total_tokens)
    save_decoding_defaults(folder, tree, greedy=True, by="training", tuned=False)


def evaluate_acceptance(target, draft, prompt_ids: list[torch.Tensor], ev: EvalSection,
                        eos_token_id: int | None = None) -> dict:
    """Greedy decoding of every prompt in chain and tree mode: acceptance length (committed tokens per
    round) and the survival curve Pr(A >= i) of accepted draft tokens A, per mode."""
    from eagle_tree.core.sampling import SamplingConfig
    from eagle_tree.decoding.decoder import SpeculativeDecoder
    from eagle_tree.decoding.drafting import TreeConfig
    from eagle_tree.decoding.metrics import summarize

    was_training = draft.training
    head = draft if draft.fc.weight.dtype == target.dtype else copy.deepcopy(draft).to(target.dtype)
    greedy = SamplingConfig(temperature=0.0)
    shapes = {"chain": TreeConfig.chain(ev.chain_length),
              "tree": TreeConfig(depth=ev.tree_depth, top_k=ev.tree_top_k, total_tokens=ev.tree_total_tokens)}
    result: dict[str, Any] = {}
    try:
        for mode, shape in shapes.items():
            decoder = SpeculativeDecoder(target, head, tree=shape)
            outs = [decoder.generate(ids[None], ev.max_new_tokens, greedy, seed=0, eos_token_id=eos_token_id)
                    for ids in prompt_ids]
            summary = summarize(mode, 0.0, outs, depth=shape.depth)
            result[f"acceptance_length_{mode}"] = summary.acceptance_length
            result[f"survival_{mode}"] = summary.survival
            result[f"rounds_{mode}"] = summary.rounds
    finally:
        draft.train(was_training)
    return result


# ============================================================================= checkpoints


def _checkpoint_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    root = output_dir / "checkpoints"
    found = []
    for p in root.glob("step-*") if root.is_dir() else []:
        if p.is_dir() and p.name[5:].isdigit() and (p / STATE_NAME).is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``output_dir/checkpoints``, or None."""
    found = _checkpoint_dirs(Path(output_dir))
    return found[-1][1] if found else None


def _gather_object(acc, obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    if acc.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return list(gather_object([obj]))


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _full_head(draft, weights: dict):
    """A CPU copy of the head holding ``weights`` (the full state dict of the TTTLoss module, which FSDP
    gathers): what checkpoints, the final folder and evaluation use."""
    from eagle_tree.models.head import Eagle3DraftModel

    head = Eagle3DraftModel(draft.config, draft.d2t.detach().cpu(), draft.t2d.detach().cpu())
    state = {k.removeprefix("draft."): v.detach().cpu() for k, v in weights.items()}
    embed = state.pop("embed_tokens.weight", None)  # the target's frozen embedding, gathered like the rest
    head.load_state_dict(state, strict=False)
    if embed is not None:
        head.embed_tokens.weight.data.copy_(embed)
        head._embedding_bound = True
    return head


def _save_checkpoint(acc, cfg: TrainConfig, module, draft, optimizer, scheduler, progress: dict, step: int) -> Path:
    """Atomically write OUTPUT_DIR/checkpoints/step-N: the head in the EAGLE-3 layout (config.json,
    model.safetensors), training_state.pt and config.yaml. Built in a hidden ``.step-N.partial``
    folder, then renamed. Every process takes part (gathers); the main process writes."""
    from eagle_tree.utils.config import save_config

    rng = _gather_object(acc, _rng_state())
    weights = acc.get_state_dict(module)  # the full state dict on the main process (FSDP gathers)
    sharded = acc.distributed_type.name == "FSDP"
    root = Path(cfg.output_dir) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f".step-{step}.partial"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        _full_head(draft, weights).save_pretrained(tmp)  # creates tmp: config.json + model.safetensors
    acc.wait_for_everyone()
    if sharded:  # FSDP: every rank keeps its own optimiser shard
        torch.save(optimizer.state_dict(), tmp / f"optimizer-rank{acc.process_index}.pt")
        acc.wait_for_everyone()
    if acc.is_main_process:
        state = {
            "step": step, "progress": progress, "scheduler": scheduler.state_dict(),
            "optimizer": None if sharded else optimizer.state_dict(), "rng": rng,
            "world_size": acc.num_processes, "draft_ids": draft.draft_to_target.tolist(),
        }
        torch.save(state, tmp / STATE_NAME)
        save_config(cfg, tmp / CONFIG_NAME)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if cfg.checkpoint.keep_last is not None:
            for _, old in _checkpoint_dirs(Path(cfg.output_dir))[: -cfg.checkpoint.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def _load_training_state(acc, ckpt: Path, optimizer, scheduler) -> dict:
    state = torch.load(ckpt / STATE_NAME, map_location="cpu", weights_only=False)
    if state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    else:
        optimizer.load_state_dict(torch.load(ckpt / f"optimizer-rank{acc.process_index}.pt", weights_only=False))
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    _set_rng_state(rng[acc.process_index] if len(rng) == acc.num_processes else rng[0])
    return state


# ============================================================================= the loop


def _make_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process: start from a clean accelerate state
        AcceleratorState._reset_state(reset_partial_state=True)
    state = PartialState(cpu=cfg.cpu)
    mode, notice = resolve_mixed_precision(cfg.optim.mixed_precision, state.device.type)
    if notice and state.is_main_process:
        print(f"[eagle-tree train] notice: {notice}", flush=True)
    return Accelerator(cpu=cfg.cpu, mixed_precision=mode), mode


def _optimizer(draft, o: OptimSection) -> torch.optim.Optimizer:
    params = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def _step_metrics(outs: list, losses: list[torch.Tensor], steps: int, acc) -> dict:
    """Training metrics of one optimiser step over every micro-batch and rank (counts-weighted)."""
    vec = torch.zeros(3 * steps + 2, dtype=torch.float64)
    for out, loss in zip(outs, losses, strict=True):
        for s in range(steps):
            n = out.step_counts[s]
            vec[s] += out.step_accuracy[s] * n
            vec[steps + s] += out.step_losses[s] * n
            vec[2 * steps + s] += n
        vec[3 * steps] += float(loss.detach())
        vec[3 * steps + 1] += 1
    if acc.num_processes > 1:
        vec = acc.reduce(vec.to(acc.device), reduction="sum").cpu()
    counts = vec[2 * steps: 3 * steps].clamp_min(1)
    acc_s = (vec[:steps] / counts).tolist()
    from eagle_tree.training.ttt import simulated_acceptance_length

    metrics = {"train/loss": float(vec[3 * steps] / vec[3 * steps + 1])}
    metrics.update({f"train/acc_{s}": acc_s[s] for s in range(steps)})
    metrics.update({f"train/loss_{s}": float(vec[steps + s] / counts[s]) for s in range(steps)})
    metrics["train/sim_acceptance_length"] = simulated_acceptance_length(acc_s)
    return metrics


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) the training described by ``cfg``; returns where the head went and the last figures."""
    old_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _Run(cfg).run()
    finally:
        torch.set_num_threads(old_threads)


class _Run:
    """One training run in named phases: setup, evaluate, step, checkpoint, finish."""

    def __init__(self, cfg: TrainConfig):
        from eagle_tree.utils.config import save_config

        self.cfg = cfg
        self.acc, self.precision = _make_accelerator(cfg)
        acc = self.acc
        self.main, self.rank, self.world = acc.is_main_process, acc.process_index, acc.num_processes
        self.out_dir = Path(cfg.output_dir)
        if self.main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out_dir / CONFIG_NAME)
        with acc.main_process_first():  # the toy target and the datasets cache are built once
            self.target, self.tokenizer = load_target(cfg)
            self.examples = resolve_data(cfg).load(self.tokenizer)
        if len(self.examples) == 0:
            raise ValueError(f"no training examples in {cfg.data.path!r} after tokenising")
        self.target.model.to(acc.device)
        self.resume_from = self._resume_point()
        draft = self._head().to(acc.device)
        self.cache = self._feature_cache(draft)

        o, s = cfg.optim, cfg.schedule
        per_epoch = -(-len(self.examples) // o.batch_size)
        self.total_steps = s.max_steps if s.epochs is None else \
            max(1, math.ceil(s.epochs * per_epoch / (self.world * o.grad_accum)))
        self.optimizer = _optimizer(draft, o)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda n: lr_factor(n, s, self.total_steps))
        self.module, self.optimizer = acc.prepare(TTTLoss(draft, cfg.ttt.steps, cfg.ttt.decay), self.optimizer)
        self.draft = acc.unwrap_model(self.module).draft
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stream = DataStream(self.examples, o.batch_size, cfg.seed, pad_id)
        self.step, self.tokens, self.tokens_rank = 0, 0, 0
        self._restore()

        self.prompts_given = cfg.eval.prompts is not None
        prompts = read_prompts(cfg) if self.main else []
        self.prompt_ids = [self.tokenizer(p, return_tensors="pt")["input_ids"][0][-cfg.eval.max_prompt_tokens:]
                           .to(acc.device) for p in prompts]
        self.logger = self._logger()
        self.evals: list[dict] = []
        self.metrics: dict = {}

    # ------------------------------------------------------------------ setup
    def _resume_point(self) -> Path | None:
        if self.cfg.resume is None:
            return None
        found = latest_checkpoint(self.out_dir) if self.cfg.resume == "latest" else Path(self.cfg.resume)
        if found is None and self.main:
            print(f"[eagle-tree train] resume=latest: no checkpoint under {self.out_dir / 'checkpoints'}; "
                  "starting fresh", flush=True)
        return found

    def _head(self):
        """The head (and its draft vocabulary) from the checkpoint being resumed, a warm start, or fresh."""
        from eagle_tree.models.head import Eagle3DraftModel
        from eagle_tree.training.data import build_draft_vocab

        source = self.resume_from or self.cfg.model.init_from
        if source is not None:
            return Eagle3DraftModel.from_pretrained(source, target=self.target).float().train()
        ids = build_draft_vocab(self.examples, self.target.vocab_size, self.cfg.data.draft_vocab_size)
        return Eagle3DraftModel.from_target(self.target, draft_vocab=ids, layers=self.target.feature_layers,
                                            seed=self.cfg.model.seed).float().train()

    def _feature_cache(self, draft):
        if self.cfg.features.source != "cache":
            return None
        from eagle_tree.training.feature_cache import FeatureCache

        f = self.cfg.features
        return FeatureCache.build(Path(f.cache_dir or self.out_dir / "feature_cache"), self.target, self.examples,
                                  draft.draft_to_target.cpu(), examples_per_shard=f.examples_per_shard,
                                  rank=self.rank, world_size=self.world, barrier=self.acc.wait_for_everyone,
                                  progress=self.cfg.progress and self.main)

    def _restore(self) -> None:
        if self.resume_from is None:
            seed = self.cfg.seed + self.rank
            torch.manual_seed(seed)
            np.random.seed(seed)
            random.seed(seed)
            return
        state = _load_training_state(self.acc, self.resume_from, self.optimizer, self.scheduler)
        progress = state["progress"]
        self.step, self.tokens = state["step"], progress["tokens"]
        self.stream.epoch, self.stream.index = progress["epoch"], progress["index"]
        per_rank = progress.get("tokens_rank", [])
        self.tokens_rank = per_rank[self.rank] if len(per_rank) == self.world else 0
        if self.main:
            print(f"[eagle-tree train] resumed from {self.resume_from} at step {self.step}", flush=True)

    def _logger(self):
        from eagle_tree.utils.tracking import RunLogger

        logger = RunLogger(self.cfg.wandb if self.main else WandbConfig(mode="disabled"), run_config=self.cfg,
                           job_type="train")
        logger.summary({"run/world_size": self.world, "run/mixed_precision": self.precision,
                        "run/total_steps": self.total_steps})
        return logger

    # ------------------------------------------------------------------ phases
    def evaluate(self) -> None:
        """Real acceptance lengths (chain and tree) of the current head, logged with the survival curves."""
        weights = self.acc.get_state_dict(self.module) if self.prompts_given else None  # collective (FSDP)
        if self.main and self.prompt_ids:
            t0 = time.perf_counter()
            head = _full_head(self.draft, weights).to(self.acc.device)
            res = evaluate_acceptance(self.target, head, self.prompt_ids, self.cfg.eval, self.tokenizer.eos_token_id)
            res["step"], res["eval_s"] = self.step, time.perf_counter() - t0
            self.evals.append(res)
            self.logger.log({f"eval/acceptance_length_{m}": res[f"acceptance_length_{m}"] for m in ("chain", "tree")},
                            step=self.step)
            for mode in ("chain", "tree"):
                curve = res[f"survival_{mode}"]
                self.logger.log_line(f"eval/survival_{mode}", list(range(1, len(curve) + 1)), curve,
                                     title=f"Pr(A >= i), {mode}, step {self.step}", x_name="i",
                                     y_name="Pr(A >= i)", step=self.step)
            print(f"[eagle-tree train] step {self.step}: acceptance length chain "
                  f"{res['acceptance_length_chain']:.3f}  tree {res['acceptance_length_tree']:.3f}", flush=True)
        self.acc.wait_for_everyone()

    def train_step(self) -> tuple[list, list, int, float]:
        """One optimiser step over this rank's share of the next world * grad_accum micro-batches."""
        acc, o = self.acc, self.cfg.optim
        mine = self.stream.take(self.world * o.grad_accum)[self.rank::self.world]
        outs, losses, n_tokens = [], [], 0
        for k, batch in enumerate(mine):
            features, logits = batch_targets(batch, target=self.target, cache=self.cache, device=acc.device)
            sync = contextlib.nullcontext() if k == len(mine) - 1 else acc.no_sync(self.module)
            with sync:  # gradients are all-reduced on the last micro-batch only
                loss, out = self.module(features, batch.input_ids.to(acc.device), batch.loss_mask.to(acc.device),
                                        logits, batch.lengths.to(acc.device))
                acc.backward(loss / o.grad_accum)
            outs.append(out)
            losses.append(loss)
            n_tokens += int(batch.lengths.sum())
        if o.grad_clip > 0:
            acc.clip_grad_norm_(self.module.parameters(), o.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return outs, losses, n_tokens, lr

    def _tokens_per_rank(self) -> list[int]:
        return _gather_object(self.acc, self.tokens_rank)

    def checkpoint(self) -> None:
        progress = {**self.stream.position(), "tokens": self.tokens, "tokens_rank": self._tokens_per_rank()}
        ckpt = _save_checkpoint(self.acc, self.cfg, self.module, self.draft, self.optimizer, self.scheduler,
                                progress, self.step)
        if self.main:
            self._log_head(ckpt, f"head-step-{self.step}")

    def _log_head(self, head_dir: Path, name: str) -> None:
        """A W&B model artifact for a saved head, with the run config and the latest measured acceptance."""
        from eagle_tree.models.export import log_head_artifact

        latest = self.evals[-1]["acceptance_length_tree"] if self.evals else None
        log_head_artifact(self.logger, head_dir, name, self.cfg, latest)

    def run(self) -> TrainResult:
        from tqdm.auto import tqdm

        cfg, acc = self.cfg, self.acc
        if cfg.eval.at_start and self.step == 0:
            self.evaluate()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.main and cfg.progress))
        start = time.perf_counter()
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            outs, losses, n_tokens, lr = self.train_step()
            self.step += 1
            self.tokens_rank += n_tokens
            if self.world > 1:
                n_tokens = int(acc.reduce(torch.tensor(n_tokens, device=acc.device), reduction="sum"))
            self.tokens += n_tokens
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                tokens_per_s = n_tokens / max(time.perf_counter() - t0, 1e-9)
                self.metrics = _step_metrics(outs, losses, cfg.ttt.steps, acc)
                self.metrics.update({"train/lr": lr, "train/tokens_per_s": tokens_per_s, "train/tokens": self.tokens,
                                     "train/epoch": self.stream.epoch})
                self.logger.log(self.metrics, step=self.step)
                bar.set_postfix(loss=f"{self.metrics['train/loss']:.3f}", acc0=f"{self.metrics['train/acc_0']:.2f}",
                                tok_s=f"{self.metrics['train/tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < self.total_steps:
                self.evaluate()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self.checkpoint()
        bar.close()
        wall = time.perf_counter() - start
        if cfg.eval.at_end:
            self.evaluate()
        return self.finish(wall)

    def finish(self, wall: float) -> TrainResult:
        """Save the final head (DIR/final, with the resolved config), the summary, and close the W&B run."""
        from eagle_tree.utils.config import save_config

        tokens_per_rank = self._tokens_per_rank()
        weights = self.acc.get_state_dict(self.module)
        final_dir = self.out_dir / "final"
        if self.main:
            _full_head(self.draft, weights).save_pretrained(final_dir)
            save_config(self.cfg, final_dir / CONFIG_NAME)
            _save_untuned_decoding_defaults(final_dir, self.cfg.eval)
            summary = {"steps": self.step, "tokens": self.tokens, "wall_s": round(wall, 2), "world_size": self.world,
                       "tokens_per_rank": tokens_per_rank, "mixed_precision": self.precision,
                       "final_metrics": self.metrics, "evals": self.evals, "final_dir": str(final_dir)}
            (self.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            self.logger.summary(self.metrics)
            if self.evals:
                self.logger.summary({f"eval/acceptance_length_{m}": self.evals[-1][f"acceptance_length_{m}"]
                                     for m in ("chain", "tree")})
            self._log_head(final_dir, "head-final")
        run_dir = self.logger.run_dir
        self.logger.finish()
        self.acc.wait_for_everyone()
        return TrainResult(output_dir=self.out_dir, final_dir=final_dir, steps=self.step, tokens=self.tokens,
                           wall_s=wall, metrics=self.metrics, evals=self.evals, run_dir=run_dir,
                           world_size=self.world, tokens_per_rank=tokens_per_rank)
