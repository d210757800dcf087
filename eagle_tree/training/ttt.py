"""Training-time test: the head unrolled over its own outputs, as it runs when drafting.

For a sequence ``x_0..x_{T-1}`` with target features ``f_j`` and target logits ``z_j``:

- step 0 at position ``j`` reads ``(fc(f_j), x_{j+1})`` at position id ``j`` and predicts ``x_{j+2}``;
- step ``s`` at ``j`` reads ``(h^{s-1}_j, x_{j+1+s})`` at position id ``j + s``, where ``h^{s-1}_j``
  is the head's own output feature of step ``s - 1``, and predicts ``x_{j+2+s}``;
- attention at step ``s`` sees the step-0 entries at positions ``<= j`` (the real-feature prefix)
  and the entries of steps ``1..s`` at ``j`` (the diagonal): exactly what a draft node at depth
  ``s`` sees in decoding (the committed pairs, its ancestors, itself), with the same position ids.

Loss of step ``s`` = forward KL from the target distribution ``softmax(z_{j+1+s})`` restricted to
the draft vocabulary (renormalised) to the head's distribution, on positions whose predicted token
is a loss token; weight ``decay ** s``. Rule for positions whose target top token lies outside the
draft vocabulary: they are left out of the loss and of the accuracy (the head cannot propose it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # annotations only: importing the head loads transformers' modeling code
    from eagle_tree.models.head import Eagle3DraftModel


@dataclass
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps, differentiable
    step_losses: list[float]  # per-step mean KL over valid positions
    step_accuracy: list[float]  # per-step top-1 agreement with the target (draft vocab)
    step_counts: list[int]  # valid positions per step
    logits: list[torch.Tensor]  # per step (B, T, Vd), for tests
    step_overlap: list[float] = field(default_factory=list)  # per-step mean sum_v min(p, q), with overlap=True
    overlap_counts: list[int] = field(default_factory=list)  # positions counted per step for the overlap


class DiagonalStore:
    """The keys and values the training-time test has computed so far, as the head's ``step`` reads a
    cache: step 0's entries (the real-feature prefix, seen causally) and one entry per later step at
    each position (the diagonal). ``attend`` stores the new entries and runs the attention module's
    ``attend_diagonal``; its mask is the (B, T) bool of valid (unpadded) keys."""

    def __init__(self) -> None:
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []

    def attend(self, attn, q, k, v, valid_keys: torch.Tensor) -> torch.Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
        else:
            self.diag_k.append(k)
            self.diag_v.append(v)
        return attn.attend_diagonal(q, self.k0, self.v0, self.diag_k, self.diag_v, valid_keys)


class DraftTargets(NamedTuple):
    """What the loss reads of the target's logits, without the (B, T, V) tensor: the draft vocabulary's
    columns ``logits`` (B, T, Vd) and ``top_in_draft`` (B, T) bool, whether the target's top token lies in
    the draft vocabulary (the feature cache stores exactly these; ``stream.batch_targets`` gives them)."""

    logits: torch.Tensor
    top_in_draft: torch.Tensor


def target_distribution(draft: Eagle3DraftModel, target_logits: torch.Tensor | DraftTargets):
    """Target logits (B, T, V), or their :class:`DraftTargets` -> (p over the draft vocab (B, T, Vd), top
    token in draft vocab (B, T)). Both forms give the same two tensors bit for bit."""
    if isinstance(target_logits, DraftTargets):
        return torch.softmax(target_logits.logits.float(), dim=-1), target_logits.top_in_draft.bool()
    z = target_logits.float()
    in_draft = draft.t2d[z.argmax(-1)]
    p = torch.softmax(z[..., draft.draft_to_target], dim=-1)
    return p, in_draft


def kl_rows(p: torch.Tensor, neg_entropy: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(logits)) per row: p (n, V) sums to 1 on each row, ``neg_entropy`` (n,) its
    ``sum p log p``, logits (n, V) float32. ``sum p log p - sum p z + logsumexp z``, without the (n, V)
    log-probabilities; summed row by row (one flat dot over n x V values loses float32 precision)."""
    return neg_entropy - (p * logits).sum(-1) + torch.logsumexp(logits, dim=-1)


def ttt_forward(
    draft: Eagle3DraftModel,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    target_logits: torch.Tensor | DraftTargets,
    steps: int = 7,
    decay: float = 0.8,
    lengths: torch.Tensor | None = None,
    overlap: bool = False,
    keep_logits: bool = False,
) -> TTTOutput:
    """features (B, T, 3H), input_ids (B, T), loss_mask (B, T) 0/1 on the tokens to predict,
    target_logits (B, T, V) or its :class:`DraftTargets`; lengths (B,) real lengths of right-padded rows
    (None: all T).

    ``overlap``: also the mean of ``sum_v min(p(v), q(v))`` per step (``step_overlap``), with ``p`` the
    target's distribution over its whole vocabulary and ``q`` the head's at temperature 1 (zero outside
    the draft vocabulary): the probability that one token sampled from the head is accepted by
    speculative sampling there. It counts every loss position (``overlap_counts``), those whose target
    top token lies outside the draft vocabulary included, where agreement leaves them out.

    The head's logits are computed at the counted positions only (the ``lm_head`` is most of a step's
    cost, and prompts, padding and the last positions of a row are never counted), and the KL as
    ``sum p log p - sum p z + logsumexp z`` over them, the entropy term once for every step; the same
    quantity as the written definition above (tests/test_ttt.py recomputes it position by position).
    ``keep_logits``: also the full (B, T, Vd) logits of every step in ``logits`` (for tests)."""
    if overlap and isinstance(target_logits, DraftTargets):
        raise ValueError("ttt_forward(overlap=True) needs the target's full-vocabulary logits (B, T, V): the "
                         "sampled acceptance reads the probability mass outside the draft vocabulary, which "
                         "DraftTargets does not keep")
    b, t = input_ids.shape
    device = input_ids.device
    ar = torch.arange(t, device=device)
    lengths = torch.full((b,), t, device=device) if lengths is None else lengths.to(device)
    valid_keys = ar[None] < lengths[:, None]  # (B, T)
    p_all, in_draft = target_distribution(draft, target_logits)
    top_all = p_all.argmax(-1)  # (B, T) the target's top token, as a draft-vocabulary index
    neg_entropy = torch.special.xlogy(p_all, p_all).sum(-1)  # (B, T) sum_v p log p, the KL's constant term
    # the target's probabilities on the draft columns, not renormalised (mass outside them is never accepted)
    p_cols = torch.softmax(target_logits.float(), dim=-1)[..., draft.draft_to_target] if overlap else None
    hidden = draft.fuse(features)
    store = DiagonalStore()
    total = hidden.new_zeros((), dtype=torch.float32)
    out = TTTOutput(total, [], [], [], [])
    for s in range(steps):
        # inputs: token x_{j+1+s}; position id j + s; target z_{j+1+s}; predicted token x_{j+2+s}.
        # Only positions j < m = T - 2 - s predict a token inside the row; the rest are never counted.
        m = max(t - 2 - s, 0)
        src = (ar + 1 + s).clamp(max=t - 1)
        tokens = input_ids.gather(1, src[None].expand(b, t))
        positions = (ar + s)[None].expand(b, t)
        counted = torch.zeros(b, t, dtype=torch.bool, device=device)  # loss positions, any target top token
        counted[:, :m] = (ar[:m] + 2 + s < lengths[:, None]) & loss_mask[:, 2 + s : 2 + s + m].bool()
        ok = counted.clone()  # ... whose target top token lies in the draft vocabulary
        ok[:, :m] &= in_draft[:, 1 + s : 1 + s + m]
        rows = counted if overlap else ok
        if keep_logits:
            hidden, full = draft.step(hidden, tokens, positions, store, valid_keys)  # (B, T, Vd)
            out.logits.append(full)
            logits = full[rows]
        else:
            hidden, logits = draft.step(hidden, tokens, positions, store, valid_keys, rows=rows)  # (n, Vd)
        lg = logits.float()
        at = rows[:, :m]  # the selected positions, as rows of the shifted target tensors
        if overlap:
            pc = p_cols[:, 1 + s : 1 + s + m][at]
            ov = torch.minimum(pc, torch.softmax(lg.detach(), dim=-1)).sum(-1)  # (n,)
            out.step_overlap.append(float(ov.sum()) / max(ov.numel(), 1))
            out.overlap_counts.append(ov.numel())
            keep = in_draft[:, 1 + s : 1 + s + m][at]
            lg = lg[keep]
            at = ok[:, :m]
        n = lg.shape[0]
        p = p_all[:, 1 + s : 1 + s + m][at]  # (n, Vd)
        step_loss = kl_rows(p, neg_entropy[:, 1 + s : 1 + s + m][at], lg).sum() / max(n, 1)
        total = total + (decay**s) * step_loss
        agree = lg.argmax(-1) == top_all[:, 1 + s : 1 + s + m][at]
        out.step_losses.append(float(step_loss.detach()))
        out.step_accuracy.append(float(agree.sum()) / max(n, 1))
        out.step_counts.append(n)
    out.loss = total
    return out


def simulated_acceptance_length(step_accuracy: list[float]) -> float:
    """Expected committed tokens per round of a greedy chain whose step-s acceptance given the
    earlier ones is ``acc_s``: 1 + acc_0 + acc_0 acc_1 + ... (the bonus/correction token counts)."""
    total, survive = 1.0, 1.0
    for a in step_accuracy:
        survive *= a
        total += survive
    return total
