"""A toy target with learnable structure, built locally in seconds: corpus, tokenizer and a tiny Llama.

The corpus is made of short *segments*, each a keyword, a start and a run that follows from them::

    count 7 8 9 10 11 .        (+1 modulo the number range)
    down 30 29 28 27 .         (-1)
    skip 3 5 7 9 11 .          (+2)
    repeat c f a c f a c f .   (a pattern of 2 to 4 letters, repeated)

A document is a few segments in a row. Inside a segment every token after the second is determined
by the ones before it; the keyword, the start and the segment length are random. A 4-layer Llama of
hidden size 64 learns this in a few hundred steps (about 20 s on two CPU cores), after which its
greedy continuations follow the structure and its next-token distribution is sharp inside segments,
so a draft head has something to learn and a measurable acceptance length to gain.

:func:`build_toy` writes, in a folder keyed by a hash of the :class:`ToyConfig` (so repeated runs
reuse it; the folder appears atomically)::

    target/        the trained model and its word-level tokenizer (AutoModelForCausalLM / AutoTokenizer)
    data/train.jsonl, data/eval.jsonl      {"text": ...} documents (eval: held out)
    prompts.jsonl  {"prompt": ...} held-out prompts ending inside a segment
    report.json    training loss and greedy agreement on held-out documents
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_tree.utils.atomic import atomic_dir

TOY_VERSION = 2  # 2: the shared AdamW setup (no decay on norms) and schedule
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
KEYWORDS = ("count", "down", "skip", "repeat")
LETTERS = tuple("abcdefghijklmnop")
END = "."


@dataclass
class ToyConfig:
    """The toy corpus and the tiny target trained on it."""

    seed: int = 0
    """Seeds the corpus, the initialisation and the data order."""
    numbers: int = 40
    """Number tokens 0..numbers-1; runs wrap around modulo this."""
    train_docs: int = 2000
    """Training documents."""
    eval_docs: int = 64
    """Held-out documents (evaluation data and prompts)."""
    segments: int = 5
    """Segments per document."""
    min_run: int = 4
    """Shortest run after the start of a segment."""
    max_run: int = 10
    """Longest run after the start of a segment."""
    hidden_size: int = 64
    """Hidden size of the target."""
    num_layers: int = 4
    """Decoder layers of the target."""
    train_steps: int = 300
    """Optimiser steps of the target's training."""
    batch_size: int = 16
    """Documents per step."""
    lr: float = 3e-3
    """Peak learning rate (linear warm-up, cosine decay)."""


@dataclass
class ToyAssets:
    """Where a built toy lives."""

    root: Path
    target: Path  # model + tokenizer folder
    train_file: Path  # jsonl {"text"}
    eval_file: Path  # jsonl {"text"}
    prompts_file: Path  # jsonl {"prompt"}
    report: dict


# ----------------------------------------------------------------------------- corpus


def _segment(rng: random.Random, cfg: ToyConfig) -> list[str]:
    kind = rng.choice(KEYWORDS)
    run = rng.randint(cfg.min_run, cfg.max_run)
    if kind == "repeat":
        pattern = rng.sample(LETTERS, rng.randint(2, 4))
        body = [pattern[i % len(pattern)] for i in range(run + len(pattern))]
    else:
        step = {"count": 1, "down": -1, "skip": 2}[kind]
        start = rng.randrange(cfg.numbers)
        body = [str((start + i * step) % cfg.numbers) for i in range(run + 1)]
    return [kind, *body, END]


def toy_documents(cfg: ToyConfig, n: int, seed: int) -> list[str]:
    """``n`` documents of ``cfg.segments`` segments, a function of (cfg, seed) only."""
    rng = random.Random(seed)
    return [" ".join(w for _ in range(cfg.segments) for w in _segment(rng, cfg)) for _ in range(n)]


def toy_vocabulary(cfg: ToyConfig) -> list[str]:
    """Special tokens first (ids 0, 1, 2), then keywords, the end mark, numbers and letters."""
    return [BOS, EOS, PAD, *KEYWORDS, END, *(str(i) for i in range(cfg.numbers)), *LETTERS]


def toy_tokenizer(cfg: ToyConfig):
    """A word-level ``PreTrainedTokenizerFast`` (whitespace split) that prepends ``<|bos|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(toy_vocabulary(cfg))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD,
        model_max_length=512, clean_up_tokenization_spaces=False,
    )


def toy_prompts(cfg: ToyConfig, documents: list[str], seed: int) -> list[str]:
    """One prompt per document: its words up to a point two or more words inside a segment."""
    rng = random.Random(seed)
    prompts = []
    for doc in documents:
        words = doc.split()
        inside = [i for i in range(3, len(words) - 4) if words[i - 2] not in (END, *KEYWORDS)
                  and words[i - 1] not in (END, *KEYWORDS) and words[i] != END]
        cut = rng.choice(inside) if inside else len(words) // 2
        prompts.append(" ".join(words[:cut]))
    return prompts


# ----------------------------------------------------------------------------- target


def train_toy_target(cfg: ToyConfig, tokenizer, documents: list[str]):
    """A fresh tiny Llama trained on ``documents`` (next-token cross-entropy, AdamW); returns (model, losses)."""
    from eagle_tree.data.tiny import tiny_causal_lm

    model = tiny_causal_lm(
        "llama", vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=4, num_kv_heads=2, intermediate_size=2 * cfg.hidden_size, seed=cfg.seed,
        attn_implementation="sdpa", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    rows = tokenizer(documents)["input_ids"]
    width = max(len(r) for r in rows)
    data = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        data[i, : len(r)] = torch.tensor(r)
    labels = data.masked_fill(data == tokenizer.pad_token_id, -100)
    gen = torch.Generator().manual_seed(cfg.seed)
    from eagle_tree.utils.optim import adamw, lr_factor

    opt = adamw(model, cfg.lr, weight_decay=0.01)
    warmup = max(1, cfg.train_steps // 20)
    model.train()
    losses = []
    for step in range(cfg.train_steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step, warmup, cfg.train_steps, "cosine", 0.05)
        idx = torch.randint(len(rows), (cfg.batch_size,), generator=gen)
        loss = model(input_ids=data[idx], labels=labels[idx]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model.eval(), losses


@torch.no_grad()
def greedy_agreement(model, tokenizer, documents: list[str]) -> float:
    """Share of determined positions (the third word of a segment onwards, end marks excluded) where
    the model's greedy next token is the true one (teacher forcing)."""
    hits = total = 0
    for doc in documents:
        ids = tokenizer(doc, return_tensors="pt")["input_ids"]
        pred = model(input_ids=ids).logits[0].argmax(-1)  # (T,)
        words = doc.split()
        seg_pos = 0
        for i, w in enumerate(words):  # token i + 1 is word i (BOS first)
            seg_pos = 0 if (i == 0 or words[i - 1] == END) else seg_pos + 1
            if seg_pos >= 3 and w != END:
                hits += int(pred[i] == ids[0, i + 1])
                total += 1
    return hits / max(total, 1)


# ----------------------------------------------------------------------------- building and caching


def config_key(cfg: ToyConfig) -> str:
    blob = json.dumps({"version": TOY_VERSION, **asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$EAGLE_TREE_CACHE/toy``, else ``$XDG_CACHE_HOME/eagle_tree/toy``, else ``~/.cache/eagle_tree/toy``."""
    if os.environ.get("EAGLE_TREE_CACHE"):
        return Path(os.environ["EAGLE_TREE_CACHE"]) / "toy"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle_tree" / "toy"


def _assets(root: Path) -> ToyAssets:
    return ToyAssets(root=root, target=root / "target", train_file=root / "data" / "train.jsonl",
                     eval_file=root / "data" / "eval.jsonl", prompts_file=root / "prompts.jsonl",
                     report=json.loads((root / "report.json").read_text()))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_toy(cfg: ToyConfig | None = None, cache_dir: str | os.PathLike | None = None,
              verbose: bool = True) -> ToyAssets:
    """The toy target and corpus for ``cfg``: read from ``cache_dir/toy-<key>`` or built there (atomically)."""
    cfg = cfg or ToyConfig()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = cache / f"toy-{config_key(cfg)}"
    if (root / "report.json").is_file():
        return _assets(root)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if verbose:
        print(f"[toy] building the toy target in {root} (once; about 20 s)", flush=True)
    tokenizer = toy_tokenizer(cfg)
    train_docs = toy_documents(cfg, cfg.train_docs, seed=cfg.seed)
    eval_docs = toy_documents(cfg, cfg.eval_docs, seed=cfg.seed + 1_000_003)
    with torch.random.fork_rng(devices=[]):
        model, losses = train_toy_target(cfg, tokenizer, train_docs)
    report = {
        "config": asdict(cfg), "version": TOY_VERSION, "final_train_loss": round(sum(losses[-20:]) / 20, 4),
        "eval_greedy_agreement": round(greedy_agreement(model, tokenizer, eval_docs), 4),
        "build_s": round(time.perf_counter() - t0, 1),
    }
    with atomic_dir(root, keep_existing=True) as tmp:  # another process may build it at the same time
        model.save_pretrained(tmp / "target")
        tokenizer.save_pretrained(tmp / "target")
        _write_jsonl(tmp / "data" / "train.jsonl", [{"text": d} for d in train_docs])
        _write_jsonl(tmp / "data" / "eval.jsonl", [{"text": d} for d in eval_docs])
        prompts = toy_prompts(cfg, eval_docs, seed=cfg.seed + 7)
        _write_jsonl(tmp / "prompts.jsonl", [{"prompt": p} for p in prompts])
        (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    if verbose:
        print(f"[toy] built in {report['build_s']} s: train loss {report['final_train_loss']}, "
              f"held-out greedy agreement {report['eval_greedy_agreement']}", flush=True)
    return _assets(root)


__all__ = ["ToyConfig", "ToyAssets", "build_toy", "toy_documents", "toy_tokenizer", "toy_prompts",
           "train_toy_target", "greedy_agreement", "config_key", "default_cache_dir"]
