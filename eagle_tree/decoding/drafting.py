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
are verified with the "without_replacement" rule. Both kinds are exact (EXACTNESS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import VerifyRule
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
        if sampling.greedy:
            return VerifyRule.GREEDY
        return VerifyRule.WITHOUT_REPLACEMENT if self.sampled else VerifyRule.DETERMINISTIC


@dataclass
class Proposal:
    """A draft tree in target token ids, the law its children came from, and how to verify it."""

    tree: Tree
    draft_probs: torch.Tensor | None  # (n + 1, V_target) for sampled trees, else None
    rule: VerifyRule


class DraftCache:
    """Keys and values (1, n_kv, S, hd) of the draft's single layer in a growing buffer.

    ``append`` writes at the end, ``crop`` forgets the tail: tree nodes are appended while drafting
    and cropped afterwards, so the cache keeps only entries of committed pairs between rounds.
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


class Drafter:
    """Runs an Eagle3DraftModel over committed pairs and grows draft trees from the last one."""

    def __init__(self, draft: Eagle3DraftModel, tree: TreeConfig):
        self.draft = draft
        self.config = tree
        self.reset()

    def reset(self) -> None:
        self.cache = DraftCache()
        self.last_hidden: torch.Tensor | None = None  # (1, 1, H): output at the last committed pair
        self.last_logits: torch.Tensor | None = None  # (Vd,)

    def _forward(self, hidden, input_ids, position_ids, visible):
        """Append the new entries to the cache, attend over it. visible (T, S_after) bool."""
        d = self.draft
        q, k, v = d.project(hidden, input_ids, position_ids)
        self.cache.append(k, v)
        k_all, v_all = self.cache.view()
        out = d.midlayer.finish(hidden, d.midlayer.self_attn.attend(q, k_all, v_all, visible[None, None]))
        return out, d.logits(out)

    @torch.no_grad()
    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Consume committed pairs: features (1, m, 3H) of tokens at positions c..c+m-1 and the
        tokens that follow them (1, m), in target ids."""
        m, start = features.shape[1], self.cache.length
        hidden = self.draft.fuse(features.to(self.draft.fc.weight.dtype))
        positions = torch.arange(start, start + m, device=features.device)[None]
        visible = torch.ones(m, start + m, dtype=torch.bool, device=features.device).tril(start)
        out, logits = self._forward(hidden, next_tokens, positions, visible)
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
                visible = torch.ones(1, self.cache.length + 1, dtype=torch.bool, device=hidden.device)
                hidden, step_logits = self._forward(hidden, ids, pos, visible)
                logits.append(step_logits[0, -1].float())
        finally:
            self.cache.crop(committed)
        return logits

    @torch.no_grad()
    def propose(self, sampling: SamplingConfig, generator: torch.Generator | None = None) -> Proposal:
        """Grow a tree below the root (the last committed token) and return it in target ids."""
        if self.last_hidden is None:
            raise RuntimeError("catch_up must run before propose")
        cfg = self.config
        sampled = cfg.sampled and not sampling.greedy
        committed = self.cache.length
        try:
            grown = _TreeGrowth(self, sampling if sampled else None, generator)
            parents, tokens, q_rows = grown.run()
        finally:
            self.cache.crop(committed)
        d2t = self.draft.draft_to_target
        target_tokens = d2t[torch.as_tensor(tokens, dtype=torch.long, device=d2t.device)].tolist()
        draft_probs = None
        if sampled:
            vocab = self.draft.config.vocab_size
            draft_probs = torch.zeros(len(tokens) + 1, vocab, dtype=torch.float32)
            for row, q in q_rows.items():
                draft_probs[row, d2t.cpu()] = q.cpu()
        return Proposal(Tree(parents, target_tokens), draft_probs, cfg.rule(sampling))


class _TreeGrowth:
    """One tree expansion: state kept in lists of nodes in creation order (parents first)."""

    def __init__(self, drafter: Drafter, sampling: SamplingConfig | None, generator):
        self.d = drafter
        self.cfg = drafter.config
        self.sampling = sampling  # None: deterministic top-k children
        self.generator = generator
        self.parent: list[int] = []  # creation index of the parent, -1 for the root
        self.token: list[int] = []  # draft-vocabulary id
        self.score: list[float] = []  # cumulative log-probability under the draft
        self.depth: list[int] = []
        self.q: dict[int, torch.Tensor] = {}  # creation index (-1 = root) -> q over the draft vocab
        self.slot: dict[int, int] = {}  # creation index -> position of its entry in the draft cache

    def expand(self, nodes: list[int], logits: torch.Tensor) -> list[int]:
        """Create the children of ``nodes`` (-1 = the root) from their draft logits (F, Vd); return
        their creation indices. Deterministic trees take every node's top-k in one call; sampled
        trees draw node by node, so the generator is consumed in node order."""
        k = min(self.cfg.top_k, logits.shape[-1])
        logp = torch.log_softmax(logits.float(), dim=-1)
        bases = [0.0 if node == -1 else self.score[node] for node in nodes]
        if self.sampling is None:
            top = torch.topk(logp, k, dim=-1)
            rows = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        else:
            rows = (self._draw(node, logits[j], logp[j], k) for j, node in enumerate(nodes))
        return [c for node, base, (ids, child_logp) in zip(nodes, bases, rows, strict=True)
                for c in self._add(node, ids, child_logp, base)]

    def _draw(self, node: int, logits: torch.Tensor, logp: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """Gumbel-top-k: up to ``k`` children drawn without replacement from the processed q of ``node``."""
        q = processed_probs(logits, self.sampling)
        self.q[node] = q
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=self.generator).clamp_min(1e-20)))
        keys = torch.where(q > 0, q.log() + gumbel.to(q.device), float("-inf"))
        drawn = torch.topk(keys, min(k, int((q > 0).sum()))).indices  # decreasing keys = the order drawn
        return drawn.tolist(), logp[drawn].tolist()

    def _add(self, node: int, ids: list[int], child_logp: list[float], base: float) -> list[int]:
        made = []
        for t, lp in zip(ids, child_logp, strict=True):
            self.parent.append(node)
            self.token.append(t)
            self.score.append(base + lp)
            self.depth.append(1 if node == -1 else self.depth[node] + 1)
            made.append(len(self.token) - 1)
        return made

    def run(self):
        cfg, d = self.cfg, self.d
        level = self.expand([-1], d.last_logits[None])
        base_pos = d.cache.length - 1  # position of the last committed pair
        out_hidden: dict[int, torch.Tensor] = {-1: d.last_hidden[0, 0]}
        n_limit = cfg.total_tokens
        for depth in range(1, cfg.depth):
            frontier = sorted(level, key=lambda i: -self.score[i])[: cfg.top_k]
            frontier.sort()
            if self.sampling is not None and len(self.token) + len(frontier) * cfg.top_k > n_limit:
                break  # sampled trees drop whole levels, by a rule fixed by the config
            hidden = torch.stack([out_hidden[self.parent[i]] for i in frontier])[None]  # (1, F, H)
            ids = d.draft.draft_to_target[torch.tensor([self.token[i] for i in frontier])][None]
            positions = torch.full((1, len(frontier)), base_pos + depth, dtype=torch.long)
            visible = self._visible(frontier)
            out, logits = d._forward(hidden, ids.to(hidden.device), positions.to(hidden.device), visible)
            for j, node in enumerate(frontier):
                out_hidden[node] = out[0, j]
            level = self.expand(frontier, logits[0])
        keep = self._select()
        index = {node: i for i, node in enumerate(keep)}
        parents = [-1 if self.parent[n] == -1 else index[self.parent[n]] for n in keep]
        tokens = [self.token[n] for n in keep]
        q_rows = {0 if node == -1 else index[node] + 1: q for node, q in self.q.items() if node == -1 or node in index}
        return parents, tokens, q_rows

    def _visible(self, frontier: list[int]) -> torch.Tensor:
        """(F, S + F) bool: committed pairs, the node's fed ancestors, itself. Records cache slots."""
        start = self.d.cache.length
        visible = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)
        visible[:, : self.d.cache.length - len(self.slot)] = True
        for j, node in enumerate(frontier):
            a = self.parent[node]
            while a != -1:
                visible[j, self.slot[a]] = True
                a = self.parent[a]
            self.slot[node] = start + j
            visible[j, start + j] = True
        return visible.to(self.d.last_hidden.device)

    def _select(self) -> list[int]:
        """Nodes to keep, in creation order (parents first, siblings in proposal order)."""
        n = len(self.token)
        if self.sampling is not None:
            return list(range(n))
        order = sorted(range(n), key=lambda i: (-self.score[i], i))[: self.cfg.total_tokens]
        return sorted(order)
