"""Regenerate training data with the target: the text a head learns from, written by the target itself.

A head is judged on what the target will write, so training it on the target's own continuations
(greedy, sampled, or both) puts the training states where decoding will visit them. Two kinds of rows:

- text rows (field ``text``): the first ``prefix_tokens`` tokens are kept as the prompt and the target
  continues them for up to ``max_new_tokens``; the output row's ``text`` is prompt + continuation;
- conversation rows (``conversations`` / ``messages``): the messages up to the last user turn are kept,
  rendered with the chat template's generation prompt, and the target writes the assistant reply,
  appended as the last message.

Rows are generated in batches (left padding) with Hugging Face ``generate``; batch ``b`` draws from
seed ``seed + b``, so a run is repeatable and an interrupted run resumes where it stopped: finished
batches are appended to ``OUT.partial`` and the file is renamed to ``OUT`` when every row is done.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.data.rows import CONVERSATION_FIELDS, TEXT_FIELDS, normalize_messages
from eagle_tree.utils.atomic import write_text

MARKER = "_batch_done"  # key of the line that ends each finished batch in OUTPUT.partial


@dataclass
class RegenerateConfig:
    """Continue dataset rows with the target model and write them as a new jsonl dataset."""

    target: str = "assets/reference/target"
    """Target model: a local folder or a hub id (AutoModelForCausalLM + AutoTokenizer)."""
    data: str = "stdlib:assets/reference/manifest.json#train"
    """Rows to continue: a json/jsonl/parquet/text file, a folder, a glob, a hub id, or
    'stdlib:MANIFEST#SPLIT' (chunks of the standard-library corpus, as in training)."""
    output: str = "runs/regenerated/data.jsonl"
    """jsonl file to write (one row per input row with something to continue)."""
    limit: int | None = None
    """Continue only the first N rows (after `every`)."""
    every: int = 1
    """Take every n-th row of the data (a spread-out subset of a large dataset)."""
    prefix_tokens: int = 64
    """Text rows: tokens kept as the prompt (special tokens included)."""
    max_new_tokens: int = 192
    """Tokens the target writes per row at most (it stops earlier at EOS)."""
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    """Sampling temperatures used in turn, row by row (0 = greedy); e.g. [0.0, 1.0] alternates."""
    top_p: float = 1.0
    """Nucleus sampling for temperatures > 0 (1.0 = off)."""
    batch_size: int = 16
    """Rows generated together (left padding)."""
    seed: int = 0
    """Batch b samples with seed + b."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the target."""
    threads: int | None = None
    """torch CPU threads (None: torch's default)."""
    chunk_chars: int = 768
    """'stdlib:' data: characters per chunk (whole lines), as in training with max_length 256."""
    overwrite: bool = False
    """Replace `output` even when it is not an earlier regenerate output (an output that is one of the
    input files is refused even then)."""

    def __post_init__(self) -> None:
        if min(self.prefix_tokens, self.max_new_tokens, self.batch_size, self.every) < 1:
            raise ValueError("prefix_tokens, max_new_tokens, batch_size and every must be >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {self.temperatures}")


@dataclass
class Job:
    """One row to continue: the prompt ids, how to sample, and how to write the result."""

    index: int  # index among the rows read (after `every` and `limit`)
    prompt_ids: list[int]
    temperature: float
    source: dict  # the input row (text rows: {"text": prefix}; conversations: {"conversations": messages})
    kind: str  # "text" or "conversations"


def read_rows(data: str, limit: int | None = None, chunk_chars: int = 768, every: int = 1) -> list[dict]:
    """Input rows as dicts (``datasets`` does the reading; 'stdlib:' specs are chunked first)."""
    import tempfile

    from eagle_tree.data.corpus import split_jsonl
    from eagle_tree.data.rows import load_raw

    if data.startswith("stdlib:"):
        data = str(split_jsonl(data, Path(tempfile.gettempdir()) / "eagle_tree_regenerate", chunk_chars))
    raw = load_raw(data, "train", "document", None)
    if every > 1:
        raw = raw.select(range(0, len(raw), every))
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    return [dict(r) for r in raw]


def make_jobs(rows: Sequence[dict], tokenizer, cfg: RegenerateConfig) -> list[Job]:
    """One job per row with a prompt; temperatures are assigned in turn by row index."""
    if not rows:
        return []
    fields = set(rows[0])
    conv = next((f for f in CONVERSATION_FIELDS if f in fields), None)
    text = next((f for f in TEXT_FIELDS if f in fields), None)
    if conv is None and text is None:
        raise ValueError(f"rows have fields {sorted(fields)}; expected a text field {list(TEXT_FIELDS)} or a "
                         f"conversation field {list(CONVERSATION_FIELDS)}")
    if conv is not None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the rows hold conversations but the target's tokenizer has no chat_template")
    jobs = []
    for i, row in enumerate(rows):
        temperature = cfg.temperatures[i % len(cfg.temperatures)]
        if conv is not None:
            messages = normalize_messages(row[conv] or [])
            last_user = max((j for j, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last_user is None:
                continue
            messages = messages[: last_user + 1]
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in some versions
            jobs.append(Job(i, ids, temperature, {"conversations": messages}, "conversations"))
        else:
            ids = tokenizer(row[text] or "")["input_ids"][: cfg.prefix_tokens]
            if len([t for t in ids if t not in tokenizer.all_special_ids]) == 0:
                continue
            prefix = tokenizer.decode(ids, skip_special_tokens=True)
            jobs.append(Job(i, list(ids), temperature, {"text": prefix}, "text"))
    return jobs


def _batches(jobs: Sequence[Job], size: int) -> Iterator[list[Job]]:
    for start in range(0, len(jobs), size):
        yield list(jobs[start : start + size])


@torch.no_grad()
def generate_batch(model, tokenizer, jobs: Sequence[Job], max_new_tokens: int, temperature: float, top_p: float,
                   seed: int) -> list[list[int]]:
    """New token ids for each job (left-padded batch; EOS and everything after it dropped)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
    width = max(len(j.prompt_ids) for j in jobs)
    ids = torch.full((len(jobs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for r, job in enumerate(jobs):
        ids[r, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
        mask[r, width - len(job.prompt_ids):] = 1
    sample = not SamplingConfig(temperature=temperature).greedy  # a tiny temperature is greedy, as in decoding
    kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if sample else dict(do_sample=False)
    device = model.get_input_embeddings().weight.device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **kwargs)
    new = out[:, width:].tolist()
    result = []
    for row in new:
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        result.append(row)
    return result


def output_row(job: Job, new_ids: list[int], tokenizer) -> dict:
    reply = tokenizer.decode(new_ids, skip_special_tokens=True)
    if job.kind == "conversations":
        row = {"conversations": [*job.source["conversations"], {"role": "assistant", "content": reply}]}
    else:
        row = {"text": job.source["text"] + reply}
    row.update(source_index=job.index, temperature=job.temperature, generated_tokens=len(new_ids))
    return row


def regenerate(cfg: RegenerateConfig, model=None, tokenizer=None, progress: bool = True) -> dict:
    """Run the whole job; returns counts. ``model`` / ``tokenizer`` default to loading ``cfg.target``."""
    from tqdm.auto import tqdm

    out = check_output(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if model is None or tokenizer is None:
        from eagle_tree.models.gguf import load_causal_lm, load_tokenizer

        tokenizer = load_tokenizer(cfg.target)
        model = load_causal_lm(cfg.target, dtype=getattr(torch, cfg.dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    jobs = make_jobs(read_rows(cfg.data, cfg.limit, cfg.chunk_chars, cfg.every), tokenizer, cfg)
    # Batches hold rows of one temperature, in input order, so batch b is the same on every run.
    batches = [b for t in dict.fromkeys(cfg.temperatures)
               for b in _batches([j for j in jobs if j.temperature == t], cfg.batch_size)]
    fingerprint = _fingerprint(cfg, batches)
    done = _completed_batches(partial, fingerprint)
    bar = tqdm(total=len(jobs), initial=sum(len(b) for b in batches[:done]), desc="regenerate", unit="row",
               disable=not progress, dynamic_ncols=True, mininterval=2.0)
    new_tokens = 0
    with open(partial, "a") as f:
        for b in range(done, len(batches)):
            batch = batches[b]
            generated = generate_batch(model, tokenizer, batch, cfg.max_new_tokens, batch[0].temperature, cfg.top_p,
                                       cfg.seed + b)
            lines = [json.dumps(output_row(j, g, tokenizer)) for j, g in zip(batch, generated, strict=True)]
            lines.append(json.dumps({MARKER: b, "fingerprint": fingerprint}))
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
            new_tokens += sum(len(g) for g in generated)
            bar.update(len(batch))
    bar.close()
    rows = [line for line in partial.read_text().splitlines() if line and MARKER not in json.loads(line)]
    write_text(out, "".join(r + "\n" for r in rows))
    partial.unlink()
    return {"rows": len(rows), "batches": len(batches), "resumed_batches": done, "new_tokens_this_run": new_tokens,
            "output": str(out)}


def is_regenerated(path: Path) -> bool:
    """Whether ``path`` is an earlier output of regenerate: every row it starts with carries the keys
    regenerate adds (``source_index``, ``temperature``, ``generated_tokens``)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        row = json.loads(first) if first.strip() else None
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and {"source_index", "temperature", "generated_tokens"} <= set(row)


def check_output(cfg: RegenerateConfig) -> Path:
    """Refuse, before any row is generated, an ``output`` regenerate must not write: not a .jsonl file
    name, one of the input files, or an existing file regenerate did not write (unless ``overwrite``)."""
    from eagle_tree.utils.checks import InputError
    from eagle_tree.utils.outputs import check_output_file

    out = Path(cfg.output)
    if out.is_dir() or out.suffix != ".jsonl":
        raise InputError(f"output={cfg.output} must name a .jsonl file (a folder or another suffix is refused "
                         "before any row is generated)")
    if _is_input(out, cfg.data):
        raise InputError(f"output={cfg.output} is one of the input files (data={cfg.data}): writing it would "
                         "replace the rows being read; choose another output file")
    check_output_file(out, "eagle-tree regenerate", overwrite=cfg.overwrite, recognise=is_regenerated)
    return out


def _is_input(out: Path, data: str) -> bool:
    """Whether ``out`` is a file ``data`` names (a file, a glob, or a file under a folder)."""
    import glob

    if data.startswith("stdlib:"):
        return False
    target = out.resolve()
    source = Path(data).expanduser()
    if source.is_dir():
        return source.resolve() in target.parents
    names = glob.glob(os.path.expanduser(data), recursive=True) if glob.has_magic(data) else [str(source)]
    return any(Path(n).resolve() == target for n in names)


def _fingerprint(cfg: RegenerateConfig, batches: Sequence[Sequence[Job]]) -> str:
    """What the rows depend on: the settings and every batch's prompts (not the output path or threads)."""
    import hashlib

    settings = {k: v for k, v in asdict(cfg).items() if k not in ("output", "threads")}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for batch in batches:
        h.update(json.dumps([[j.index, j.temperature, j.prompt_ids] for j in batch]).encode())
    return h.hexdigest()[:16]


def _completed_batches(partial: Path, fingerprint: str) -> int:
    """Batches fully written to ``partial`` by an earlier run of the same job; a torn tail after the
    last marker is cut. A partial file of other settings or data is refused, not mixed in."""
    if not partial.is_file():
        return 0
    lines = partial.read_text().splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.startswith(f'{{"{MARKER}"')), default=-1)
    if last < 0:
        write_text(partial, "")
        return 0
    marker = json.loads(lines[last])
    if marker.get("fingerprint") != fingerprint:
        from eagle_tree.utils.checks import InputError

        raise InputError(f"{partial} holds rows of an interrupted run with other settings or data; rerun with "
                         f"those settings to resume it, or delete the file to start again")
    if last + 1 != len(lines):
        write_text(partial, "".join(lines[: last + 1]))
    return marker[MARKER] + 1
