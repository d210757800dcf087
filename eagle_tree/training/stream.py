"""The data stream of a training run: micro-batches in a resumable order, and their target features and
logits (online from the target, or read from a FeatureCache)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eagle_tree.training.data import batches, example_lengths
from eagle_tree.training.feature_cache import compress_logits, example_targets
from eagle_tree.training.ttt import DraftTargets

__all__ = ["DataStream", "pad_targets", "batch_targets"]


class DataStream:
    """Micro-batches epoch after epoch in the order fixed by (seed, epoch) (and, with ``length_grouping``,
    the examples' lengths: data.epoch_batches); the position is resumable."""

    def __init__(self, examples, batch_size: int, seed: int, pad_id: int, epoch: int = 0, index: int = 0,
                 length_grouping: int = 0):
        self.examples, self.batch_size, self.seed, self.pad_id = examples, batch_size, seed, pad_id
        self.epoch, self.index = epoch, index
        self.length_grouping = length_grouping
        self.lengths = example_lengths(examples) if length_grouping else None
        self._it: Iterator | None = None

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def next(self):
        while True:
            if self._it is None:
                self._it = batches(self.examples, self.batch_size, self.seed, self.epoch, pad_id=self.pad_id,
                                   start=self.index, lengths=self.lengths, length_grouping=self.length_grouping)
            batch = next(self._it, None)
            if batch is not None:
                self.index = batch.index + 1
                return batch
            self.epoch, self.index, self._it = self.epoch + 1, 0, None

    def take(self, n: int) -> list:
        return [self.next() for _ in range(n)]



def pad_targets(rows: list[tuple[torch.Tensor, ...]], width: int) -> tuple[torch.Tensor, ...]:
    """Per-example tensors of equal rank, each (T_i, ...) -> right-padded (B, width, ...), one per part:
    (features, logits) or (features, draft_logits, top_in_draft). Padding is zeros (finite logits, so
    the masked-out padded positions stay NaN-free; False for a bool flag)."""
    out = tuple(part.new_zeros((len(rows), width, *part.shape[1:])) for part in rows[0])
    for i, row in enumerate(rows):
        for padded, part in zip(out, row, strict=True):
            padded[i, : part.shape[0]] = part
    return out


def batch_targets(batch, target=None, cache=None, device=None, draft=None) -> tuple[torch.Tensor, DraftTargets]:
    """(features (B, T, 3H), :class:`~eagle_tree.training.ttt.DraftTargets` (B, T, Vd) / (B, T)) of a
    data.Batch, read from a FeatureCache or computed online from the target (then compressed to the draft
    vocabulary's columns with ``draft``'s vocabulary, as the cache stores them). The loss reads nothing
    else of the logits, and never the (B, T, V) tensor: padding it costs more than the head's attention.
    Padding is zeros, and ``top_in_draft`` False (padded positions are never counted)."""
    rows = []
    for row, i in enumerate(batch.indices):
        if cache is not None:
            rows.append(cache.get(i))
        else:
            if draft is None:
                raise ValueError("batch_targets without a cache needs the draft head (its draft vocabulary)")
            ids = batch.input_ids[row, : int(batch.lengths[row])]
            features, logits = example_targets(target, ids)
            rows.append((features, *compress_logits(logits, draft.draft_to_target, draft.t2d)))
    features, logits, top = pad_targets(rows, batch.input_ids.shape[1])
    if device is not None:
        features, logits, top = features.to(device), logits.to(device), top.to(device)
    return features, DraftTargets(logits, top)
