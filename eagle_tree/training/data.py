"""Training data: datasets, chat templates, assistant-only loss masks, batches and the draft vocabulary.

An *example* is a mapping with ``input_ids`` (list[int]) and ``loss_mask`` (list[int] of 0/1), the
same length; ``loss_mask[j] = 1`` marks token ``j`` as one the draft is trained to predict (the
training loop does the shift). :func:`load_examples` returns them as a ``datasets.Dataset`` (Arrow,
memory-mapped, so a large corpus does not live in Python lists); a plain ``list[dict]`` works
everywhere an example sequence is expected.

Sources: a hub id, or local json / jsonl / parquet / text files given as a path, a glob, a directory
(searched recursively) or a list of those. A row holds either a conversation (column
``conversations`` or ``messages``: a list of ``{"from", "value"}`` ShareGPT messages with
``from`` in human/gpt/system, or ``{"role", "content"}`` messages) or plain ``text``.

Loss-mask rule for conversations (template-agnostic, no ``{% generation %}`` markers needed). Let
``render(m, gen)`` be the chat template's text for messages ``m`` (with the generation prompt when
``gen``). For the assistant message ``i`` the loss span is the characters

    start = len(common_prefix(render(m[:i], gen=True), render(m[:i+1])))
    end   = len(render(m[:i+1])) with trailing whitespace removed

of ``render(m)``: everything the template emits for that turn after the assistant header (the
generation prompt), i.e. the content and the end-of-turn token(s) (``<|im_end|>``, ``<|eot_id|>``,
``</s>``), but not the header/role tokens nor the whitespace the template puts between turns
(ChatML's ``\\n`` after ``<|im_end|>``). A token is in the loss when its character range overlaps a
span (the rule transformers uses for ``{% generation %}``); special tokens the tokenizer adds
outside the text are not. ``render(m[:i+1])`` must be a prefix of ``render(m)``; a template that
re-renders earlier turns differently (e.g. one that drops reasoning from old turns) is refused
with a ValueError unless it marks assistant text with ``{% generation %}``: templates that do are
masked by their own markers (``return_assistant_tokens_mask``) instead. Assistant messages before
the first non-assistant message are dropped (a conversation cannot open with the reply).

Plain text: every token of the text is in the loss; special tokens the tokenizer adds (BOS) are not.

Length rule: a sample longer than ``max_length`` tokens is cut to its first ``max_length`` tokens
(``too_long="truncate"``) or dropped (``too_long="drop"``); any sample left without a loss token
(no assistant reply, empty text, or truncated before the first reply) is dropped.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from eagle_tree.data.rows import CONVERSATION_FIELDS, ROLES, TEXT_FIELDS, DataError, load_raw, normalize_messages
from eagle_tree.utils.checks import check_ranges
from eagle_tree.utils.config import ConfigValueError

logger = logging.getLogger(__name__)

__all__ = [
    "DataConfig",
    "load_examples",
    "assistant_spans",
    "encode_conversation",
    "encode_text",
    "fit_length",
    "Batch",
    "batches",
    "num_batches",
    "epoch_order",
    "epoch_batches",
    "example_lengths",
    "padding_fraction",
    "token_frequencies",
    "draft_vocab_from_counts",
    "build_draft_vocab",
]

TooLong = Literal["truncate", "drop"]


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class DataConfig:
    """Where the training data is and how it is tokenised; embedded in the training config."""

    path: str | list[str]
    """hub dataset id, or local json/jsonl/parquet/text file(s): a path, a glob, a directory or a list of them"""
    split: str = "train"
    """split to read; local files form the 'train' split (slices such as 'train[:95%]' work)"""
    max_length: int = 2048
    """longest sample in tokens"""
    too_long: TooLong = "truncate"
    """longer samples: 'truncate' keeps the first max_length tokens (dropped if no loss token remains), 'drop' drops
    them"""
    limit: int | None = None
    """read only the first N rows of the split"""
    text_field: str | None = None
    """plain-text column (default: 'text')"""
    conversations_field: str | None = None
    """conversation column (default: 'conversations', then 'messages')"""
    text_sample_by: Literal["line", "paragraph", "document"] = "document"
    """for .txt files: one sample per line, paragraph or whole file"""
    draft_vocab_size: int = 32000
    """size of the draft vocabulary (most frequent loss-masked target tokens); >= the target vocabulary means
    all of it"""
    num_proc: int | None = None
    """processes for tokenisation (None: one)"""
    max_missing_fraction: float = 0.1
    """rows lacking the text / conversation field (null or absent) are skipped with a warning up to this
    fraction of the rows; above it the data is refused"""
    cache_dir: str | None = None
    """datasets cache directory (None: HF default)"""
    length_grouping: int = 0
    """batch order: 0 draws each micro-batch's examples from a random permutation per epoch; N > 0 cuts that
    permutation into pools of N micro-batches, sorts each pool by length and cuts it into micro-batches, whose order
    is then shuffled (seeded), so examples of like length share a batch and less of it is padding (each batch
    then weighs its own tokens' mean, so short examples weigh more than under random batches)"""

    def __post_init__(self) -> None:
        paths = [self.path] if isinstance(self.path, str) else list(self.path)
        if not paths or any(not isinstance(p, str) or not p.strip() for p in paths):
            raise ConfigValueError("path", f"must name a dataset (a hub id, a file, a folder or a glob, or a "
                                   f"non-empty list of them), got {self.path!r}")
        check_ranges(self, max_length=1, limit=1, draft_vocab_size=1, num_proc=1, length_grouping=0)
        if not 0.0 <= self.max_missing_fraction <= 1.0:
            raise ConfigValueError("max_missing_fraction", f"must lie in [0, 1], got {self.max_missing_fraction!r}")
        if self.too_long not in ("truncate", "drop"):
            raise ConfigValueError("too_long", f"must be 'truncate' or 'drop', got {self.too_long!r}")

    def load(self, tokenizer):
        """:func:`load_examples` with these settings."""
        return load_examples(
            self.path, tokenizer, split=self.split, max_length=self.max_length, too_long=self.too_long,
            text_field=self.text_field, conversations_field=self.conversations_field, limit=self.limit,
            text_sample_by=self.text_sample_by, num_proc=self.num_proc, cache_dir=self.cache_dir,
            max_missing_fraction=self.max_missing_fraction,
        )


# ---------------------------------------------------------------------------------------------
# reading


def load_examples(
    source,
    tokenizer,
    *,
    split: str = "train",
    max_length: int = 2048,
    too_long: TooLong = "truncate",
    text_field: str | None = None,
    conversations_field: str | None = None,
    limit: int | None = None,
    text_sample_by: Literal["line", "paragraph", "document"] = "document",
    num_proc: int | None = None,
    cache_dir: str | None = None,
    max_missing_fraction: float = 0.1,
):
    """Read ``source`` and tokenise it into a ``datasets.Dataset`` of ``input_ids`` / ``loss_mask``.

    source: a hub id, local file(s) (path, glob, directory, or a list of them), or a
    ``datasets.Dataset``. ``limit`` keeps the first rows of the split before tokenising. Samples are
    kept in order; those that fail the length rule or have no loss token are dropped (counted in the log).
    """
    if too_long not in ("truncate", "drop"):
        raise ValueError(f"too_long must be 'truncate' or 'drop', got {too_long!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    import datasets

    raw = source if isinstance(source, datasets.Dataset) else load_raw(source, split, text_sample_by, cache_dir)
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    kind, column = _find_column(raw.column_names, text_field, conversations_field, source)
    _check_missing(raw, column, source, max_missing_fraction)
    if kind == "conversations" and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"the dataset {source!r} holds conversations but the target's tokenizer has no "
                        "chat_template: use a chat model's tokenizer, or plain text rows (a 'text' field)")
    if kind == "conversations":
        _warn_if_replies_empty(raw, column, source)
    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8"))}
    )
    encoded = raw.map(
        _encode_rows,
        batched=True,
        remove_columns=raw.column_names,
        features=features,
        fn_kwargs=dict(tokenizer=tokenizer, kind=kind, column=column, max_length=max_length, too_long=too_long,
                       source=source if isinstance(source, str | list) else "the dataset"),
        with_indices=True,
        num_proc=num_proc,
        desc="tokenising",
    )
    dropped = len(raw) - len(encoded)
    if dropped:
        logger.info("dropped %d of %d samples (too long with too_long=%r, or no loss token)",
                    dropped, len(raw), too_long)
    return encoded


def _check_missing(raw, column: str, source, max_fraction: float) -> int:
    """Count the rows whose ``column`` is null (absent in that row); warn, or refuse above ``max_fraction``."""
    missing = raw.data.column(column).null_count if len(raw) else 0
    if missing:
        share = missing / len(raw)
        msg = f"{missing} of {len(raw)} rows of {source!r} ({share:.0%}) have no {column!r} field"
        if share > max_fraction:
            raise DataError(f"{msg}: more than data.max_missing_fraction={max_fraction}; check the field name "
                            f"(data.text_field / data.conversations_field) or raise data.max_missing_fraction")
        warnings.warn(f"{msg}; they are skipped", stacklevel=3)
    return missing


def _find_column(found: list[str], text_field: str | None, conversations_field: str | None, source) -> tuple[str, str]:
    """("conversations" | "text", column name), or a DataError naming the fields found and expected."""
    where = f"dataset {source!r}" if isinstance(source, str | list) else "the dataset"
    for kind, name in (("conversations", conversations_field), ("text", text_field)):
        if name is not None:
            if name not in found:
                raise DataError(f"{where} has no field {name!r} (set by {kind}_field); fields found: {found}")
            return kind, name
    for kind, names in (("conversations", CONVERSATION_FIELDS), ("text", TEXT_FIELDS)):
        for name in names:
            if name in found:
                return kind, name
    raise DataError(
        f"{where} has fields {found}; expected a conversation field {list(CONVERSATION_FIELDS)} (a list of "
        f"{{'from', 'value'}} or {{'role', 'content'}} messages) or a text field {list(TEXT_FIELDS)}; "
        f"name another column with conversations_field= or text_field="
    )


def _encode_rows(rows: dict[str, list], indices: list[int], tokenizer, kind: str, column: str, max_length: int,
                 too_long: TooLong, source):
    out: dict[str, list] = {"input_ids": [], "loss_mask": []}
    for index, sample in zip(indices, rows[column], strict=True):
        where = f"{source!r}, row {index + 1}"
        if kind == "conversations":
            if sample is not None and not (isinstance(sample, list) and all(isinstance(m, dict) for m in sample)):
                raise DataError(f"{where}: the {column!r} field holds {_kind_of(sample)}, not a list of messages "
                                "({'role', 'content'} or {'from', 'value'} objects); fix the row or drop it")
            try:
                messages = normalize_messages(sample or [])
            except ValueError as exc:
                raise DataError(f"{where}: {exc}") from None
            example = encode_conversation(messages, tokenizer)
        else:
            if sample is not None and not isinstance(sample, str):
                raise DataError(f"{where}: the {column!r} field holds {_kind_of(sample)}, not text; quote it as a "
                                "string or drop the row")
            example = encode_text(sample or "", tokenizer)
        example = fit_length(example, max_length, too_long)
        if example is not None:
            out["input_ids"].append(example["input_ids"])
            out["loss_mask"].append(example["loss_mask"])
    return out


def _kind_of(value) -> str:
    shown, name = repr(value), type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({shown[:40] + '...' if len(shown) > 40 else shown})"


def _warn_if_replies_empty(raw, column: str, source, sample: int = 1000) -> None:
    """Warn when most conversations (of the first ``sample``) have only empty assistant turns: the loss
    would fall on the chat template's own tokens, and the head would learn the template, not replies."""
    rows = raw.select_columns([column]).select(range(min(sample, len(raw))))[column]
    with_replies = empty = 0
    for messages in rows:
        if not isinstance(messages, list):
            continue
        replies = [m for m in messages if isinstance(m, dict)
                   and ROLES.get(str(m.get("role") or m.get("from")).lower()) == "assistant"]
        if replies:
            with_replies += 1
            empty += all(not str(m.get("content") or m.get("value") or "").strip() for m in replies)
    if with_replies and empty * 2 > with_replies:
        warnings.warn(f"{empty} of the first {with_replies} conversations of {source!r} with assistant turns have "
                      "only empty ones: the loss falls on the chat template's tokens alone; check "
                      "data.conversations_field and the data", stacklevel=3)


# ---------------------------------------------------------------------------------------------
# tokenising


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(messages: list[dict[str, str]], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span ``[start, end)`` of every assistant turn
    (the module docstring states the rule). Raises ValueError if the template renders prefixes inconsistently."""
    text = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        through = _render(tokenizer, messages[: i + 1])
        if not text.startswith(through):
            raise ValueError(
                f"the chat template renders messages[:{i + 1}] differently from the start of the whole "
                "conversation, so assistant spans cannot be found by rendering prefixes; mark the assistant "
                "text in the template with {% generation %} ... {% endgeneration %}"
            )
        start = len(os.path.commonprefix([_render(tokenizer, messages[:i], generation_prompt=True), through]))
        spans.append((start, start + len(through[start:].rstrip())))
    return text, spans


def _mask_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for tokens whose character range [s, e) overlaps a span; 0 for empty ranges (added tokens)."""
    return [int(e > s and any(s < b and e > a for a, b in spans)) for s, e in offsets]


def encode_conversation(messages: list[dict[str, str]], tokenizer) -> dict[str, list[int]]:
    """Normalised messages -> ``input_ids`` through the chat template and the assistant-only ``loss_mask``."""
    if not messages:
        return {"input_ids": [], "loss_mask": []}
    template = tokenizer.get_chat_template()
    if _GENERATION_TAG.search(template):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return {"input_ids": list(enc["input_ids"]), "loss_mask": [int(v) for v in enc["assistant_masks"]]}
    text, spans = assistant_spans(messages, tokenizer)
    enc = _encode_with_offsets(tokenizer, text, add_special_tokens=False)
    return {"input_ids": enc["input_ids"], "loss_mask": _mask_from_spans(enc["offset_mapping"], spans)}


def encode_text(text: str, tokenizer) -> dict[str, list[int]]:
    """Plain text -> ``input_ids`` with the tokenizer's special tokens (BOS), loss on every text token."""
    enc = _encode_with_offsets(tokenizer, text, add_special_tokens=True)
    return {"input_ids": enc["input_ids"], "loss_mask": [int(e > s) for s, e in enc["offset_mapping"]]}


def _encode_with_offsets(tokenizer, text: str, add_special_tokens: bool):
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("loss masks need character offsets: use a fast (Rust) tokenizer")
    return tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)


def fit_length(example: dict[str, list[int]], max_length: int, too_long: TooLong = "truncate"):
    """The length rule: the example, its first ``max_length`` tokens, or None (dropped)."""
    ids, mask = example["input_ids"], example["loss_mask"]
    if len(ids) > max_length:
        if too_long == "drop":
            return None
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    return {"input_ids": list(ids), "loss_mask": list(mask)}


# ---------------------------------------------------------------------------------------------
# batches


@dataclass
class Batch:
    """Right-padded examples; ``index`` is the batch's position in its epoch (resume at ``index + 1``)."""

    input_ids: torch.Tensor  # (B, T) long, pad_id after each example's length
    loss_mask: torch.Tensor  # (B, T) long 0/1, 0 on padding
    lengths: torch.Tensor  # (B,) long
    indices: list[int]  # the examples' indices in the example sequence
    index: int

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, T) long: 1 on real tokens, 0 on padding."""
        positions = torch.arange(self.input_ids.shape[1])
        return (positions[None, :] < self.lengths[:, None]).long()


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``range(n)`` for (seed, epoch): a function of the three only (numpy PCG64)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def num_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    return n // batch_size if drop_last else -(-n // batch_size)


def example_lengths(examples) -> np.ndarray:
    """(n,) int64: each example's token count, read once (a datasets.Dataset column by column)."""
    return np.asarray([len(ids) for ids, _ in iter_token_columns(examples)], dtype=np.int64)


def epoch_batches(
    n: int,
    batch_size: int,
    seed: int,
    epoch: int,
    *,
    drop_last: bool = False,
    lengths: np.ndarray | None = None,
    length_grouping: int = 0,
) -> list[list[int]]:
    """The example indices of every micro-batch of one epoch, in order: a function of the arguments only.

    ``length_grouping=0``: consecutive slices of ``epoch_order(n, seed, epoch)``. ``length_grouping=G > 0``:
    that permutation is cut into pools of ``G * batch_size`` examples; each pool is sorted by ``lengths``
    (longest first, ties in permutation order) and cut into micro-batches; the micro-batches of the epoch are
    then put in an order drawn from (seed, epoch). Every example still appears once an epoch, and there are
    as many batches as without grouping (only the last pool can end in a partial batch).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if length_grouping < 0:
        raise ValueError(f"length_grouping must be >= 0, got {length_grouping}")
    order = epoch_order(n, seed, epoch)
    if length_grouping == 0:
        return [order[b * batch_size : (b + 1) * batch_size].tolist()
                for b in range(num_batches(n, batch_size, drop_last))]
    if lengths is None or len(lengths) != n:
        raise ValueError(f"length_grouping={length_grouping} needs the {n} examples' lengths, got "
                         f"{None if lengths is None else len(lengths)}")
    lengths = np.asarray(lengths)
    pool = length_grouping * batch_size
    groups: list[list[int]] = []
    for p in range(0, n, pool):
        chunk = order[p : p + pool]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        groups += [chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
    if drop_last and groups and len(groups[-1]) < batch_size:
        groups.pop()
    shuffle = np.random.default_rng([seed, epoch, 1]).permutation(len(groups))
    return [groups[i] for i in shuffle]


def padding_fraction(batch_indices: Sequence[Sequence[int]], lengths: np.ndarray) -> float:
    """The share of the padded (B, T) positions of these micro-batches that are padding."""
    lengths = np.asarray(lengths)
    real = sum(int(lengths[b].sum()) for b in batch_indices)
    padded = sum(len(b) * int(lengths[b].max()) for b in batch_indices)
    return 1.0 - real / padded if padded else 0.0


def batches(
    examples: Sequence[Any],
    batch_size: int,
    seed: int,
    epoch: int,
    *,
    pad_id: int = 0,
    start: int = 0,
    drop_last: bool = False,
    lengths: np.ndarray | None = None,
    length_grouping: int = 0,
) -> Iterator[Batch]:
    """The batches of one epoch in the order fixed by (seed, epoch), from batch number ``start``.

    ``batches(..., start=k)`` yields exactly ``list(batches(...))[k:]`` without touching the first
    ``k`` batches' examples: resume with ``start`` = the number of batches consumed this epoch. With
    ``length_grouping`` > 0 the batches are :func:`epoch_batches`' length-grouped ones (``lengths``:
    :func:`example_lengths`, computed here when not given).
    """
    if length_grouping and lengths is None:
        lengths = example_lengths(examples)
    plan = epoch_batches(len(examples), batch_size, seed, epoch, drop_last=drop_last, lengths=lengths,
                         length_grouping=length_grouping)
    for b in range(start, len(plan)):
        indices = plan[b]
        ids, masks = _gather(examples, indices)
        lengths_b = torch.tensor([len(x) for x in ids], dtype=torch.long)
        width = int(lengths_b.max())
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
        loss_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, (x, m) in enumerate(zip(ids, masks, strict=True)):
            input_ids[row, : len(x)] = torch.as_tensor(x, dtype=torch.long)
            loss_mask[row, : len(m)] = torch.as_tensor(m, dtype=torch.long)
        yield Batch(input_ids, loss_mask, lengths_b, indices, b)


def _gather(examples, indices: list[int]) -> tuple[list, list]:
    if hasattr(examples, "column_names"):  # a datasets.Dataset: one columnar read
        rows = examples[indices]
        return rows["input_ids"], rows["loss_mask"]
    rows = [examples[i] for i in indices]
    return [r["input_ids"] for r in rows], [r["loss_mask"] for r in rows]


# ---------------------------------------------------------------------------------------------
# draft vocabulary


def token_frequencies(examples, vocab_size: int, chunk_tokens: int = 1 << 22) -> torch.Tensor:
    """(vocab_size,) long: how often each target id occurs at a loss-masked position."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending: list[np.ndarray] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if pending:
            ids = np.concatenate(pending)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"token ids outside [0, {vocab_size}): min {ids.min()}, max {ids.max()}")
            counts[:] += np.bincount(ids, minlength=vocab_size)
            pending.clear()
            size = 0

    for ids, mask in iter_token_columns(examples):
        masked = np.asarray(ids, dtype=np.int64)[np.asarray(mask, dtype=bool)]
        pending.append(masked)
        size += masked.size
        if size >= chunk_tokens:
            flush()
    flush()
    return torch.from_numpy(counts)


def iter_token_columns(examples) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each example of a datasets.Dataset (read in batches) or a list of dicts."""
    if hasattr(examples, "iter") and hasattr(examples, "column_names"):  # datasets.Dataset
        for rows in examples.iter(batch_size=1024):
            yield from zip(rows["input_ids"], rows["loss_mask"], strict=True)
    else:
        for ex in examples:
            yield ex["input_ids"], ex["loss_mask"]


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Sorted ids of the ``draft_vocab_size`` largest counts, ties (zero counts included) to the smaller id.

    So when fewer than ``draft_vocab_size`` ids were seen, the rest are the smallest unseen ids; when
    ``draft_vocab_size >= len(counts)``, all ids.
    """
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    counts = torch.as_tensor(counts).long()
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep id order
    return order[:draft_vocab_size].sort().values


def build_draft_vocab(examples, vocab_size_target: int, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: sorted target ids (LongTensor) of the most frequent loss-masked tokens.

    Pass it to ``Eagle3DraftModel.from_target(target, draft_vocab=ids)`` (or ``vocab_maps``). Rule:
    by count descending, ties to the smaller id; ids never seen fill the rest in increasing order;
    ``draft_vocab_size >= vocab_size_target`` gives the whole vocabulary.
    """
    if draft_vocab_size >= vocab_size_target:
        return torch.arange(vocab_size_target)
    return draft_vocab_from_counts(token_frequencies(examples, vocab_size_target), draft_vocab_size)
