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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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


def target_distribution(draft: Eagle3DraftModel, target_logits: torch.Tensor):
    """Target logits (B, T, V) -> (p over the draft vocab (B, T, Vd), top token in draft vocab (B, T))."""
    z = target_logits.float()
    in_draft = draft.t2d[z.argmax(-1)]
    p = torch.softmax(z[..., draft.draft_to_target], dim=-1)
    return p, in_draft


def ttt_forward(
    draft: Eagle3DraftModel,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    target_logits: torch.Tensor,
    steps: int = 7,
    decay: float = 0.8,
    lengths: torch.Tensor | None = None,
    overlap: bool = False,
) -> TTTOutput:
    """features (B, T, 3H), input_ids (B, T), loss_mask (B, T) 0/1 on the tokens to predict,
    target_logits (B, T, V); lengths (B,) real lengths of right-padded rows (None: all T).

    ``overlap``: also the mean of ``sum_v min(p(v), q(v))`` per step (``step_overlap``), with ``p`` the
    target's distribution over its whole vocabulary and ``q`` the head's at temperature 1 (zero outside
    the draft vocabulary): the probability that one token sampled from the head is accepted by
    speculative sampling there. It counts every loss position (``overlap_counts``), those whose target
    top token lies outside the draft vocabulary included, where agreement leaves them out."""
    b, t = input_ids.shape
    device = input_ids.device
    ar = torch.arange(t, device=device)
    lengths = torch.full((b,), t, device=device) if lengths is None else lengths.to(device)
    valid_keys = ar[None] < lengths[:, None]  # (B, T)
    p_all, in_draft = target_distribution(draft, target_logits)
    # the target's probabilities on the draft columns, not renormalised (mass outside them is never accepted)
    p_cols = torch.softmax(target_logits.float(), dim=-1)[..., draft.draft_to_target] if overlap else None
    hidden = draft.fuse(features)
    store = DiagonalStore()
    total = hidden.new_zeros(())
    out = TTTOutput(total, [], [], [], [])
    for s in range(steps):
        # inputs: token x_{j+1+s}; position id j + s; target z_{j+1+s}; predicted token x_{j+2+s}
        src = (ar + 1 + s).clamp(max=t - 1)
        tokens = input_ids.gather(1, src[None].expand(b, t))
        positions = (ar + s)[None].expand(b, t)
        hidden, logits = draft.step(hidden, tokens, positions, store, valid_keys)  # logits (B, T, Vd)
        out.logits.append(logits)

        tgt = (ar + 2 + s).clamp(max=t - 1)
        ok = (ar + 2 + s < lengths[:, None]) & loss_mask.gather(1, tgt[None].expand(b, t)).bool()
        p = p_all.gather(1, (ar + 1 + s).clamp(max=t - 1)[None, :, None].expand(b, t, p_all.shape[-1]))
        if p_cols is not None:
            pc = p_cols.gather(1, (ar + 1 + s).clamp(max=t - 1)[None, :, None].expand(b, t, p_cols.shape[-1]))
            ov = torch.minimum(pc, torch.softmax(logits.detach().float(), dim=-1)).sum(-1)  # (B, T)
            out.step_overlap.append(float((ov * ok).sum()) / max(int(ok.sum()), 1))
            out.overlap_counts.append(int(ok.sum()))
        ok = ok & in_draft.gather(1, (ar + 1 + s).clamp(max=t - 1)[None].expand(b, t))
        n = int(ok.sum())
        logq = F.log_softmax(logits.float(), dim=-1)
        kl = (p * (p.clamp_min(1e-30).log() - logq)).sum(-1)  # (B, T)
        step_loss = (kl * ok).sum() / max(n, 1)
        total = total + (decay**s) * step_loss
        agree = (logits.argmax(-1) == p.argmax(-1)) & ok
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
