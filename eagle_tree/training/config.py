"""The training config schema: ``TrainConfig`` and its sections, parsed by eagle_tree.utils.config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from eagle_tree.data.toy import ToyConfig
from eagle_tree.models.prepack import PrepackSetting
from eagle_tree.training.data import DataConfig
from eagle_tree.utils.checks import check_ranges
from eagle_tree.utils.config import ConfigValueError
from eagle_tree.utils.tracking import WandbConfig

__all__ = ["TargetSection", "ModelSection", "OptimSection", "ScheduleSection", "TTTSection", "FeatureSection",
           "EvalSection", "CheckpointSection", "TrainConfig"]


@dataclass
class TargetSection:
    """The frozen target model."""

    path: str = "toy"
    """'toy' (a tiny target with learnable structure, built locally by eagle_tree.data.toy), or a local folder /
    hub id loaded with AutoModelForCausalLM + AutoTokenizer"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the target is loaded and run in (features are cached in it)"""
    feature_layers: list[int] | None = None
    """the three layers whose input hidden states are fused (default 2, L//2, L-3): ascending, distinct, each in
    [1, L-1]; deeper choices such as [2, L//2, L-1] let the head see the last layers"""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """attention implementation of the target"""
    prepack: PrepackSetting = False
    """oneDNN-packed copies of the target's float32 CPU linear layers for its forwards (feature extraction,
    evaluation decoding; eagle_tree.models.prepack): a 500-token forward 1.9x faster on a host whose BLAS is slow
    for these shapes (docs/MEASURING.md, "The rest of the pipeline on the same host"); "auto": timed both ways
    at load, the faster kept; a kernel choice, not part of the feature cache's fingerprint"""
    toy: ToyConfig = field(default_factory=ToyConfig)
    """the toy target (path=toy)"""
    toy_cache_dir: str | None = None
    """where toy targets are cached (default $EAGLE_TREE_CACHE/toy or ~/.cache/eagle_tree/toy)"""


    def __post_init__(self) -> None:
        if self.feature_layers is not None:
            from eagle_tree.models.head_config import check_feature_layers  # lazy: models imports transformers

            try:
                check_feature_layers(self.feature_layers)
            except ValueError as exc:
                raise ConfigValueError("feature_layers", f"is not valid: {exc}") from None


def _init_parts() -> tuple[str, ...]:
    from eagle_tree.models.head_init import INIT_PARTS  # lazy: models imports transformers

    return INIT_PARTS


@dataclass
class ModelSection:
    """The draft head."""

    init_from: str | None = None
    """warm start: load the weights (and draft vocabulary) of this head folder; optimiser, schedule and data position
    start fresh"""
    seed: int = 0
    """seed of the head's initialisation"""
    init: Literal["random", "target"] = "random"
    """a fresh head's weights: random, or copied from the target where shapes allow (init_parts)"""
    init_parts: list[str] = field(default_factory=lambda: list(_init_parts()))
    """with init=target, the parts copied: lm_head (the draft vocabulary's rows), norm (the final norm), mlp (the
    last layer's MLP and norms), fc (a pass-through of the high feature)"""

    def __post_init__(self) -> None:
        check_ranges(self, seed=0)
        from eagle_tree.models.head_init import check_init_parts

        try:
            check_init_parts(self.init_parts)
        except ValueError as exc:
            raise ConfigValueError("init_parts", f"is not valid: {exc}") from None


@dataclass
class OptimSection:
    """Optimiser and precision."""

    lr: float = 3e-4
    """peak learning rate (AdamW)"""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas"""
    eps: float = 1e-8
    """AdamW epsilon"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not norms)"""
    grad_clip: float = 1.0
    """clip the gradient norm to this (0: no clipping)"""
    batch_size: int = 8
    """examples per micro-batch per process"""
    grad_accum: int = 1
    """micro-batches accumulated per optimiser step"""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """autocast precision of the head's forward (no, bf16, fp16); falls back to 'no' with a notice where the device
    lacks it (fp16 on CPU, bf16 on CPUs without bf16 instructions)"""

    def __post_init__(self) -> None:
        check_ranges(self, lr=0.0, eps=0.0, weight_decay=0.0, grad_clip=0.0, batch_size=1, grad_accum=1)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigValueError("betas", f"must lie in [0, 1), got {list(self.betas)}")


@dataclass
class ScheduleSection:
    """Length of the run and the learning-rate schedule."""

    max_steps: int = 1000
    """optimiser steps (ignored when epochs is set)"""
    epochs: float | None = None
    """passes over the data; sets max_steps"""
    max_minutes: float | None = None
    """a wall-clock budget of optimiser steps (evaluations not counted): the first steps are timed and the budget
    turned into a step count (recorded in train_summary.json and kept on resume); sets max_steps"""
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warm-up: cosine or linear down to min_lr_ratio * lr, or constant"""
    warmup_steps: int = 50
    """linear warm-up steps from lr / warmup_steps"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of lr"""

    def __post_init__(self) -> None:
        check_ranges(self, max_steps=1, warmup_steps=0)
        if self.epochs is not None and not 0 < self.epochs < math.inf:
            raise ConfigValueError("epochs", f"must be a finite number > 0 (or null), got {self.epochs!r}")
        if self.max_minutes is not None and not 0 < self.max_minutes < math.inf:
            raise ConfigValueError("max_minutes", f"must be a finite number > 0 (or null), got {self.max_minutes!r}")
        if self.max_minutes is not None and self.epochs is not None:
            raise ConfigValueError("max_minutes", "cannot be combined with epochs: both set the step count; "
                                   "set one of them")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigValueError("min_lr_ratio", f"must lie in [0, 1], got {self.min_lr_ratio!r}")


@dataclass
class TTTSection:
    """The training-time test (ttt.ttt_forward)."""

    steps: int = 3
    """unrolled draft steps per position (3: the reference study's winner at equal minutes, docs/TRAINING.md;
    deeper drafts than steps + 1 levels are drafted by a head never trained that deep)"""
    decay: float = 0.8
    """weight of step s is decay ** s"""

    def __post_init__(self) -> None:
        check_ranges(self, steps=1)
        if not 0.0 < self.decay <= 1.0:
            raise ConfigValueError("decay", f"must lie in (0, 1], got {self.decay!r}")


@dataclass
class FeatureSection:
    """Where target features and distributions come from."""

    source: Literal["online", "cache"] = "online"
    """online: target forward under no_grad in the loop; cache: written once to cache_dir (resumable, fingerprinted)
    and read back"""
    cache_dir: str | None = None
    """feature cache folder (default OUTPUT_DIR/feature_cache)"""
    examples_per_shard: int = 256
    """examples per safetensors shard"""
    reuse_from: list[str] = field(default_factory=list)
    """earlier feature caches (folders) whose shards this build may take instead of computing them: a shard
    whose examples, target, draft vocabulary, shard size and feature dtype all match (a dataset that grew by
    appending pays only for its new shards); hard links where the file system allows"""

    def __post_init__(self) -> None:
        check_ranges(self, examples_per_shard=1)


@dataclass
class EvalSection:
    """Real acceptance length measured with SpeculativeDecoder (greedy) on held-out prompts."""

    every: int = 0
    """evaluate every N optimiser steps (0: only at the end)"""
    every_minutes: float | None = None
    """also evaluate each time the training time (optimiser steps only) crosses a multiple of this many minutes:
    points at equal minutes for runs of different step times (null: by steps only)"""
    at_start: bool = False
    """also evaluate the untrained head at step 0"""
    at_end: bool = True
    """evaluate the final head"""
    prompts: str | None = None
    """held-out prompts: .jsonl with a 'prompt' field or .txt one per line; 'toy' for the toy's; null: no decoding
    evaluation"""
    num_prompts: int = 8
    """use the first N prompts"""
    max_prompt_tokens: int = 256
    """keep the last N tokens of a longer prompt"""
    max_new_tokens: int = 64
    """output budget per prompt"""
    chain_length: int = 5
    """draft tokens per round in chain mode"""
    tree_depth: int = 6
    """tree mode: levels below the root"""
    tree_top_k: int = 8
    """tree mode: children per expanded node"""
    tree_total_tokens: int = 48
    """tree mode: nodes kept after the rerank"""
    agreement: bool = True
    """also measure the head's top-1 agreement with the target per draft step (eval/acc_S) on the greedy
    continuations of the held-out prompts (the target's own text, which the acceptance length is measured on),
    and on the same text its sampled acceptance per step (eval/sampled_acc_S: the mean of sum_v min(p, q) at
    temperature 1, the probability that one token sampled from the head is accepted there)"""
    copy_prompts: str | None = None
    """the copying check: 'code' or 'toy' (prompts that repeat a span of their context, generated by
    eagle_tree.data.copying), or a prompt file; logged as eval/acceptance_length_copy_chain; null: none"""
    copy_num_prompts: int = 8
    """copying prompts used"""
    copy_chain_length: int = 6
    """draft tokens per round of the chain on the copying prompts"""
    copy_max_new_tokens: int = 48
    """output budget per copying prompt"""

    def __post_init__(self) -> None:
        if self.every_minutes is not None and not 0 < self.every_minutes < math.inf:
            raise ConfigValueError("every_minutes",
                                   f"must be a finite number > 0 (or null), got {self.every_minutes!r}")
        check_ranges(self, every=0, num_prompts=1, max_prompt_tokens=1, max_new_tokens=1, chain_length=1, tree_depth=1,
                 tree_top_k=1, tree_total_tokens=1, copy_num_prompts=1, copy_chain_length=1, copy_max_new_tokens=1)


@dataclass
class CheckpointSection:
    """Checkpoints under OUTPUT_DIR/checkpoints/step-N."""

    every: int = 0
    """save every N optimiser steps (0: only the final head)"""
    keep_last: int | None = 2
    """keep the newest N checkpoints (null: all)"""

    def __post_init__(self) -> None:
        check_ranges(self, every=0, keep_last=1)


@dataclass
class TrainConfig:
    """Train an EAGLE-3 draft head with the training-time test."""

    output_dir: str = "runs/train"
    """run folder: checkpoints/step-N, final (the head), config.yaml, train_summary.json"""
    target: TargetSection = field(default_factory=TargetSection)
    """the frozen target"""
    data: DataConfig = field(default_factory=lambda: DataConfig(path="toy"))
    """training data (data.DataConfig); path 'toy' = the toy corpus, 'stdlib:MANIFEST#SPLIT' = a split of the
    standard-library corpus pinned by a corpus manifest"""
    model: ModelSection = field(default_factory=ModelSection)
    """the draft head"""
    optim: OptimSection = field(default_factory=OptimSection)
    """optimiser and precision"""
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    """steps and schedule"""
    ttt: TTTSection = field(default_factory=TTTSection)
    """training-time test"""
    features: FeatureSection = field(default_factory=FeatureSection)
    """online or cached"""
    eval: EvalSection = field(default_factory=EvalSection)
    """acceptance-length evaluation"""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """checkpoints"""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging"""
    overwrite: bool = False
    """start a new run in an output_dir that holds another run's checkpoints or final head, deleting that run's
    checkpoints, final head and summary (other files are kept); without it such a folder is refused"""
    resume: str | None = None
    """'latest' (newest checkpoint under output_dir, or a fresh start if none) or a checkpoint folder: restores head,
    optimiser, schedule, RNG and data position"""
    seed: int = 0
    """seed of the data order and of the RNGs"""
    cpu: bool = False
    """run on CPU even when an accelerator is present"""
    threads: int | None = None
    """torch CPU threads per process (null: torch's)"""
    log_every: int = 1
    """log training metrics every N steps"""
    progress: bool = True
    """show a tqdm progress bar"""

    def __post_init__(self) -> None:
        check_ranges(self, seed=0, threads=1, log_every=1)
        if self.resume is not None and self.overwrite:
            raise ConfigValueError("overwrite", "cannot be combined with resume: resume continues the run in "
                                   "output_dir, overwrite deletes it")

