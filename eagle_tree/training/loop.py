"""The training loop of an EAGLE-3 head, read top to bottom: ``train(cfg)``, then the loop itself
(``_Run.loop``), then one optimiser step, evaluation, checkpoint and the final head, then the setup. The
pieces live beside it: the schema in ``config``, the micro-batches in ``stream``, checkpoint I/O in
``checkpoint``, the time budget and time-based evaluation in ``budget``, the run folder's identity, lock
and resume checks in ``rundir``, the target / data / prompts in ``resolve``, evaluation in ``evaluate``,
and the optimiser and schedule in ``eagle_tree.utils.optim``.

Flow (docs/ARCHITECTURE.md, "Training flow")::

    examples (data.py) -> per micro-batch: target features + logits, online (feature_cache.example_targets
    under no_grad) or from a FeatureCache -> ttt_forward (the training-time test) -> accelerate
    (one CPU process up to DDP / FSDP, mixed precision, gradient accumulation, clipping, warm-up and
    cosine / linear decay) -> checkpoints (atomic, full resume) -> W&B (RunLogger) with the real
    acceptance length measured by SpeculativeDecoder every ``eval.every`` steps.

Data order. Micro-batches come from ``data.batches(examples, optim.batch_size, seed, epoch)`` epoch after
epoch (length-grouped with ``data.length_grouping``); optimiser step ``n`` consumes the next
``world * grad_accum`` of them, micro-batch ``k`` of the step going to rank ``k % world`` (accumulation
slot ``k // world``). The position (epoch, batch) is saved in every checkpoint, so a resumed run sees
exactly the batches the uninterrupted run would have.
With this order, two DDP processes give the same update as one process with twice the accumulation.

Loss normalisation: each micro-batch's loss is ttt_forward's (per-step mean over its valid positions,
weighted ``decay ** s``); micro-batches and ranks are averaged with equal weight.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eagle_tree.data.rows import DataError
from eagle_tree.training.budget import BUDGET_PROBE_STEPS, EvalClock, StepBudget
from eagle_tree.training.checkpoint import (
    CONFIG_NAME,
    STATE_NAME,
    full_head,
    gather_object,
    latest_checkpoint,
    load_training_state,
    prune_checkpoints,
    read_training_state,
    save_checkpoint,
)
from eagle_tree.training.config import EvalSection, TrainConfig
from eagle_tree.training.evaluate import evaluate_acceptance
from eagle_tree.training.feature_cache import FeatureCache
from eagle_tree.training.resolve import initial_head, load_target, read_copy_prompts, read_prompts, resolve_data
from eagle_tree.training.rundir import RunLock, claim_output_dir, resume_changes
from eagle_tree.training.sharding import cpu_fsdp_requested, full_state_dict, shard
from eagle_tree.training.stream import DataStream, batch_targets
from eagle_tree.training.ttt import simulated_acceptance_length, ttt_forward
from eagle_tree.utils.atomic import write_text
from eagle_tree.utils.checks import nonfinite_weights
from eagle_tree.utils.config import save_config
from eagle_tree.utils.optim import adamw, lambda_schedule
from eagle_tree.utils.tracking import RunLogger, WandbConfig

__all__ = ["TrainResult", "TrainingDiverged", "train", "resolve_mixed_precision", "TTTLoss", "BUDGET_PROBE_STEPS"]


class TrainingDiverged(RuntimeError):
    """The loss or the weights became NaN or infinite; the message names the step and the last good checkpoint."""


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


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) the training described by ``cfg``; returns where the head went and the last figures."""
    old_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    run = None
    try:
        run = _Run(cfg)
        return run.loop()
    finally:
        if run is not None:
            run.lock.release()
        torch.set_num_threads(old_threads)


class _Run:
    """One training run: the loop first, then its phases (step, evaluate, checkpoint, finish), then setup."""

    def loop(self) -> TrainResult:
        """Evaluate at the start, then optimiser steps until the step count, with logging, evaluations
        (every eval.every steps or eval.every_minutes of training time) and checkpoints; then the final head."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        if cfg.eval.at_start and self.step == 0:
            self.evaluate()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.main and cfg.progress))
        start = time.perf_counter()
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            outs, losses, n_tokens, lr = self.train_step()
            self.step += 1
            seconds = time.perf_counter() - t0
            self.train_s += seconds
            if self.budget.record(seconds, self._mean_over_ranks):
                self._budget_resolved()
                bar.total = self.total_steps
            self._check_finite(losses)
            self.tokens_rank += n_tokens
            n_tokens = self._sum_over_ranks(n_tokens)
            self.tokens += n_tokens
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                self._log_step(outs, losses, lr, n_tokens / max(time.perf_counter() - t0, 1e-9), bar)
            bar.update(1)
            by_steps = bool(cfg.eval.every) and self.step % cfg.eval.every == 0
            if (by_steps or self.eval_clock.due(self.train_s)) and self.step < self.total_steps:
                self.evaluate()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self.checkpoint()
        bar.close()
        wall = time.perf_counter() - start
        if cfg.eval.at_end:
            self.evaluate()
        return self.finish(wall)

    # ------------------------------------------------------------------ phases
    def train_step(self) -> tuple[list, list, int, float]:
        """One optimiser step over this rank's share of the next world * grad_accum micro-batches."""
        acc, o = self.acc, self.cfg.optim
        mine = self.stream.take(self.world * o.grad_accum)[self.rank::self.world]
        outs, losses, n_tokens = [], [], 0
        for k, batch in enumerate(mine):
            features, logits = batch_targets(batch, target=self.target, cache=self.cache, device=acc.device,
                                             draft=self.draft)
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

    def _log_step(self, outs: list, losses: list[torch.Tensor], lr: float, tokens_per_s: float, bar) -> None:
        self.metrics = step_metrics(outs, losses, self.cfg.ttt.steps, self.acc)
        self.metrics.update({"train/lr": lr, "train/tokens_per_s": tokens_per_s, "train/tokens": self.tokens,
                             "train/epoch": self.stream.epoch})
        self.logger.log(self.metrics, step=self.step)
        bar.set_postfix(loss=f"{self.metrics['train/loss']:.3f}", acc0=f"{self.metrics['train/acc_0']:.2f}",
                        tok_s=f"{self.metrics['train/tokens_per_s']:.0f}", refresh=False)

    def _budget_resolved(self) -> None:
        """schedule.max_minutes has just become a step count: report it."""
        self.total_steps = self.budget.total_steps(self.total_steps)
        step_s = self.budget.measured_step_s
        self.logger.summary({"run/total_steps": self.total_steps, "run/measured_step_s": step_s})
        if self.main:
            print(f"[eagle-tree train] schedule.max_minutes={self.budget.max_minutes:g}: {step_s:.3f} s/step -> "
                  f"{self.total_steps} steps", flush=True)

    def _sum_over_ranks(self, n: int) -> int:
        if self.world == 1:
            return n
        return int(self.acc.reduce(torch.tensor(n, device=self.acc.device), reduction="sum"))

    def _mean_over_ranks(self, x: float) -> float:
        if self.world == 1:
            return x
        return float(self.acc.reduce(torch.tensor(x, device=self.acc.device), reduction="mean"))

    def _check_finite(self, losses: list[torch.Tensor]) -> None:
        """Stop at the first step whose loss or updated weights are not finite (on any rank)."""
        loss_ok = bool(torch.isfinite(torch.stack([loss.detach().float() for loss in losses])).all())
        bad = [] if not loss_ok else nonfinite_weights(self.draft)
        flag = torch.tensor(float(not loss_ok or bool(bad)), device=self.acc.device)
        if self.world > 1:
            flag = self.acc.reduce(flag, reduction="sum")
        if float(flag) == 0:
            return
        what = "the loss is not finite" if not loss_ok else f"weights became non-finite ({', '.join(bad[:3])})"
        if self.world > 1 and loss_ok and not bad:
            what = "another process saw a non-finite loss or weights"
        last = latest_checkpoint(self.out_dir)
        kept = f"the last good checkpoint is {last}" if last is not None else "no checkpoint was written yet"
        raise TrainingDiverged(
            f"training diverged at step {self.step}: {what}; stopped without saving this step ({kept}). "
            "Lower optim.lr, raise schedule.warmup_steps or set optim.grad_clip, then start again or resume "
            "from an earlier checkpoint (resume=CHECKPOINT)")

    def evaluate(self) -> None:
        """Real acceptance lengths (chain and tree) of the current head, logged with the survival curves."""
        weights = full_state_dict(self.acc, self.module) if self.prompts_given else None  # collective (FSDP)
        if self.main and (self.prompt_ids or self.copy_ids):
            t0 = time.perf_counter()
            head = full_head(self.draft, weights).to(self.acc.device)
            res = evaluate_acceptance(self.target, head, self.prompt_ids, self.cfg.eval, self.tokenizer.eos_token_id,
                                      copy_ids=self.copy_ids,
                                      agreement_steps=self.cfg.ttt.steps if self.cfg.eval.agreement else 0)
            res["step"], res["eval_s"] = self.step, time.perf_counter() - t0
            res["train_minutes"] = self.train_s / 60
            self.evals.append(res)
            scalars = {f"eval/acceptance_length_{m}": res[f"acceptance_length_{m}"]
                       for m in ("chain", "tree", "copy_chain") if f"acceptance_length_{m}" in res}
            scalars |= {f"eval/acc_{s}": a for s, a in enumerate(res.get("agreement", []))}
            scalars |= {f"eval/sampled_acc_{s}": a for s, a in enumerate(res.get("overlap", []))}
            self.logger.log({**scalars, "eval/train_minutes": res["train_minutes"]}, step=self.step)
            for mode in ("chain", "tree", "copy_chain"):
                if f"survival_{mode}" not in res:
                    continue
                curve = res[f"survival_{mode}"]
                self.logger.log_line(f"eval/survival_{mode}", list(range(1, len(curve) + 1)), curve,
                                     title=f"Pr(A >= i), {mode}, step {self.step}", x_name="i",
                                     y_name="Pr(A >= i)", step=self.step)
            print(f"[eagle-tree train] step {self.step}: " + "  ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in scalars.items()), flush=True)
        self.acc.wait_for_everyone()

    def checkpoint(self) -> None:
        progress = {**self.stream.position(), "tokens": self.tokens, "tokens_rank": self._tokens_per_rank(),
                    "budget": self.budget.resolved, "train_s": self.train_s}
        ckpt = save_checkpoint(self.acc, self.cfg, self.module, self.draft, self.optimizer, self.scheduler,
                               progress, self.step, self.run_id or "")
        if self.main:
            prune_checkpoints(self.out_dir, self.cfg.checkpoint.keep_last, self.run_id)
            self._log_head(ckpt, f"head-step-{self.step}")

    def _tokens_per_rank(self) -> list[int]:
        return gather_object(self.acc, self.tokens_rank)

    def _log_head(self, head_dir: Path, name: str) -> None:
        """A W&B model artifact for a saved head, with the run config and the latest measured acceptance."""
        from eagle_tree.models.export import log_head_artifact

        latest = self.evals[-1].get("acceptance_length_tree") if self.evals else None
        log_head_artifact(self.logger, head_dir, name, self.cfg, latest)

    def finish(self, wall: float) -> TrainResult:
        """Save the final head (DIR/final, with the resolved config), the summary, and close the W&B run."""
        tokens_per_rank = self._tokens_per_rank()
        weights = full_state_dict(self.acc, self.module)
        final_dir = self.out_dir / "final"
        if self.main:
            full_head(self.draft, weights).save_pretrained(final_dir)
            save_config(self.cfg, final_dir / CONFIG_NAME)
            _save_untuned_decoding_defaults(final_dir, self.cfg.eval)
            summary = {"steps": self.step, "tokens": self.tokens, "wall_s": round(wall, 2), "world_size": self.world,
                       "tokens_per_rank": tokens_per_rank, "mixed_precision": self.precision,
                       "final_metrics": self.metrics, "evals": self.evals, "final_dir": str(final_dir),
                       "budget": self.budget.resolved, "train_s": self.train_s}
            write_text(self.out_dir / "train_summary.json", json.dumps(summary, indent=1) + "\n")
            self.logger.summary(self.metrics)
            if self.evals:
                self.logger.summary({f"eval/acceptance_length_{m}": self.evals[-1][f"acceptance_length_{m}"]
                                     for m in ("chain", "tree", "copy_chain")
                                     if f"acceptance_length_{m}" in self.evals[-1]})
            self._log_head(final_dir, "head-final")
        run_dir = self.logger.run_dir
        self.logger.finish()
        self.acc.wait_for_everyone()
        return TrainResult(output_dir=self.out_dir, final_dir=final_dir, steps=self.step, tokens=self.tokens,
                           wall_s=wall, metrics=self.metrics, evals=self.evals, run_dir=run_dir,
                           world_size=self.world, tokens_per_rank=tokens_per_rank)

    # ------------------------------------------------------------------ setup
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.acc, self.precision = _make_accelerator(cfg)
        acc = self.acc
        self.main, self.rank, self.world = acc.is_main_process, acc.process_index, acc.num_processes
        self.out_dir = Path(cfg.output_dir)
        self.lock = RunLock(self.out_dir)
        if self.main:
            self.lock.acquire()
        try:
            self._setup()
        except BaseException:
            self.lock.release()
            raise

    def _setup(self) -> None:
        cfg, acc = self.cfg, self.acc
        self.resume_from = self._resume_point()
        self.run_id = None
        if self.main:
            self._check_resume()
            self.run_id = claim_output_dir(cfg, self.resume_from).run_id
            save_config(cfg, self.out_dir / CONFIG_NAME)
        with acc.main_process_first():  # the toy target and the datasets cache are built once
            self.target, self.tokenizer = load_target(cfg)
            self.examples = resolve_data(cfg).load(self.tokenizer)
        if len(self.examples) == 0:
            raise DataError(f"no training examples in {cfg.data.path!r} after tokenising (every row empty, too "
                            "long with data.too_long=drop, or without a loss token)")
        self.target.model.to(acc.device)
        draft = self._head().to(acc.device)
        self.cache = self._feature_cache(draft)

        o, s = cfg.optim, cfg.schedule
        per_epoch = -(-len(self.examples) // o.batch_size)
        planned = s.max_steps if s.epochs is None else \
            max(1, math.ceil(s.epochs * per_epoch / (self.world * o.grad_accum)))
        self.budget = StepBudget(s.max_minutes)  # with max_minutes: resolved after the first steps (or restored)
        self.total_steps = self.budget.total_steps(planned)
        self.train_s = 0.0  # seconds spent in optimiser steps (evaluations and checkpoints not counted)
        self.eval_clock = EvalClock(cfg.eval.every_minutes)
        module = TTTLoss(draft, cfg.ttt.steps, cfg.ttt.decay)
        cpu_fsdp = cpu_fsdp_requested(acc)
        if cpu_fsdp:  # accelerate would use DDP here: shard with torch's fully_shard (training/sharding.py)
            if self.main:
                print("[eagle-tree train] FSDP on CPU processes: the head sharded by torch's fully_shard", flush=True)
            shard(module)  # before the optimiser sees the parameters
        self.optimizer = adamw(draft, o.lr, o.weight_decay, o.betas, o.eps)
        self.scheduler = lambda_schedule(self.optimizer, s.warmup_steps, lambda: self.total_steps, s.kind,
                                         s.min_lr_ratio)
        if cpu_fsdp:
            self.module = module
        else:
            self.module, self.optimizer = acc.prepare(module, self.optimizer)
        self.draft = acc.unwrap_model(self.module).draft
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stream = DataStream(self.examples, o.batch_size, cfg.seed, pad_id,
                                 length_grouping=cfg.data.length_grouping)
        self.step, self.tokens, self.tokens_rank = 0, 0, 0
        self._restore()

        self.prompts_given = cfg.eval.prompts is not None or cfg.eval.copy_prompts is not None
        prompts = read_prompts(cfg) if self.main else []
        self.prompt_ids = [self.tokenizer(p, return_tensors="pt")["input_ids"][0][-cfg.eval.max_prompt_tokens:]
                           .to(acc.device) for p in prompts]
        copies = read_copy_prompts(cfg) if self.main else []
        self.copy_ids = [self.tokenizer(p, return_tensors="pt")["input_ids"][0].to(acc.device) for p in copies]
        self.logger = self._logger()
        self.evals: list[dict] = []
        self.metrics: dict = {}

    def _resume_point(self) -> Path | None:
        self.resume_state = None
        if self.cfg.resume is None:
            return None
        found = latest_checkpoint(self.out_dir) if self.cfg.resume == "latest" else Path(self.cfg.resume)
        if found is None and self.main:
            print(f"[eagle-tree train] resume=latest: no checkpoint under {self.out_dir / 'checkpoints'}; "
                  "starting fresh", flush=True)
        if found is not None and not (found / STATE_NAME).is_file():
            raise FileNotFoundError(f"resume={self.cfg.resume}: {found} is not a checkpoint (no {STATE_NAME}); "
                                    f"give a folder OUTPUT_DIR/checkpoints/step-N, or resume=latest")
        if found is not None:  # read safely and checked before the run folder is touched
            self.resume_state = read_training_state(found, self.rank)
        return found

    def _check_resume(self) -> None:
        """Every setting that differs from the checkpoint's, with whether it takes effect (or a refusal)."""
        if self.resume_from is None:
            return
        name = self.resume_from.name
        step = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else 0
        changes = resume_changes(self.cfg, self.resume_from, step)
        if changes:
            print(f"[eagle-tree train] resuming {self.resume_from} with changed settings:\n" + "\n".join(changes),
                  flush=True)

    def _head(self):
        """The head (and its draft vocabulary) from the checkpoint being resumed, a warm start, or fresh."""
        return initial_head(self.cfg, self.target, self.examples, source=self.resume_from, report=self.main)

    def _feature_cache(self, draft):
        if self.cfg.features.source != "cache":
            return None
        f = self.cfg.features
        return FeatureCache.build(Path(f.cache_dir or self.out_dir / "feature_cache"), self.target, self.examples,
                                  draft.draft_to_target.cpu(), examples_per_shard=f.examples_per_shard,
                                  rank=self.rank, world_size=self.world, barrier=self.acc.wait_for_everyone,
                                  progress=self.cfg.progress and self.main, reuse_from=f.reuse_from)

    def _restore(self) -> None:
        if self.resume_from is None:
            seed = self.cfg.seed + self.rank
            torch.manual_seed(seed)
            np.random.seed(seed)
            random.seed(seed)
            return
        state = load_training_state(self.acc, self.resume_from, self.optimizer, self.scheduler, self.resume_state)
        progress = state["progress"]
        self.step, self.tokens = state["step"], progress["tokens"]
        self.train_s = progress.get("train_s", 0.0)
        self.eval_clock.restore(self.train_s)
        if self.budget.max_minutes is not None and progress.get("budget"):  # the step count timed at the start
            self.budget.resolved = progress["budget"]
            self.total_steps = self.budget.total_steps(self.total_steps)
        self.stream.epoch, self.stream.index = progress["epoch"], progress["index"]
        per_rank = progress.get("tokens_rank", [])
        self.tokens_rank = per_rank[self.rank] if len(per_rank) == self.world else 0
        if self.main:
            print(f"[eagle-tree train] resumed from {self.resume_from} at step {self.step}", flush=True)

    def _logger(self):
        logger = RunLogger(self.cfg.wandb if self.main else WandbConfig(mode="disabled"), run_config=self.cfg,
                           job_type="train")
        logger.summary({"run/world_size": self.world, "run/mixed_precision": self.precision,
                        "run/total_steps": self.total_steps})
        return logger


# ---------------------------------------------------------------------------------------------- pieces
def step_metrics(outs: list, losses: list[torch.Tensor], steps: int, acc) -> dict:
    """Training metrics of one optimiser step over every micro-batch and rank, each position's accuracy
    and loss weighted by its count of valid positions; the loss is the mean over micro-batches."""
    def per_position(value) -> torch.Tensor:  # (steps,) float64: the sum over micro-batches of count * value
        return torch.tensor([sum(value(out, s) * out.step_counts[s] for out in outs) for s in range(steps)],
                            dtype=torch.float64)

    sums = {
        "correct": per_position(lambda out, s: out.step_accuracy[s]),
        "loss": per_position(lambda out, s: out.step_losses[s]),
        "count": torch.tensor([sum(out.step_counts[s] for out in outs) for s in range(steps)], dtype=torch.float64),
        "batch_loss": torch.tensor(sum(float(loss.detach()) for loss in losses), dtype=torch.float64),
        "batches": torch.tensor(float(len(losses)), dtype=torch.float64),
    }
    if acc.num_processes > 1:
        sums = {k: acc.reduce(v.to(acc.device), reduction="sum").cpu() for k, v in sums.items()}
    counts = sums["count"].clamp_min(1)
    accuracy = (sums["correct"] / counts).tolist()
    metrics = {"train/loss": float(sums["batch_loss"] / sums["batches"])}
    metrics.update({f"train/acc_{s}": accuracy[s] for s in range(steps)})
    metrics.update({f"train/loss_{s}": float(sums["loss"][s] / counts[s]) for s in range(steps)})
    metrics["train/sim_acceptance_length"] = simulated_acceptance_length(accuracy)
    return metrics


class TTTLoss(nn.Module):
    """The head wrapped so that DDP / FSDP see one ``forward``: inputs -> (loss, TTTOutput)."""

    def __init__(self, draft, steps: int, decay: float):
        super().__init__()
        self.draft, self.steps, self.decay = draft, steps, decay

    def forward(self, features, input_ids, loss_mask, target_logits, lengths):
        features = features.to(self.draft.fc.weight.dtype)
        out = ttt_forward(self.draft, features, input_ids, loss_mask, target_logits, self.steps, self.decay, lengths)
        out.logits = []  # (B, T, Vd) per step: autograd keeps what backward needs, drop the rest now
        return out.loss, out


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


def _save_untuned_decoding_defaults(folder: Path, ev: EvalSection) -> None:
    """decoding.json beside the final head: the evaluation's tree shape, marked untuned (the bench's
    tuning with head_defaults=true replaces it with measured shapes)."""
    from eagle_tree.decoding.drafting import TreeConfig
    from eagle_tree.decoding.shapes import save_decoding_defaults

    tree = TreeConfig(depth=ev.tree_depth, top_k=ev.tree_top_k, total_tokens=ev.tree_total_tokens)
    save_decoding_defaults(folder, tree, greedy=True, by="training", tuned=False)
