"""Reference models trained on the standard-library corpus: tokenizer, Llama target, assistant LM.

The pieces a recipe (``train/build_reference.py``) strings together:

- :func:`train_tokenizer`: a byte-level BPE wrapped as a ``PreTrainedTokenizerFast`` that adds
  ``<|bos|>`` in front of every encoded text; files are joined as ``<|bos|> text <|eos|>``.
- :func:`encode_files` / :func:`pack`: one token stream, cut into fixed-length rows.
- :func:`build_llama` and :func:`train_lm`: a seeded AdamW loop (betas 0.9/0.95, linear warm-up
  then cosine decay, gradient clipping) with a tqdm bar, periodic held-out evaluation on the
  tuning split and an atomic, resumable checkpoint.
- :func:`evaluate_loss`, :func:`greedy_samples`, :func:`extract_prompts`, :func:`save_model`.

Losses are mean cross-entropy per predicted token in nats. Everything runs on CPU.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle_tree.utils.atomic import atomic_file
from eagle_tree.utils.optim import adamw, lr_factor
from eagle_tree.utils.statefile import read_state

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int = 1024, model_max_length: int = 1024):
    """Train a byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast``.

    Special tokens take ids 0 (``<|bos|>``), 1 (``<|eos|>``) and 2 (``<|pad|>``). Encoding a
    text prepends ``<|bos|>``; decoding with ``skip_special_tokens=True`` returns the text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )


def encode_files(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One 1-D LongTensor: ``bos text eos`` for every text, concatenated in order."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    stream = []
    for row in ids:
        stream.append(tokenizer.bos_token_id)
        stream.extend(row)
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int, keep_remainder: bool = False) -> list[torch.Tensor]:
    """Cut a stream into rows of ``seq_len`` tokens (the last, shorter row only if ``keep_remainder``)."""
    n_full = len(stream) // seq_len
    rows = list(stream[: n_full * seq_len].view(n_full, seq_len))
    if keep_remainder and len(stream) - n_full * seq_len > 1:
        rows.append(stream[n_full * seq_len:])
    return rows


# ----------------------------------------------------------------------------- models


@dataclass
class ModelSpec:
    """Shape of a reference Llama."""

    layers: int = 8
    """Number of decoder layers."""
    hidden: int = 256
    """Hidden size."""
    intermediate: int = 704
    """MLP inner size."""
    heads: int = 4
    """Attention heads (head dim = hidden / heads)."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention when fewer than ``heads``)."""
    max_positions: int = 1024
    """``max_position_embeddings`` written into the config."""
    tie_embeddings: bool = False
    """Share the input embedding and the output head."""
    embed_std: float | None = None
    """Standard deviation of the input embedding's initial values; ``None`` keeps the library
    default (0.02, which stalls a deep model at the unigram loss: see docs/REFERENCE.md)."""


def build_llama(spec: ModelSpec, tokenizer, seed: int = 0):
    """A freshly initialised ``LlamaForCausalLM`` for ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-5, tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if spec.embed_std is not None:
        if spec.tie_embeddings:
            raise ValueError("embed_std with tie_embeddings would rescale the output head too; untie them "
                             "or leave embed_std at None")
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, spec.embed_std)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    """One language-model training run."""

    steps: int = 1000
    """Optimiser steps; the schedule spans exactly these."""
    batch_size: int = 8
    """Rows per step."""
    seq_len: int = 256
    """Tokens per row."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.05
    """Final learning rate as a fraction of ``lr``."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms)."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    seed: int = 0
    """Seeds the data order."""
    eval_every_s: float = 300.0
    """Seconds between held-out evaluations on the tuning rows."""
    eval_rows: int = 32
    """Tuning rows used by the periodic evaluation."""
    checkpoint_every_s: float = 300.0
    """Seconds between checkpoints."""


@dataclass
class TrainResult:
    steps: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    evals: list[dict] = field(default_factory=list)
    """``{"step", "tokens", "wall_s", "tuning_loss"}`` for every periodic evaluation."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``cfg.steps``."""
    return cfg.lr * lr_factor(step, cfg.warmup_steps, cfg.steps, "cosine", cfg.min_lr_ratio)


def _batch_indices(step: int, n_rows: int, cfg: TrainConfig) -> list[int]:
    """Row indices of ``step``: a fresh seeded permutation every epoch, so resuming needs no state."""
    out = []
    for pos in range(step * cfg.batch_size, (step + 1) * cfg.batch_size):
        epoch, offset = divmod(pos, n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
        out.append(int(perm[offset]))
    return out


@torch.no_grad()
def evaluate_loss(model, rows: Sequence[torch.Tensor], batch_size: int = 8) -> float:
    """Mean cross-entropy (nats) per predicted token over ``rows`` (rows may differ in length)."""
    model.eval()
    total, count = 0.0, 0
    by_len: dict[int, list[torch.Tensor]] = {}
    for r in rows:
        by_len.setdefault(len(r), []).append(r)
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            x = torch.stack(group[i:i + batch_size])  # (B, T)
            logits = model(input_ids=x).logits.float()  # (B, T, V)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / max(1, count)


def _save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` next to ``path`` and move it into place, so a crash never leaves half a file."""
    with atomic_file(path) as tmp:
        torch.save(state, tmp)


def train_lm(
    model,
    train_rows: Sequence[torch.Tensor],
    tuning_rows: Sequence[torch.Tensor],
    cfg: TrainConfig,
    checkpoint: str | Path | None = None,
    desc: str = "train",
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``model`` for ``cfg.steps`` steps; resumes from ``checkpoint`` when it exists.

    The checkpoint (a single ``torch.save`` file written atomically, read back with
    ``weights_only=True``: tensors, numbers and containers, nothing that runs) holds the model, the
    optimiser, the step and the evaluation history; the data order is a function of the step
    and ``cfg.seed``, so a resumed run sees the same batches as an uninterrupted one.
    ``stop_after`` ends this call (with a checkpoint) after that many steps, schedule unchanged.
    """
    from tqdm import tqdm

    checkpoint = Path(checkpoint) if checkpoint is not None else None
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    step, tokens, wall, evals = 0, 0, 0.0, []
    if checkpoint is not None and checkpoint.exists():
        state = read_state(checkpoint, "reference training checkpoint",
                           fix=f"delete {checkpoint} to train from the start")
        if state.get("config") != asdict(cfg):
            raise ValueError(f"checkpoint {checkpoint} was written with another config: {state['config']}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, tokens, wall, evals = state["step"], state["tokens"], state["wall_s"], state["evals"]
    data = torch.stack(list(train_rows))  # (N, T)
    eval_rows = list(tuning_rows)[: cfg.eval_rows]

    def save() -> None:
        if checkpoint is not None:
            _save_checkpoint(checkpoint, {
                "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "tokens": tokens, "wall_s": wall, "evals": evals, "config": asdict(cfg),
            })

    model.train()
    start = time.perf_counter() - wall
    last_eval = last_ckpt = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, dynamic_ncols=True, mininterval=2.0)
    last_step = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    while step < last_step:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x = data[_batch_indices(step, len(data), cfg)]  # (B, T)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += x.numel()
        wall = time.perf_counter() - start
        now = time.perf_counter()
        if now - last_eval >= cfg.eval_every_s or step == cfg.steps:
            evals.append({"step": step, "tokens": tokens, "wall_s": round(wall, 1),
                          "tuning_loss": round(evaluate_loss(model, eval_rows), 4)})
            bar.write(f"[{desc}] step {step} tokens {tokens} tuning loss {evals[-1]['tuning_loss']:.4f}")
            last_eval = time.perf_counter()
        if now - last_ckpt >= cfg.checkpoint_every_s or step == last_step:
            save()
            last_ckpt = time.perf_counter()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / max(wall, 1e-9):.0f}",
                        lr=f"{lr_at(step - 1, cfg):.1e}", refresh=False)
        bar.update(1)
    bar.close()
    return TrainResult(steps=step, tokens=tokens, wall_s=round(wall, 1),
                       tokens_per_s=round(tokens / max(wall, 1e-9), 1), evals=evals)


def measure_step_time(model, rows: Sequence[torch.Tensor], cfg: TrainConfig, n: int = 4) -> float:
    """Seconds per training step (forward, backward, AdamW), measured on a copy of ``model``."""
    import copy

    probe = copy.deepcopy(model)
    opt = adamw(probe, cfg.lr, cfg.weight_decay)
    data = torch.stack(list(rows[: cfg.batch_size * (n + 1)]))
    times = []
    for i in range(n + 1):
        x = data[(i * cfg.batch_size) % len(data):][: cfg.batch_size]
        t0 = time.perf_counter()
        probe(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


# ----------------------------------------------------------------------------- outputs


def save_model(model, tokenizer, folder: str | Path, dtype: torch.dtype = torch.float16) -> int:
    """``save_pretrained`` the model (weights cast to ``dtype``) and the tokenizer; returns bytes on disk."""
    import copy

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder_bytes(folder)


def folder_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def load_model(folder: str | Path):
    """``(model, tokenizer)`` from a saved folder, weights in float32, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 64) -> list[str]:
    """The greedy continuation (text only, without the prompt) of every prompt."""
    model.eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def extract_prompts(
    tokenizer,
    files: Sequence[tuple[str, str]],
    n: int = 64,
    min_tokens: int = 128,
    max_tokens: int = 256,
    seed: int = 0,
    prefix: str = "p",
) -> list[dict]:
    """Held-out code prompts: spans of whole lines, ``min_tokens``..``max_tokens`` tokens long.

    The first prompt of each file starts at the file's first line (a true file prefix); later
    ones start at a random line. Files are visited round-robin in a seeded order until ``n``
    prompts exist; spans of one file never overlap. Rows: ``{"id", "file", "start_line",
    "n_tokens", "prompt"}``.
    """
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    used: dict[str, list[tuple[int, int]]] = {}
    prompts: list[dict] = []
    for _ in range(8):  # passes over the files
        for path, text in order:
            if len(prompts) == n:
                return prompts
            span = _line_span(tokenizer, text.splitlines(keepends=True), used.setdefault(path, []),
                              min_tokens, max_tokens, rng)
            if span is not None:
                start, stop = span
                used[path].append((start, stop))
                prompt = "".join(text.splitlines(keepends=True)[start:stop])
                n_tok = len(tokenizer(prompt)["input_ids"])  # with the leading <|bos|>
                prompts.append({"id": f"{prefix}{len(prompts):03d}", "file": path, "start_line": start + 1,
                                "n_tokens": n_tok, "prompt": prompt})
    return prompts


def _line_span(tokenizer, lines, used, min_tokens, max_tokens, rng, tries: int = 20):
    """``(first line, end line)`` of a span of about ``min_tokens``..``max_tokens`` tokens that
    overlaps no span in ``used``, or None. Token counts are summed line by line (an estimate)."""
    target = rng.randint(min_tokens, max_tokens)
    candidates = [0] if not used else [rng.randrange(len(lines)) for _ in range(tries)]
    for start in candidates:
        if any(a <= start < b for a, b in used):
            continue
        n_tok, stop = 0, start
        while stop < len(lines) and n_tok < target:
            if any(a <= stop < b for a, b in used):
                break
            n_tok += len(tokenizer(lines[stop], add_special_tokens=False)["input_ids"])
            stop += 1
        if min_tokens <= n_tok <= max_tokens + 64 and "".join(lines[start:stop]).strip():
            return start, stop
    return None
