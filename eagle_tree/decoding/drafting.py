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
sampled child is ever pruned (``TreeConfig`` refuses a sampled shape whose ``total_tokens`` is not
the number of nodes its levels draw, so every level is drawn and the name is the tree). They
are verified with the "without_replacement" rule. Both kinds are exact (docs/EXACTNESS.md, "Sampled trees").

Growth is tensor work: per level one sort of the previous level's scores picks the frontier, one head
forward feeds it, one top-k (or one Gumbel-top-k draw from the drafter's generator) over the whole
frontier creates the children; scores, parents, tokens, ancestors and output features live in tensors
allocated once per drafter, the visibility of a level is read from the ancestor matrix, and the final
tree goes to the host in one transfer per round.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import Proposal, VerifyRule
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.models.cache import DraftCache
from eagle_tree.models.head import Eagle3DraftModel

_NAME = re.compile(r"^(?:chain-(?P<chain>\d+)|tree-d(?P<depth>\d+)k(?P<top_k>\d+)n(?P<total>\d+))"
                   r"(?P<sampled>-sampled)?$")


def sampled_nodes(depth: int, top_k: int) -> int:
    """The nodes a sampled tree of ``depth`` levels draws (and keeps) with ``top_k`` children per
    expanded node and ``top_k`` nodes expanded per level: k, then min(k, the level's size) x k per level
    below, e.g. 4 + 16 = 20 for d2 k4 and 2 + 4 + 4 = 10 for d3 k2 (fewer when the draft vocabulary is
    smaller than ``top_k``)."""
    nodes = size = top_k
    for _ in range(1, depth):
        size = min(top_k, size) * top_k
        nodes += size
    return nodes


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft. depth: levels below the root; top_k: children per expanded node
    and nodes expanded per level; total_tokens: nodes kept after the global rerank; sampled: draw
    children (Gumbel-top-k) instead of taking the top-k (a sampled tree keeps every child it draws, so
    total_tokens is the nodes its levels draw, ``sampled_nodes(depth, top_k)``: d2 k4 n20 or d1 k4 n4,
    never d2 k4 n8, so the name is the tree drawn at T > 0); context: branches copied from the committed
    text, merged into the tree (None: off; their nodes count beside total_tokens, see context.py);
    head: draft with the head (False: the context branches alone, prompt lookup in eagle-tree's loop, a
    shape the bench's tuning can choose when the head's drafts do not pay; depth, top_k, total_tokens
    and sampled are then unused and set to 1, 1, 1 and False, and the context's alone_ngram to None, so
    every such shape has one spelling)."""

    depth: int = 6
    top_k: int = 8
    total_tokens: int = 48
    sampled: bool = False
    context: ContextConfig | None = None
    head: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.context, dict):  # from a JSON or YAML mapping
            object.__setattr__(self, "context", ContextConfig(**self.context))
        if not isinstance(self.head, bool):
            raise ValueError(f"TreeConfig.head must be true or false, got {self.head!r}")
        if not self.head:
            if self.context is None:
                raise ValueError("TreeConfig(head=False) drafts with context branches alone: give it a context "
                                 "(e.g. context={'lookup_tokens': 8})")
            for name, value in (("depth", 1), ("top_k", 1), ("total_tokens", 1), ("sampled", False)):
                object.__setattr__(self, name, value)
            if self.context.alone_ngram is not None:  # without a head every round is context alone
                object.__setattr__(self, "context", replace(self.context, alone_ngram=None))
        for name in ("depth", "top_k", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TreeConfig.{name} must be an integer >= 1, got {value!r}")
        if self.sampled and self.top_k > self.total_tokens:
            raise ValueError(
                f"a sampled tree keeps every child it draws, so top_k ({self.top_k}) must be <= total_tokens "
                f"({self.total_tokens})"
            )
        if self.sampled and sampled_nodes(self.depth, self.top_k) != self.total_tokens:
            need = sampled_nodes(self.depth, self.top_k)
            fits = max(d for d in range(1, self.depth + 1) if sampled_nodes(d, self.top_k) <= self.total_tokens)
            raise ValueError(
                f"a sampled tree keeps every child it draws, so depth {self.depth} with top_k {self.top_k} draws "
                f"{need} nodes and its total_tokens must be {need}, not {self.total_tokens}: set "
                f"total_tokens={need}" + (f", or depth={fits} with total_tokens={sampled_nodes(fits, self.top_k)}"
                                          if need > self.total_tokens else "")
            )

    @classmethod
    def context_only(cls, context: ContextConfig) -> TreeConfig:
        """Context branches without the head's drafts (named like the context setting: ``ctx8``)."""
        return cls(context=context, head=False)

    @classmethod
    def chain(cls, length: int, sampled: bool = False) -> TreeConfig:
        """A chain of ``length`` draft tokens: the tree with one child per node."""
        return cls(depth=length, top_k=1, total_tokens=length, sampled=sampled)

    @property
    def name(self) -> str:
        """The one spelling of this shape, read back by :meth:`from_name`: ``chain-4`` or
        ``tree-d6k8n48``, ``-sampled`` appended for Gumbel-top-k draws, ``+`` and the context's name
        (``+ctx8``, ``+ctx8x2-g2to4``, ...) for context branches; a context-only shape is the context's
        name alone (``ctx8``)."""
        if not self.head:
            return self.context.name
        name = f"chain-{self.depth}" if self.is_chain else f"tree-d{self.depth}k{self.top_k}n{self.total_tokens}"
        name += "-sampled" if self.sampled else ""
        return name + (f"+{self.context.name}" if self.context is not None else "")

    @classmethod
    def from_name(cls, name: str) -> TreeConfig:
        """The shape :attr:`name` spells (one name per shape: a chain spelled as a tree is refused); a
        ValueError names the expected forms otherwise."""
        shape, _, context = name.partition("+")
        match = _NAME.match(shape)
        tree = None
        if name.startswith("ctx"):  # context only
            try:
                tree = cls.context_only(ContextConfig.from_name(name))
            except ValueError as exc:
                raise ValueError(f"shape {name!r}: {exc}") from exc
        elif match:
            try:
                ctx = ContextConfig.from_name(context) if context else None
                if match["chain"]:
                    n = int(match["chain"])
                    tree = cls(depth=n, top_k=1, total_tokens=n, sampled=bool(match["sampled"]), context=ctx)
                else:
                    tree = cls(depth=int(match["depth"]), top_k=int(match["top_k"]), total_tokens=int(match["total"]),
                               sampled=bool(match["sampled"]), context=ctx)
            except ValueError as exc:
                raise ValueError(f"shape {name!r}: {exc}") from exc
        if tree is None or tree.name != name:
            raise ValueError(f"{name!r} is not a draft shape: expected 'chain-N' or 'tree-dDEPTHkTOPKnTOTAL' (e.g. "
                             "chain-4, tree-d4k4n16), optionally with '-sampled' and '+' and a context setting "
                             "('ctxN', 'ctxNxBRANCHES', '-gLOWtoHIGH', '-headfirst'), or a context setting alone "
                             "(ctx8: context branches without the head)")
        return tree

    @property
    def is_chain(self) -> bool:
        """One child per node (a head-drafted chain; False for context-only shapes)."""
        return self.head and self.top_k == 1

    def rule(self, sampling: SamplingConfig) -> VerifyRule:
        """The verification rule that is exact for drafts of this shape under ``sampling``."""
        return VerifyRule.for_draft(sampling.greedy, self.sampled)


@runtime_checkable
class RoundDrafter(Protocol):
    """The drafter the round loop calls, for B requests (1 in ``generate``).

    ``reset(requests)`` starts B new sequences; ``catch_up(features, next_tokens, counts)`` consumes
    committed pairs: target features (B, m, 3H) of m committed positions and the tokens that follow
    them (B, m), of which ``counts[b]`` are request b's (the rest is padding); ``propose(sampling,
    generators)`` returns one Proposal per request below its last committed token, request b drawing
    any randomness from ``generators[b]`` only; ``select(requests)`` keeps these requests in this order
    and ``extend(other)`` appends another drafter's (requests leaving and joining a batch);
    ``cache_bytes()`` is the size of its key/value buffers. ``Drafter`` (the head), ``ContextDrafter``
    (context branches) and ``OneSequence`` (a ``SequenceDrafter`` as one request) implement it."""

    def reset(self, requests: int = 1) -> None: ...

    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int] | None = None) -> None: ...

    def propose(self, sampling: SamplingConfig, generators: list[torch.Generator | None]) -> list[Proposal]: ...

    def select(self, requests: list[int]) -> None: ...

    def extend(self, other) -> None: ...

    def cache_bytes(self) -> int: ...


@runtime_checkable
class SequenceDrafter(Protocol):
    """A drafter of one sequence, for ``SpeculativeDecoder(drafter=...)`` (tests script acceptance
    patterns with it): ``reset()``, ``catch_up(features (1, m, 3H), next_tokens (1, m))`` and
    ``propose(sampling, generator) -> Proposal``. ``OneSequence`` runs it in the round loop."""

    def reset(self) -> None: ...

    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None: ...

    def propose(self, sampling: SamplingConfig, generator: torch.Generator | None = None) -> Proposal: ...


class OneSequence:
    """A ``SequenceDrafter`` as a ``RoundDrafter`` of one request (``generate`` only: it never joins a
    batch)."""

    def __init__(self, inner: SequenceDrafter):
        self.inner = inner

    def reset(self, requests: int = 1) -> None:
        if requests != 1:
            raise ValueError(f"a drafter of one sequence drafts for one request, not {requests}")
        self.inner.reset()

    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int] | None = None) -> None:
        m = features.shape[1] if counts is None else counts[0]
        self.inner.catch_up(features[:, :m], next_tokens[:, :m])

    def propose(self, sampling: SamplingConfig, generators: list[torch.Generator | None]) -> list[Proposal]:
        (generator,) = generators
        return [self.inner.propose(sampling, generator)]

    def select(self, requests: list[int]) -> None:
        if requests != [0]:
            raise ValueError("a drafter of one sequence keeps its one request")

    def extend(self, other) -> None:
        raise ValueError("a drafter of one sequence drafts for one request: it cannot join a batch")

    def cache_bytes(self) -> int:
        return 0


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
            levels.append((hi, hi + width * k, width))
            hi += width * k
        return cls(k, tuple(levels))

    @property
    def nodes(self) -> int:
        return self.levels[-1][1]


class _Buffers:
    """Per-drafter tensors of one round's growth for B requests, indexed by (request, row of the tree:
    ``Tree.row``, the root is 0 and the node created i-th is i + 1); every entry a round reads is
    written in that round first."""

    def __init__(self, batch: int, n: int, hidden_size: int, draft_vocab: int, dtype: torch.dtype,
                 device: torch.device):
        rows = n + 1
        self.batch = batch
        self.score = torch.zeros(batch, rows, device=device)  # cumulative draft log-probability (root: 0)
        self.parent = torch.zeros(batch, rows, dtype=torch.long, device=device)  # the parent's row (0 = root)
        self.token = torch.zeros(batch, rows, dtype=torch.long, device=device)  # target id
        self.live = torch.ones(batch, rows, dtype=torch.bool, device=device)  # False: a draw past q's support
        self.identity = torch.eye(rows, dtype=torch.bool, device=device)
        self.ancestors = self.identity.repeat(batch, 1, 1)  # [b, r, c]: row c is row r or one of its ancestors
        self.out = torch.empty(batch, rows, hidden_size, dtype=dtype, device=device)  # the head's output per node
        self.expanded = torch.zeros(batch, rows, dtype=torch.bool, device=device)
        self.q = torch.empty(batch, rows, draft_vocab, device=device)  # the law of the row's children
        self.rows = torch.arange(rows, device=device)
        self.batch_index = torch.arange(batch, device=device)[:, None]  # (B, 1), for advanced indexing


class Drafter:
    """Runs an Eagle3DraftModel over committed pairs and grows draft trees from the last one, for B
    requests at once (implements RoundDrafter; ``generate`` is B = 1): every head forward feeds all
    requests, each with its own committed length, positions and tree."""

    def __init__(self, draft: Eagle3DraftModel, tree: TreeConfig):
        self.draft = draft
        self.config = tree
        self._buffers: _Buffers | None = None
        self._plans: dict[bool, _Plan] = {}
        self.reset()

    def reset(self, requests: int = 1) -> None:
        self.cache = DraftCache(requests)
        self.last_hidden: torch.Tensor | None = None  # (B, 1, H): output at each request's last committed pair
        self.logits: torch.Tensor | None = None  # (B, Vd): the draft logits after it

    @property
    def requests(self) -> int:
        return self.cache.requests

    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def _forward(self, hidden, input_ids, position_ids, visible):
        """One head step over the draft cache. visible (B, 1, T, S_after) bool. Returns (out, logits)."""
        return self.draft.step(hidden, input_ids, position_ids, self.cache, visible)

    @torch.no_grad()
    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int] | None = None) -> None:
        """Consume committed pairs: features (B, m, 3H) of tokens at positions c_b .. c_b + m - 1 and the
        tokens that follow them (B, m), in target ids; ``counts[b]`` (default m): how many of the m pairs
        are request b's (the rest is padding, written past the request's length and never seen)."""
        m, starts = features.shape[1], list(self.cache.lengths)
        counts = [m] * len(starts) if counts is None else [int(c) for c in counts]
        b = self.requests
        if features.shape[0] != b or len(counts) != b or min(counts) < 0 or not 1 <= max(counts) <= m:
            raise ValueError(f"catch_up takes features of {b} request(s) and 0 <= counts <= {m}, "
                             f"got {features.shape[0]} and counts {counts}")
        if min(counts) == 0 and self.last_hidden is None:
            raise ValueError("a request can skip a catch-up (count 0) only after its first one")
        device = features.device
        hidden = self.draft.fuse(features.to(self.draft.fc.weight.dtype))
        start = torch.tensor(starts, device=device)[:, None]
        positions = start + torch.arange(m, device=device)  # (B, m)
        slots = torch.arange(max(starts) + m, device=device)
        visible = slots[None, None, :] <= positions[:, :, None]  # request b's own slots up to its query
        out, logits = self._forward(hidden, next_tokens, positions, visible[:, None])
        self.cache.crop([a + c for a, c in zip(starts, counts, strict=True)])
        count = torch.tensor(counts, device=device)
        index, last = torch.arange(b, device=device), (count - 1).clamp_min(0)
        hidden, last_logits = out[index, last][:, None], logits[index, last].float()
        if min(counts) == 0:  # requests without new pairs keep their state
            moved = count > 0
            hidden = torch.where(moved[:, None, None], hidden, self.last_hidden)
            last_logits = torch.where(moved[:, None], last_logits, self.logits)
        self.last_hidden, self.logits = hidden, last_logits

    def select(self, requests: list[int]) -> None:
        """Keep only these requests, in this order (requests leaving a batch)."""
        self.cache.select(requests)
        index = torch.tensor(requests, dtype=torch.long, device=self.last_hidden.device)
        self.last_hidden, self.logits = self.last_hidden[index], self.logits[index]

    def extend(self, other: Drafter) -> None:
        """Append the requests of ``other`` (caught up on their prompts) after these (requests joining)."""
        if not self.requests or self.last_hidden is None:
            self.cache, self.last_hidden, self.logits = other.cache, other.last_hidden, other.logits
            return
        self.cache.extend(other.cache)
        self.last_hidden = torch.cat([self.last_hidden, other.last_hidden])
        self.logits = torch.cat([self.logits, other.logits])

    def _buffers_for(self, plan: _Plan) -> _Buffers:
        b, hidden = self._buffers, self.last_hidden
        n = self.requests
        if b is None or b.score.shape[1] <= plan.nodes or b.batch != n or b.out.device != hidden.device:
            vocab = self.draft.config.draft_vocab_size
            b = self._buffers = _Buffers(n, plan.nodes, hidden.shape[-1], vocab, hidden.dtype, hidden.device)
        return b

    @torch.no_grad()
    def propose(self, sampling: SamplingConfig,
                generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """Grow one tree per request, every level of all requests in one head forward; request b draws
        any randomness from ``generators[b]`` only (None: the global generator), exactly the draws a
        drafter of that request alone would make."""
        if self.last_hidden is None:
            raise RuntimeError("catch_up must run before propose")
        generators = [None] * self.requests if generators is None else generators
        if len(generators) != self.requests:
            raise ValueError(f"propose needs one generator per request ({self.requests}), got {len(generators)}")
        cfg = self.config
        sampled = cfg.sampled and not sampling.greedy
        plan = self._plans.get(sampled)
        if plan is None:
            plan = self._plans[sampled] = _Plan.of(cfg, self.draft.config.draft_vocab_size, sampled)
        b = self._buffers_for(plan)
        committed = list(self.cache.lengths)
        try:
            growth = _Growth(self, b, plan, sampling if sampled else None, generators)
            keep, whole = growth.run()
        finally:
            self.cache.crop(committed)
        return self._proposals(b, plan, keep, whole, sampled, sampling)

    def _proposals(self, b: _Buffers, plan: _Plan, keep: torch.Tensor | None, whole: bool, sampled: bool,
                   sampling: SamplingConfig) -> list[Proposal]:
        """Every request's kept nodes as a Tree: ``keep`` (B, n) ascending tree rows, or None for sampled trees
        (each keeps its live draws; a dead draw has only dead descendants); ``whole``: every node grown.
        One host transfer for the whole batch."""
        nodes = plan.nodes
        parts = [b.parent[:, 1 : nodes + 1], b.token[:, 1 : nodes + 1], b.live[:, 1 : nodes + 1].long()]
        if not whole and keep is not None:
            parts.append(keep)
        host = torch.cat(parts, dim=1).tolist()
        rule = self.config.rule(sampling)
        proposals = []
        for request, values in enumerate(host):
            parent, token, live = values[:nodes], values[nodes : 2 * nodes], values[2 * nodes : 3 * nodes]
            if keep is None:
                kept = [i + 1 for i in range(nodes) if live[i]]
            else:
                kept = list(range(1, nodes + 1)) if whole else values[3 * nodes :]
            index = {r: j for j, r in enumerate(kept)}
            tree = Tree([index[parent[r - 1]] if parent[r - 1] else -1 for r in kept], [token[r - 1] for r in kept])
            draft_probs = None
            if sampled:
                rows = torch.tensor([0, *kept], device=b.q.device)  # the root's row and the kept rows
                q = torch.where(b.expanded[request, rows, None], b.q[request, rows], 0.0)  # leaves carry no law
                draft_probs = q.new_zeros(len(kept) + 1, self.draft.config.vocab_size)
                draft_probs[:, self.draft.draft_to_target] = q
            proposals.append(Proposal(tree, draft_probs, rule))
        return proposals


class _Growth:
    """One tree expansion per request over the drafter's buffers, level by level, without host round trips."""

    def __init__(self, drafter: Drafter, buffers: _Buffers, plan: _Plan, sampling: SamplingConfig | None,
                 generators: list):
        self.d, self.b, self.plan = drafter, buffers, plan
        self.cfg = drafter.config
        self.sampling = sampling  # None: deterministic top-k children
        self.generators = generators

    def expand(self, rows: torch.Tensor, logits: torch.Tensor, lo: int, hi: int, last: bool) -> None:
        """Create the children of the nodes at ``rows`` (B, F) from their draft logits (B, F, Vd), as rows
        lo + 1 .. hi, node by node, each node's children in proposal order. Deterministic: every node's
        top-k. Sampled: Gumbel-top-k, up to k children drawn without replacement from each node's
        processed q, one draw per request for the whole level from that request's generator. ``last``: the
        children's ancestors are not needed (no level is fed from them, or the tree is a chain)."""
        b, k = self.b, self.plan.k
        batch, width = rows.shape
        made = slice(lo + 1, hi + 1)
        logp = torch.log_softmax(logits.float(), dim=-1)
        if self.sampling is None:
            child_logp, ids = torch.topk(logp, k, dim=-1)  # (B, F, k)
        else:
            q = processed_probs(logits, self.sampling, check=False)  # (B, F, Vd)
            b.q[b.batch_index, rows] = q
            b.expanded[b.batch_index, rows] = True
            u = torch.stack([torch.rand(q.shape[1:], generator=g) for g in self.generators]).clamp_min(1e-20)
            gumbel = -torch.log(-torch.log(u)).to(q.device)
            keys = torch.where(q > 0, q.log() + gumbel, float("-inf"))
            drawn, ids = torch.topk(keys, k, dim=-1)  # decreasing keys = the order drawn
            child_logp = logp.gather(2, ids)
            live = drawn > float("-inf")  # past the support of q: no child
            b.live[:, made] = (live & b.live.gather(1, rows)[:, :, None]).reshape(batch, -1)
        parent_score = 0.0 if lo == 0 else b.score.gather(1, rows)[:, :, None]  # root: 0
        b.score[:, made] = (parent_score + child_logp).reshape(batch, -1)
        b.token[:, made] = self.d.draft.draft_to_target[ids].reshape(batch, -1)
        b.parent[:, made] = rows[:, :, None].expand(-1, -1, k).reshape(batch, -1)
        if not last:
            r = b.rows.shape[0]
            parents = b.ancestors.gather(1, rows[:, :, None].expand(-1, -1, r))  # (B, F, R)
            own = b.identity[made].view(1, width, k, r)
            b.ancestors[:, made] = (parents[:, :, None, :] | own).reshape(batch, width * k, r)

    def run(self) -> tuple[torch.Tensor | None, bool]:
        """Grow the planned levels; return the kept rows (B, n), ascending (parents first), and whether
        they are all the rows grown; None for sampled trees (each keeps its live rows)."""
        d, b, plan = self.d, self.b, self.plan
        levels = len(plan.levels)
        chain = plan.k == 1  # every fed node sees all fed nodes: no ancestor matrix needed
        if self.sampling is not None:
            b.expanded.zero_()
            b.live.fill_(True)
        batch = b.batch
        device = d.last_hidden.device
        root = b.rows[:1].expand(batch, 1)
        self.expand(root, d.logits[:, None], *plan.levels[0][:2], last=chain or levels == 1)
        committed = d.cache.lengths
        level_requests = len(set(committed)) == 1
        start = torch.tensor(committed, device=device)[:, None]  # (B, 1)
        base_pos = start - 1  # position of each request's last committed pair
        fed = b.rows[:0].expand(batch, 0)
        for depth in range(1, levels):
            prev_lo, prev_hi, _ = plan.levels[depth - 1]
            lo, hi, width = plan.levels[depth]
            level = slice(prev_lo + 1, prev_hi + 1)
            if width == prev_hi - prev_lo:  # the whole previous level is fed
                frontier = b.rows[level].expand(batch, -1)
            else:  # its ``width`` best nodes by score (ties: the earlier node), in creation order
                key = b.score[:, level]
                if self.sampling is not None:  # dead draws (past q's support) are never expanded
                    key = key.masked_fill(~b.live[:, level], float("-inf"))
                order = torch.sort(key, descending=True, stable=True).indices[:, :width]
                frontier = order.sort(dim=1).values + level.start
            fed = torch.cat([fed, frontier], dim=1)  # the tree's cache entries after each request's committed pairs
            n_fed = fed.shape[1]
            total = max(committed) + n_fed
            if level_requests:
                visible = torch.ones(batch, width, total, dtype=torch.bool, device=device)
                if not chain:
                    anc = b.ancestors.gather(1, frontier[:, :, None].expand(-1, -1, b.rows.shape[0]))
                    visible[:, :, committed[0]:] = anc.gather(2, fed[:, None, :].expand(-1, width, -1))
            else:  # requests of different lengths: request b's fed nodes sit at slots committed[b] + j
                slots = torch.arange(total, device=device)
                visible = (slots[None, None, :] < start[:, :, None]).expand(batch, width, total).clone()
                if chain:
                    rel = torch.ones(batch, width, n_fed, dtype=torch.bool, device=device)
                else:
                    anc = b.ancestors.gather(1, frontier[:, :, None].expand(-1, -1, b.rows.shape[0]))
                    rel = anc.gather(2, fed[:, None, :].expand(-1, width, -1))
                cols = (start + torch.arange(n_fed, device=device))[:, None, :].expand(-1, width, -1)
                visible.scatter_(2, cols, rel)
            # (B, F, H): the parents' outputs (at depth 1 the root's)
            if depth == 1:
                hidden = d.last_hidden.expand(batch, width, -1)
            else:
                parents = b.parent.gather(1, frontier)
                hidden = b.out.gather(1, parents[:, :, None].expand(-1, -1, b.out.shape[2]))
            positions = (base_pos + depth).expand(batch, width)
            out, logits = d._forward(hidden, b.token.gather(1, frontier), positions, visible[:, None])
            if depth < levels - 1:  # parents of the next level
                b.out.scatter_(1, frontier[:, :, None].expand(-1, -1, out.shape[2]), out)
            self.expand(frontier, logits, lo, hi, last=chain or depth == levels - 1)
        rows = b.rows[1 : plan.nodes + 1]
        if self.sampling is not None:  # sampled trees keep every child they draw
            return None, False
        if plan.nodes <= self.cfg.total_tokens:
            return rows.expand(batch, -1), True
        order = torch.sort(b.score[:, rows], descending=True, stable=True).indices[:, : self.cfg.total_tokens]
        return order.sort(dim=1).values + 1, False  # creation order: parents first, siblings in proposal order
