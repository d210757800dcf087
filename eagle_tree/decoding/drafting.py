"""Drafting with the head's own cache: the dynamic tree of EAGLE-2/3, and the chain.

Positions follow the target: the draft pair ``(f_j, x_{j+1})`` sits at position ``j``; a tree node
at depth ``d`` under a root whose last draft pair sits at position ``c`` is fed at ``c + d`` and
sees the committed pairs, its ancestors and itself (training unrolls the same pattern).

Deterministic trees (``sampled=False``): each expanded node proposes its ``top_k`` most likely
children; the ``top_k`` best nodes of a level by cumulative log-probability are expanded next, and a
global rerank keeps the ``total_tokens`` best nodes (parents always before their children). They are
verified with the "deterministic" rule (or "greedy" at temperature 0).

Sampled trees (``sampled=True``): each expanded node draws ``top_k`` children without replacement
from its processed draft distribution ``q`` (Gumbel-top-k, from the drafter's own generator), and no
sampled child is ever pruned; whole levels are dropped only by a rule fixed by the config. They
are verified with the "without_replacement" rule. Both kinds are exact (docs/EXACTNESS.md, "Sampled trees").

Growth is tensor work: per level one sort of the previous level's scores picks the frontier, one head
forward feeds it, one top-k (or one Gumbel-top-k draw from the drafter's generator) over the whole
frontier creates the children; scores, parents, tokens, ancestors and output features live in tensors
allocated once per drafter, the visibility of a level is read from the ancestor matrix, and the final
tree goes to the host in one transfer per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import Proposal, VerifyRule
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.models.head import Eagle3DraftModel


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft. depth: levels below the root; top_k: children per expanded node and
    nodes expanded per level; total_tokens: nodes kept after the global rerank; sampled: draw
    children (Gumbel-top-k) instead of taking the top-k; context: branches copied from the committed
    text, merged into the tree (None: off; their nodes count beside total_tokens, see context.py)."""

    depth: int = 6
    top_k: int = 8
    total_tokens: int = 48
    sampled: bool = False
    context: ContextConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.context, dict):  # from a JSON or YAML mapping
            object.__setattr__(self, "context", ContextConfig(**self.context))
        for name in ("depth", "top_k", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TreeConfig.{name} must be an integer >= 1, got {value!r}")
        if self.sampled and self.top_k > self.total_tokens:
            raise ValueError(
                f"a sampled tree keeps every child it draws, so top_k ({self.top_k}) must be <= total_tokens "
                f"({self.total_tokens})"
            )

    @classmethod
    def chain(cls, length: int, sampled: bool = False) -> TreeConfig:
        """A chain of ``length`` draft tokens: the tree with one child per node."""
        return cls(depth=length, top_k=1, total_tokens=length, sampled=sampled)

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    def rule(self, sampling: SamplingConfig) -> VerifyRule:
        """The verification rule that is exact for drafts of this shape under ``sampling``."""
        return VerifyRule.for_draft(sampling.greedy, self.sampled)


class DraftCache:
    """Keys and values (1, n_kv, S, hd) of the draft's single layer in a growing buffer.

    ``append`` writes at the end, ``crop`` forgets the tail: tree nodes are appended while drafting
    and cropped afterwards, so the cache keeps only entries of committed pairs between rounds.
    ``attend`` is what the head's ``step`` calls: append the new entries, attend over all of them.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        if self.k is None or self.length + n > self.k.shape[2]:
            capacity = max(256, 2 * (self.length + n))
            new_k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
            new_v = v.new_empty(new_k.shape)
            if self.k is not None:
                new_k[:, :, : self.length] = self.k[:, :, : self.length]
                new_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = new_k, new_v
        self.k[:, :, self.length : self.length + n] = k
        self.v[:, :, self.length : self.length + n] = v
        self.length += n

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Append k/v (1, n_kv, T, hd), then ``attn.attend`` over the cache; mask (1, 1, T, S_after) bool."""
        self.append(k, v)
        return attn.attend(q, *self.view(), mask)


@runtime_checkable
class DrafterProtocol(Protocol):
    """What SpeculativeDecoder needs from a drafter.

    ``reset()`` starts a new sequence; ``catch_up(features, next_tokens)`` consumes committed pairs:
    target features (1, m, 3H) of m committed positions and the tokens that follow them (1, m);
    ``propose(sampling, generator)`` returns a Proposal below the last committed token, drawing any
    randomness from ``generator`` only."""

    def reset(self) -> None: ...

    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None: ...

    def propose(self, sampling: SamplingConfig, generator: torch.Generator | None = None) -> Proposal: ...


@dataclass(frozen=True)
class _Plan:
    """Static shape of a tree's growth: children per node ``k``; per level, the range [lo, hi) of the
    creation indices of the nodes it creates and the width of the frontier fed to make them (level 0:
    the root's children)."""

    k: int
    levels: tuple[tuple[int, int, int], ...]  # (lo, hi, frontier width)

    @classmethod
    def of(cls, cfg: TreeConfig, draft_vocab: int, sampled: bool) -> _Plan:
        k = min(cfg.top_k, draft_vocab)
        levels, hi = [(0, k, 1)], k
        for _ in range(1, cfg.depth):
            lo, prev_hi, _ = levels[-1]
            width = min(cfg.top_k, prev_hi - lo)
            if sampled and hi + width * cfg.top_k > cfg.total_tokens:
                break  # sampled trees drop whole levels, by a rule fixed by the config
            levels.append((hi, hi + width * k, width))
            hi += width * k
        return cls(k, tuple(levels))

    @property
    def nodes(self) -> int:
        return self.levels[-1][1]


class _Buffers:
    """Per-drafter tensors of one tree's growth, indexed by row (``Tree.row``: the root is row 0, the
    node created i-th is row i + 1); every entry a round reads is written in that round first."""

    def __init__(self, n: int, hidden_size: int, draft_vocab: int, dtype: torch.dtype, device: torch.device):
        rows = n + 1
        self.score = torch.zeros(rows, device=device)  # cumulative draft log-probability (root: 0)
        self.parent = torch.zeros(rows, dtype=torch.long, device=device)  # the parent's row (0 = the root)
        self.token = torch.zeros(rows, dtype=torch.long, device=device)  # target id
        self.live = torch.ones(rows, dtype=torch.bool, device=device)  # False: a draw past q's support
        self.identity = torch.eye(rows, dtype=torch.bool, device=device)
        self.ancestors = self.identity.clone()  # [r, c]: row c is row r or one of its ancestors
        self.out = torch.empty(rows, hidden_size, dtype=dtype, device=device)  # the head's output (root: last_hidden)
        self.expanded = torch.zeros(rows, dtype=torch.bool, device=device)
        self.q = torch.empty(rows, draft_vocab, device=device)  # the law of the row's children
        self.rows = torch.arange(rows, device=device)
        self.remap = torch.zeros(rows, dtype=torch.long, device=device)  # row -> row in the kept tree


class Drafter:
    """Runs an Eagle3DraftModel over committed pairs and grows draft trees from the last one
    (implements DrafterProtocol)."""

    def __init__(self, draft: Eagle3DraftModel, tree: TreeConfig):
        self.draft = draft
        self.config = tree
        self._buffers: _Buffers | None = None
        self._plans: dict[bool, _Plan] = {}
        self.reset()

    def reset(self) -> None:
        self.cache = DraftCache()
        self.last_hidden: torch.Tensor | None = None  # (1, 1, H): output at the last committed pair
        self.last_logits: torch.Tensor | None = None  # (Vd,)

    def _forward(self, hidden, input_ids, position_ids, visible):
        """One head step over the draft cache. visible (1, 1, T, S_after) bool. Returns (out, logits)."""
        out, logits, _ = self.draft.step(hidden, input_ids, position_ids, self.cache, visible)
        return out, logits

    @torch.no_grad()
    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Consume committed pairs: features (1, m, 3H) of tokens at positions c..c+m-1 and the
        tokens that follow them (1, m), in target ids."""
        m, start = features.shape[1], self.cache.length
        hidden = self.draft.fuse(features.to(self.draft.fc.weight.dtype))
        positions = torch.arange(start, start + m, device=features.device)[None]
        visible = torch.ones(m, start + m, dtype=torch.bool, device=features.device).tril(start)
        out, logits = self._forward(hidden, next_tokens, positions, visible[None, None])
        self.last_hidden, self.last_logits = out[:, -1:], logits[0, -1].float()

    @torch.no_grad()
    def follow(self, tokens: list[int]) -> list[torch.Tensor]:
        """Draft logits (Vd,) at depths 1..len(tokens)+1 along a given chain of target ids below the
        root; the cache is left as it was. Training's step s equals depth s + 1 here."""
        committed, hidden = self.cache.length, self.last_hidden
        logits = [self.last_logits]
        try:
            for depth, token in enumerate(tokens, start=1):
                ids = torch.tensor([[token]], device=hidden.device)
                pos = torch.tensor([[committed - 1 + depth]], device=hidden.device)
                visible = torch.ones(1, 1, 1, self.cache.length + 1, dtype=torch.bool, device=hidden.device)
                hidden, step_logits = self._forward(hidden, ids, pos, visible)
                logits.append(step_logits[0, -1].float())
        finally:
            self.cache.crop(committed)
        return logits

    def _buffers_for(self, plan: _Plan) -> _Buffers:
        b, hidden = self._buffers, self.last_hidden
        if b is None or b.score.shape[0] <= plan.nodes or b.out.device != hidden.device:
            vocab = self.draft.config.draft_vocab_size
            b = self._buffers = _Buffers(plan.nodes, hidden.shape[-1], vocab, hidden.dtype, hidden.device)
        return b

    @torch.no_grad()
    def propose(self, sampling: SamplingConfig, generator: torch.Generator | None = None) -> Proposal:
        """Grow a tree below the root (the last committed token) and return it in target ids."""
        if self.last_hidden is None:
            raise RuntimeError("catch_up must run before propose")
        cfg = self.config
        sampled = cfg.sampled and not sampling.greedy
        plan = self._plans.get(sampled)
        if plan is None:
            plan = self._plans[sampled] = _Plan.of(cfg, self.draft.config.draft_vocab_size, sampled)
        b = self._buffers_for(plan)
        committed = self.cache.length
        try:
            growth = _Growth(self, b, plan, sampling if sampled else None, generator)
            keep, whole = growth.run()
        finally:
            self.cache.crop(committed)
        return self._proposal(b, keep, whole, sampled, sampling)

    def _proposal(self, b: _Buffers, keep: torch.Tensor, whole: bool, sampled: bool,
                  sampling: SamplingConfig) -> Proposal:
        """The kept rows (ascending; ``whole``: every row grown) as a Tree: one host transfer."""
        n = keep.shape[0]
        if whole:  # the rows are the tree's own
            parents, tokens = torch.stack([b.parent[1 : n + 1] - 1, b.token[1 : n + 1]]).tolist()
        else:
            b.remap[keep] = b.rows[1 : n + 1]
            parents, tokens = torch.stack([b.remap[b.parent[keep]] - 1, b.token[keep]]).tolist()
        draft_probs = None
        if sampled:
            rows = torch.cat([b.rows[:1], keep])  # the root's row and the kept rows
            q = torch.where(b.expanded[rows, None], b.q[rows], 0.0)  # nodes without children carry no law
            draft_probs = q.new_zeros(n + 1, self.draft.config.vocab_size)
            draft_probs[:, self.draft.draft_to_target] = q
        return Proposal(Tree(parents, tokens), draft_probs, self.config.rule(sampling))


class _Growth:
    """One tree expansion over the drafter's buffers, level by level, without host round trips."""

    def __init__(self, drafter: Drafter, buffers: _Buffers, plan: _Plan, sampling: SamplingConfig | None,
                 generator):
        self.d, self.b, self.plan = drafter, buffers, plan
        self.cfg = drafter.config
        self.sampling = sampling  # None: deterministic top-k children
        self.generator = generator

    def expand(self, rows: torch.Tensor, logits: torch.Tensor, lo: int, hi: int, last: bool) -> None:
        """Create the children of the nodes at ``rows`` (F,) from their draft logits (F, Vd), as rows
        lo + 1 .. hi, node by node, each node's children in proposal order. Deterministic: every node's
        top-k. Sampled: Gumbel-top-k, up to k children drawn without replacement from each node's
        processed q, one draw for the whole level from the drafter's generator. ``last``: the children's
        ancestors are not needed (no level is fed from them, or the tree is a chain)."""
        b, k = self.b, self.plan.k
        made = slice(lo + 1, hi + 1)
        logp = torch.log_softmax(logits.float(), dim=-1)
        if self.sampling is None:
            child_logp, ids = torch.topk(logp, k, dim=-1)  # (F, k)
        else:
            q = processed_probs(logits, self.sampling, check=False)  # (F, Vd)
            b.q[rows] = q
            b.expanded[rows] = True
            u = torch.rand(q.shape, generator=self.generator).clamp_min(1e-20)
            gumbel = -torch.log(-torch.log(u)).to(q.device)
            keys = torch.where(q > 0, q.log() + gumbel, float("-inf"))
            drawn, ids = torch.topk(keys, k, dim=-1)  # decreasing keys = the order drawn
            child_logp = logp.gather(1, ids)
            live = drawn > float("-inf")  # past the support of q: no child
            b.live[made].view(-1, k)[:] = live & b.live[rows][:, None]
        b.score[made].view(-1, k)[:] = child_logp if lo == 0 else b.score[rows][:, None] + child_logp  # root: 0
        b.token[made].view(-1, k)[:] = self.d.draft.draft_to_target[ids]
        b.parent[made].view(-1, k)[:] = rows[:, None]
        if not last:
            width = b.rows.shape[0]
            b.ancestors[made].view(-1, k, width)[:] = b.ancestors[rows][:, None] | b.identity[made].view(-1, k, width)

    def run(self) -> tuple[torch.Tensor, bool]:
        """Grow the planned levels; return the kept rows, ascending (parents first), and whether they
        are all the rows grown."""
        d, b, plan = self.d, self.b, self.plan
        levels = len(plan.levels)
        chain = plan.k == 1  # every fed node sees all fed nodes: no ancestor matrix needed
        if self.sampling is not None:
            b.expanded.zero_()
        self.expand(b.rows[:1], d.last_logits[None], *plan.levels[0][:2], last=chain or levels == 1)
        committed = d.cache.length
        base_pos = committed - 1  # position of the last committed pair
        device = d.last_hidden.device
        fed = b.rows[:0]
        for depth in range(1, levels):
            prev_lo, prev_hi, _ = plan.levels[depth - 1]
            lo, hi, width = plan.levels[depth]
            level = slice(prev_lo + 1, prev_hi + 1)
            if width == prev_hi - prev_lo:  # the whole previous level is fed
                frontier = b.rows[level]
            else:  # its ``width`` best nodes by score (ties: the earlier node), in creation order
                key = b.score[level]
                if self.sampling is not None:  # dead draws (past q's support) are never expanded
                    key = key.masked_fill(~b.live[level], float("-inf"))
                frontier = torch.sort(key, descending=True, stable=True).indices[:width].sort().values + level.start
            fed = torch.cat([fed, frontier])  # the cache entries after the committed pairs, in order
            visible = torch.ones(1, 1, width, committed + fed.shape[0], dtype=torch.bool, device=device)
            if not chain:
                visible[0, 0, :, committed:] = b.ancestors[frontier][:, fed]
            # (1, F, H): the parents' outputs (at depth 1 the root's)
            hidden = d.last_hidden.expand(1, width, -1) if depth == 1 else b.out[b.parent[frontier]][None]
            positions = torch.full((1, width), base_pos + depth, dtype=torch.long, device=device)
            out, logits = d._forward(hidden, b.token[frontier][None], positions, visible)
            if depth < levels - 1:  # parents of the next level
                b.out[frontier] = out[0]
            self.expand(frontier, logits[0], lo, hi, last=chain or depth == levels - 1)
        rows = b.rows[1 : plan.nodes + 1]
        if self.sampling is not None:  # sampled trees keep every child they draw
            return rows[b.live[rows]], False
        if plan.nodes <= self.cfg.total_tokens:
            return rows, True
        order = torch.sort(b.score[rows], descending=True, stable=True).indices[: self.cfg.total_tokens]
        return order.sort().values + 1, False  # creation order: parents first, siblings in proposal order
