"""Chat training data made by the target alone: Magpie prompts, the target's own replies, two turns.

No dataset hub is needed. For a chat model, the text a head must predict is the model's own replies
to the questions users ask; both can be drawn from the model:

1. **Prompts (Magpie).** The chat template is rendered up to the start of a user turn (the system
   prompt, then ``<|im_start|>user\\n`` for ChatML) and the model samples what follows, up to its
   end-of-turn token: a question of the kind its instruction data held. Samples that run past
   ``max_prompt_tokens`` without ending, are shorter than ``min_prompt_chars``, hold a role marker, or
   repeat an earlier prompt (case and spacing ignored) are dropped.
2. **Replies.** The target answers each kept prompt, greedy in even batches and sampled at
   ``reply_temperature`` in odd ones (EAGLE-3 and SpecForge regenerate replies with the target so
   that training sees the states decoding will visit).
3. **A second turn.** The template is rendered through the first reply and a user turn opened again,
   so the model writes a follow-up question and then answers it: training sees contexts as long as
   MT-bench's second turn.

**Written openers** (``openers=FILE``, optional): a user turn may start from a written opener, a few
words of a kind of request (``Write a limerick about``, ``Read the passage below and list``), and the
model writes the rest of the turn, so a short file steers the data towards the requests a benchmark
asks without holding any of its questions. ``first`` openers start first turns (drawn uniformly, with
the category they are filed under recorded in the row), ``followup`` openers start second turns.

Batch ``b`` draws from seeds derived from ``(seed, b, stage)``, so a run is repeatable. Finished
batches are appended to ``OUTPUT/rows.partial.jsonl`` with a marker line; a rerun of the same settings
resumes after the last marker, and a rerun with a larger ``conversations`` extends the file. When the
count or ``max_minutes`` is reached, the rows are split by a hash of their first prompt into
``train.jsonl``, ``tuning.jsonl`` and ``test.jsonl`` (conversations), ``tuning_prompts.jsonl`` and
``test_prompts.jsonl`` (first-turn prompts rendered with the chat template, for ``decode`` and
``bench``), ``tuning_turns.jsonl`` and ``test_turns.jsonl`` (each conversation's first turn, then its
second: the template through the first reply and the follow-up question, the context MT-bench's turn 2
decodes in; tune on these when the benchmark has second turns), and ``stats.json`` (counts, tokens,
seconds).

    eagle-tree chat-data --config configs/chat-data-smollm2.yaml target=$(eagle-tree reference smollm2 | tail -1)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from eagle_tree.models.prepack import PrepackSetting, packed_kernels
from eagle_tree.utils.atomic import write_text
from eagle_tree.utils.checks import check_range

MARKER = "_batch_done"
SENTINEL = "\x00EAGLE_TREE_TURN\x00"
ROLE_MARKERS = re.compile(r"<\|im_(start|end)\|>|^(user|assistant|system)\s*:", re.IGNORECASE | re.MULTILINE)
SPLITS = ("train", "tuning", "test")
EMPTY_BATCHES = 3  # batches in a row without a usable conversation before the run is refused


@dataclass
class ChatDataConfig:
    """Synthesise chat conversations with the target (Magpie prompts, the target's own replies)."""

    target: str = ""
    """Target: a chat model folder, hub id or .gguf file, e.g. $(eagle-tree reference smollm2 | tail -1)."""
    output: str = "runs/chat-data"
    """Folder to write (rows.partial.jsonl while running; train/tuning/test files at the end)."""
    conversations: int = 1024
    """Conversations to build (the run stops earlier at max_minutes; rerun to continue)."""
    turns: int = 2
    """User / assistant turn pairs per conversation (1 or 2)."""
    batch_size: int = 32
    """Conversations generated together (left padding)."""
    max_prompt_tokens: int = 96
    """A sampled user turn that has not ended within this many tokens is dropped."""
    min_prompt_chars: int = 12
    """Shorter user turns are dropped."""
    prompt_temperature: float = 1.0
    """Sampling temperature of the user turns (Magpie)."""
    prompt_top_p: float = 0.95
    """Nucleus of the user-turn sampling."""
    max_reply_tokens: int = 256
    """Tokens per assistant reply at most (MT-bench decodes 256)."""
    reply_temperature: float = 1.0
    """Temperature of the sampled replies (odd batches); even batches reply greedily."""
    reply_top_p: float = 1.0
    """Nucleus of the sampled replies."""
    tuning_fraction: float = 0.04
    """Share of conversations kept for tuning (by a hash of the first prompt)."""
    test_fraction: float = 0.04
    """Share of conversations kept for testing."""
    openers: str | None = None
    """A YAML or JSON file of written openers: ``first`` (a list, or a mapping of category to lists) starts
    each first user turn and ``followup`` (optional) each second; the model writes the rest of the turn
    (the module docstring). None: Magpie prompts alone. The file's content, not its path, is in the
    data's fingerprint."""
    seed: int = 0
    """Base seed; batch b, stage s draw from a seed derived from (seed, b, s)."""
    max_minutes: float | None = None
    """Stop after the batch that passes this wall time (the files are written from what is done)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the target."""
    threads: int | None = None
    """torch CPU threads (None: torch's default)."""
    target_prepack: PrepackSetting = False
    """Pack the target's linear layers for oneDNN (eagle_tree.models.prepack): on CPU hosts where the batched
    steps' small matrix products are slow, generation runs faster (docs/MEASURING.md, "The rest of the pipeline
    on the same host"); "auto" times both kernels at load and keeps the faster. A kernel choice like
    ``threads``, so not part of the data's fingerprint (a run may resume with the other kernels); each batch's
    stats record the kernels it ran on."""
    progress: bool = True
    """Show a progress bar."""
    overwrite: bool = False
    """Write into `output` even when it holds files of these names that chat-data did not write."""

    def __post_init__(self) -> None:
        check_range("conversations", self.conversations, 1)
        check_range("batch_size", self.batch_size, 1)
        check_range("max_prompt_tokens", self.max_prompt_tokens, 4)
        check_range("max_reply_tokens", self.max_reply_tokens, 1)
        if self.turns not in (1, 2):
            from eagle_tree.utils.config import ConfigValueError

            raise ConfigValueError("turns", f"must be 1 or 2, got {self.turns!r}")
        for name in ("prompt_temperature", "reply_temperature", "tuning_fraction", "test_fraction"):
            check_range(name, getattr(self, name), 0.0, integer=False)
        if self.tuning_fraction + self.test_fraction >= 1:
            from eagle_tree.utils.config import ConfigValueError

            raise ConfigValueError("tuning_fraction", "plus test_fraction must be below 1")


def turn_prefix(tokenizer, messages: list[dict]) -> str:
    """The chat template rendered through ``messages`` and up to the content of a new user turn."""
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise ValueError("the chat template does not render the user's content verbatim; Magpie prompts need it")
    return text[: text.index(SENTINEL)]


def reply_prompt(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class Openers:
    """Written starts of user turns (``ChatDataConfig.openers``)."""

    first: tuple[tuple[str, str], ...]
    """(category, opener) pairs for first turns; the category is ``""`` when the file gives a plain list."""
    followup: tuple[str, ...]
    """Openers of second turns; empty: the model writes second turns from nothing (Magpie)."""
    digest: str
    """sha256 of the parsed content (what the data's fingerprint records)."""


def read_openers(path: str | os.PathLike) -> Openers:
    """Parse and check an openers file; a clear error names what is wrong and how to write it."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"openers={path}: no such file (a YAML file with a 'first' list; "
                                f"see assets/smollm2/openers.yaml)")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"openers={path}: not YAML or JSON ({exc})") from exc
    if not isinstance(raw, dict) or "first" not in raw or set(raw) - {"first", "followup"}:
        raise ValueError(f"openers={path}: expected a mapping with 'first' (a list of strings, or categories "
                         f"of lists) and optionally 'followup' (a list), got "
                         f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")

    def strings(value, where: str) -> list[str]:
        if not isinstance(value, list) or not value:
            raise ValueError(f"openers={path}: {where} must be a non-empty list of strings")
        out = []
        for i, text in enumerate(value):
            if not isinstance(text, str) or not text.strip():
                hint = " (YAML reads an unquoted 'text:' as a mapping: quote it)" if isinstance(text, dict) else ""
                raise ValueError(f"openers={path}: {where}[{i}] must be a non-empty string, got {text!r}{hint}")
            if ROLE_MARKERS.search(text):
                raise ValueError(f"openers={path}: {where}[{i}] holds a role marker: {text!r}")
            out.append(text.strip())  # a trailing space would be a token of its own, one the model never sees
        return out

    first = raw["first"]
    if isinstance(first, dict):
        pairs = [(str(cat), t) for cat, texts in first.items() for t in strings(texts, f"first.{cat}")]
    else:
        pairs = [("", t) for t in strings(first, "first")]
    followup = strings(raw["followup"], "followup") if raw.get("followup") is not None else []
    digest = hashlib.sha256(json.dumps([pairs, followup]).encode()).hexdigest()
    return Openers(tuple(pairs), tuple(followup), digest)


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def split_of(prompt: str, tuning: float, test: float) -> str:
    """``train``, ``tuning`` or ``test`` by a hash of the first prompt (stable across runs and machines)."""
    u = int(hashlib.sha256(normalise(prompt).encode()).hexdigest()[:12], 16) / 16**12
    return "tuning" if u < tuning else "test" if u < tuning + test else "train"


def stage_seed(seed: int, batch: int, stage: int) -> int:
    return int(hashlib.sha256(f"{seed}/{batch}/{stage}".encode()).hexdigest()[:8], 16)


@torch.no_grad()
def sample(model, tokenizer, texts: list[str], max_new_tokens: int, temperature: float, top_p: float,
           seed: int) -> list[tuple[list[int], bool]]:
    """For each text (rendered with its special tokens, no BOS added), the new ids up to the end-of-turn
    token and whether it was reached; one left-padded ``generate`` call."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    kwargs = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0
              else dict(do_sample=False))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=eos, **kwargs)
    result = []
    for row in out[:, width:].tolist():
        ended = eos in row
        result.append((row[: row.index(eos)] if ended else row, ended))
    return result


def usable_prompt(text: str, ended: bool, cfg: ChatDataConfig) -> bool:
    return ended and len(text.strip()) >= cfg.min_prompt_chars and not ROLE_MARKERS.search(text)


def build_batch(model, tokenizer, cfg: ChatDataConfig, b: int, seen: set[str],
                openers: Openers | None = None) -> tuple[list[dict], dict]:
    """One batch of conversations (maybe fewer than ``batch_size`` after filtering) and its counts."""
    t0 = time.perf_counter()
    first = turn_prefix(tokenizer, [])
    draw = random.Random(stage_seed(cfg.seed, b, -1))
    picks = [draw.choice(openers.first) for _ in range(cfg.batch_size)] if openers else [("", "")] * cfg.batch_size
    asked = sample(model, tokenizer, [first + opener for _, opener in picks], cfg.max_prompt_tokens,
                   cfg.prompt_temperature, cfg.prompt_top_p, stage_seed(cfg.seed, b, 0))
    convs, dropped = [], {"unfinished": 0, "short_or_marked": 0, "duplicate": 0}
    started: dict[int, dict] = {}  # id(conversation) -> the openers it was written from
    for (category, opener), (ids, ended) in zip(picks, asked, strict=True):
        text = (opener + tokenizer.decode(ids, skip_special_tokens=True)).strip()
        if not ended:
            dropped["unfinished"] += 1
        elif not usable_prompt(text, ended, cfg):
            dropped["short_or_marked"] += 1
        elif normalise(text) in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(normalise(text))
            convs.append([{"role": "user", "content": text}])
            if openers:
                started[id(convs[-1])] = {"category": category, "first": opener, "followup": None}
    temperature = 0.0 if b % 2 == 0 else cfg.reply_temperature
    tokens = {"prompt": sum(len(i) for i, _ in asked), "reply": 0}
    ended_replies = 0
    for turn in range(cfg.turns):
        if not convs:
            break
        if turn > 0:
            starts = ([draw.choice(openers.followup) for _ in convs] if openers and openers.followup
                      else [""] * len(convs))
            texts = [turn_prefix(tokenizer, c) + o for c, o in zip(convs, starts, strict=True)]
            follow = sample(model, tokenizer, texts, cfg.max_prompt_tokens, cfg.prompt_temperature, cfg.prompt_top_p,
                            stage_seed(cfg.seed, b, 2 * turn))
            tokens["prompt"] += sum(len(i) for i, _ in follow)
            for c, o, (ids, ended) in zip(convs, starts, follow, strict=True):  # unusable follow-up: one turn only
                text = (o + tokenizer.decode(ids, skip_special_tokens=True)).strip()
                if usable_prompt(text, ended, cfg):
                    c.append({"role": "user", "content": text})
                    if o:
                        started[id(c)]["followup"] = o
        open_convs = [c for c in convs if c[-1]["role"] == "user"]
        if not open_convs:
            break
        replies = sample(model, tokenizer, [reply_prompt(tokenizer, c) for c in open_convs], cfg.max_reply_tokens,
                         temperature, cfg.reply_top_p, stage_seed(cfg.seed, b, 2 * turn + 1))
        for c, (ids, ended) in zip(open_convs, replies, strict=True):
            c.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
            tokens["reply"] += len(ids)
            ended_replies += int(ended)
    rows = [{"conversations": c, "reply_temperature": temperature, "batch": b,
             "split": split_of(c[0]["content"], cfg.tuning_fraction, cfg.test_fraction),
             **({"openers": started[id(c)]} if openers else {})} for c in convs]
    stats = {"batch": b, "rows": len(rows), "dropped": dropped, "tokens": tokens, "replies_ended": ended_replies,
             "seconds": round(time.perf_counter() - t0, 2), "target_prepack": packed_kernels(model)}
    if openers:
        stats["categories"] = {}
        for r in rows:
            cat = r["openers"]["category"]
            stats["categories"][cat] = stats["categories"].get(cat, 0) + 1
    return rows, stats


def fingerprint(cfg: ChatDataConfig, tokenizer, openers: Openers | None = None) -> str:
    """What the rows depend on: every setting except the run's size, time budget, kernels and output;
    for ``openers``, the file's parsed content (a run without openers keeps the fingerprint it had before
    openers existed, so its files still resume)."""
    settings = {k: v for k, v in asdict(cfg).items()
                if k not in ("output", "conversations", "max_minutes", "threads", "target_prepack", "progress",
                             "target", "overwrite", "openers")}
    if cfg.openers is not None:
        settings["openers"] = (openers or read_openers(cfg.openers)).digest
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    h.update(turn_prefix(tokenizer, []).encode())
    return h.hexdigest()[:16]


KIND = "eagle-tree chat-data"
OUTPUT_FILES = ("rows.partial.jsonl", "stats.json", *(f"{s}.jsonl" for s in SPLITS), "tuning_prompts.jsonl",
                "test_prompts.jsonl", "tuning_turns.jsonl", "test_turns.jsonl")


def _is_partial_run(folder: Path) -> bool:
    """A chat-data folder written before folders were marked: its rows file ends batches with markers."""
    partial = folder / "rows.partial.jsonl"
    return partial.is_file() and f'"{MARKER}"' in partial.read_text()


def read_partial(partial: Path, fp: str) -> tuple[list[dict], list[dict]]:
    """Rows and batch stats of finished batches; a torn tail after the last marker is cut."""
    if not partial.is_file():
        return [], []
    lines = partial.read_text().splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.startswith(f'{{"{MARKER}"')), default=-1)
    if last + 1 != len(lines):
        write_text(partial, "".join(lines[: last + 1]))
    rows, stats = [], []
    for line in lines[: last + 1]:
        obj = json.loads(line)
        if MARKER in obj:
            if obj.get("fingerprint") != fp:
                raise ValueError(f"{partial} was written with other settings (fingerprint {obj.get('fingerprint')}, "
                                 f"these give {fp}); rerun with those settings, or use another output folder")
            stats.append(obj["stats"])
        else:
            rows.append(obj)
    return rows, stats


def load_target(cfg: ChatDataConfig):
    from eagle_tree.models.gguf import load_causal_lm, load_tokenizer

    if not cfg.target:
        raise ValueError("target= is required: a chat model folder, "
                         "e.g. target=$(eagle-tree reference smollm2 | tail -1)")
    tokenizer = load_tokenizer(cfg.target)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"target={cfg.target}: its tokenizer has no chat_template; chat data needs a chat model")
    model = load_causal_lm(cfg.target, dtype=getattr(torch, cfg.dtype))
    if cfg.target_prepack is not False:
        from eagle_tree.models.prepack import apply_prepack

        try:
            choice = apply_prepack(model, cfg.target_prepack)
        except RuntimeError as exc:
            raise ValueError(f"target_prepack=true: {exc}; set target_prepack=false or auto") from exc
        if cfg.progress:
            print(f"target kernels: {choice.describe()}")
    return model, tokenizer


def build_chat_data(cfg: ChatDataConfig, model=None, tokenizer=None) -> dict:
    """Run (or resume) the job; returns the summary written to ``stats.json``."""
    from tqdm.auto import tqdm

    from eagle_tree.utils.outputs import check_output_dir, mark_output_dir

    out = Path(cfg.output)
    check_output_dir(out, KIND, writes=OUTPUT_FILES, overwrite=cfg.overwrite, recognise=_is_partial_run)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if model is None or tokenizer is None:
        model, tokenizer = load_target(cfg)
    out.mkdir(parents=True, exist_ok=True)
    mark_output_dir(out, KIND)
    partial = out / "rows.partial.jsonl"
    openers = read_openers(cfg.openers) if cfg.openers is not None else None
    fp = fingerprint(cfg, tokenizer, openers)
    rows, stats = read_partial(partial, fp)
    seen = {normalise(r["conversations"][0]["content"]) for r in rows}
    start = time.perf_counter()
    b, empty = len(stats), 0
    bar = tqdm(total=cfg.conversations, initial=min(len(rows), cfg.conversations), desc="chat-data", unit="conv",
               disable=not cfg.progress, dynamic_ncols=True, mininterval=2.0)
    with open(partial, "a") as f:
        while len(rows) < cfg.conversations:
            if cfg.max_minutes is not None and time.perf_counter() - start > 60 * cfg.max_minutes:
                break
            new, st = build_batch(model, tokenizer, cfg, b, seen, openers)
            empty = 0 if new else empty + 1
            if empty >= EMPTY_BATCHES:
                raise ValueError(f"{EMPTY_BATCHES} batches in a row gave no usable conversation "
                                 f"(dropped: {st['dropped']}): the model never ended a user turn with its eos token "
                                 f"{tokenizer.eos_token_id!r} "
                                 f"within max_prompt_tokens={cfg.max_prompt_tokens}; is it a chat model with that eos?")
            f.write("".join(json.dumps(r) + "\n" for r in new))
            f.write(json.dumps({MARKER: b, "fingerprint": fp, "stats": st}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            rows += new
            stats.append(st)
            bar.update(min(len(new), max(0, cfg.conversations - bar.n)))
            b += 1
    bar.close()
    return write_splits(out, rows, stats, tokenizer, cfg)


def turn_prompts(tokenizer, split: str, rows: list[dict]) -> list[dict]:
    """Per conversation, its first-turn prompt and then, when it has two turns, the second: the chat
    template through the first reply and the follow-up question (``turn`` says which)."""
    out = []
    for i, r in enumerate(rows):
        conv = r["conversations"]
        users = [j for j, m in enumerate(conv) if m["role"] == "user"]
        for turn, j in enumerate(users[:2], 1):
            messages = conv[: j + 1]
            out.append({"id": f"{split}-{i:03d}-turn{turn}", "turn": turn,
                        "prompt": reply_prompt(tokenizer, messages), "messages": messages})
    return out


def _by_category(stats: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for st in stats:
        for cat, n in st.get("categories", {}).items():
            total[cat] = total.get(cat, 0) + n
    return total


def write_splits(out: Path, rows: list[dict], stats: list[dict], tokenizer, cfg: ChatDataConfig) -> dict:
    by_split = {s: [r for r in rows if r["split"] == s] for s in SPLITS}
    for s, part in by_split.items():
        write_text(out / f"{s}.jsonl", "".join(json.dumps(r) + "\n" for r in part))
    for s in ("tuning", "test"):
        lines = [json.dumps({"id": f"{s}-{i:03d}", "prompt": reply_prompt(tokenizer, r["conversations"][:1]),
                             "messages": r["conversations"][:1]}) for i, r in enumerate(by_split[s])]
        write_text(out / f"{s}_prompts.jsonl", "".join(line + "\n" for line in lines))
        write_text(out / f"{s}_turns.jsonl", "".join(json.dumps(t) + "\n" for t in turn_prompts(tokenizer, s,
                                                                                              by_split[s])))
    reply_tokens = sum(st["tokens"]["reply"] for st in stats)
    summary = {
        "conversations": len(rows), "by_split": {s: len(p) for s, p in by_split.items()},
        "two_turn": sum(1 for r in rows if sum(m["role"] == "assistant" for m in r["conversations"]) == 2),
        "batches": len(stats), "generated_prompt_tokens": sum(st["tokens"]["prompt"] for st in stats),
        "generated_reply_tokens": reply_tokens,
        "replies_ended": sum(st["replies_ended"] for st in stats),
        "dropped": {k: sum(st["dropped"][k] for st in stats) for k in stats[0]["dropped"]} if stats else {},
        "seconds": round(sum(st["seconds"] for st in stats), 1),
        "batches_target_prepack": sum(bool(st.get("target_prepack")) for st in stats),  # batches on packed kernels
        **({"by_category": _by_category(stats)} if cfg.openers is not None else {}),
        "settings": asdict(cfg),
    }
    write_text(out / "stats.json", json.dumps(summary, indent=2) + "\n")
    return summary
