"""Context branches: draft tokens copied from the committed text, merged into the head's tree.

Text often repeats itself (code that re-reads its own lines, a model looping on its recent output,
answers quoting their prompt). The context proposer finds the longest recent match of the last
``n`` committed tokens (``n`` from ``max_ngram`` down to ``min_ngram``) and proposes the tokens
that followed it, up to ``lookup_tokens``; with ``branches > 1`` several distinct continuations
(most recent matches first, longer matches before shorter ones). A continuation that runs into the
end of the text goes on copying from its own start (a loop of period ``k`` keeps looping).

:class:`ContextIndex` is pure host code: a table from every n-gram of the committed tokens to the
positions that followed it, extended with the tokens committed each round (never rebuilt).

:class:`ContextDrafter` wraps a drafter (the head's, or none: a prompt-lookup decoder in the same
round loop) and merges the context branches into its tree as a trie (:func:`merge_context`): where
a branch's first tokens coincide with head nodes it follows them, and it adds new nodes where it
leaves them; siblings never repeat a token in the target's forward. Every context node is a point
mass (a deterministic function of the committed text). Under the sampled rules the verifier is told
so through ``Tree.point_mass``, and a head child drawn from ``q`` that repeats a context token
checked before it stays in the check order as a phantom (``Tree.phantoms``: checked, rejected with
certainty, its residual update applied, no row in the forward). docs/EXACTNESS.md, "Mixed nodes".

Budget: context nodes are counted beside ``TreeConfig.total_tokens``: the head's tree is grown as
without context, and the context adds at most ``branches * lookup_tokens`` nodes (fewer where it
follows head nodes), so turning the context on never changes the head's part of the tree.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Literal

import torch

from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.core.tree import ROOT, Tree
from eagle_tree.core.verify import Proposal, VerifyRule

_NAME = re.compile(r"^ctx(?P<lookup>\d+)(?:x(?P<branches>\d+))?(?:-g(?P<low>\d+)to(?P<high>\d+))?"
                   r"(?:-alone(?P<alone>\d+))?(?P<headfirst>-headfirst)?$")


@dataclass(frozen=True)
class ContextConfig:
    """Context branches. lookup_tokens: tokens copied per branch; max_ngram / min_ngram: lengths of
    the matched suffix, tried longest first; branches: distinct continuations proposed; first: whose
    children are checked first at a node both proposers extend ("context" or "head"); alone_ngram: when
    the matched suffix is at least this long, the round proposes the context branches alone and the
    head drafts nothing (its cache still takes the committed tokens): a long match is likely copied
    text, where the head's drafts add verify rows and draft time for little (None: the head always
    drafts). The choice reads only committed tokens, so the output's distribution is unchanged."""

    lookup_tokens: int = 8
    max_ngram: int = 4
    min_ngram: int = 1
    branches: int = 1
    first: Literal["context", "head"] = "context"
    alone_ngram: int | None = None

    def __post_init__(self) -> None:
        for name in ("lookup_tokens", "max_ngram", "min_ngram", "branches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ContextConfig.{name} must be an integer >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"ContextConfig.min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        a = self.alone_ngram
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 1):
            raise ValueError(f"ContextConfig.alone_ngram must be an integer >= 1 or null, got {a!r}")
        if self.first not in ("context", "head"):
            raise ValueError(f"ContextConfig.first must be 'context' or 'head', got {self.first!r}")

    @property
    def name(self) -> str:
        """The one spelling of these settings, read back by :meth:`from_name`: ``ctx8`` (8 tokens
        copied), ``ctx8x2`` (2 branches), then ``-g2to4`` for n-gram lengths other than the default
        1..4, ``-alone3`` when a match of 3 tokens or more leaves the head out of the round, and
        ``-headfirst`` when the head's children are checked first."""
        default = ContextConfig()
        name = f"ctx{self.lookup_tokens}" + (f"x{self.branches}" if self.branches > 1 else "")
        if (self.min_ngram, self.max_ngram) != (default.min_ngram, default.max_ngram):
            name += f"-g{self.min_ngram}to{self.max_ngram}"
        name += f"-alone{self.alone_ngram}" if self.alone_ngram is not None else ""
        return name + ("-headfirst" if self.first == "head" else "")

    @classmethod
    def from_name(cls, name: str) -> ContextConfig:
        """The settings :attr:`name` spells; a ValueError names the expected form otherwise."""
        match = _NAME.match(name)
        config = None
        if match:
            default = cls()
            config = cls(lookup_tokens=int(match["lookup"]), branches=int(match["branches"] or 1),
                         min_ngram=int(match["low"] or default.min_ngram),
                         max_ngram=int(match["high"] or default.max_ngram),
                         first="head" if match["headfirst"] else "context",
                         alone_ngram=int(match["alone"]) if match["alone"] else None)
        if config is None or config.name != name:
            raise ValueError(f"{name!r} is not a context setting: expected 'ctxN', optionally 'xBRANCHES', "
                             "'-gLOWtoHIGH' (n-gram lengths other than 1 to 4), '-aloneN' and '-headfirst' (e.g. "
                             "ctx8x2-g2to4)")
        return config

    @property
    def max_nodes(self) -> int:
        """The most nodes the context adds to a tree (beside the head's total_tokens)."""
        return self.lookup_tokens * self.branches


class ContextIndex:
    """The committed tokens and, for every n-gram (min_ngram <= n <= max_ngram), the positions of
    the tokens that followed its occurrences, in increasing order. ``extend`` costs
    ``O(max_ngram - min_ngram + 1)`` per token; ``continuations`` scans at most ``scan`` occurrences
    per n-gram length."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, scan: int = 16):
        self.max_ngram, self.min_ngram, self.scan = max_ngram, min_ngram, scan
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.table.setdefault(tuple(seq[end - n :]), []).append(end)

    def match_length(self) -> int:
        """The longest suffix (min_ngram to max_ngram tokens) that occurred earlier in the text; 0 if none."""
        seq, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            if any(pos < end for pos in self.table.get(tuple(seq[end - n :]), ())):
                return n
        return 0

    def continuations(self, lookup_tokens: int, branches: int = 1) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of the current text, each ``lookup_tokens`` long:
        longest matched suffix first, then the most recent occurrence first."""
        seq, end = self.tokens, len(self.tokens)
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            positions = self.table.get(tuple(seq[end - n :]), ())
            scanned = 0
            for pos in reversed(positions):
                if pos >= end:  # the current suffix itself: what follows it is to be predicted
                    continue
                cont: list[int] = []
                for j in range(lookup_tokens):  # copy with overlap: past the end, copy the copy
                    i = pos + j
                    cont.append(seq[i] if i < end else cont[i - end])
                if cont not in found:
                    found.append(cont)
                    if len(found) == branches:
                        return found
                scanned += 1
                if scanned == self.scan:
                    break
        return found


# ------------------------------------------------------------------------------------- the merge


def merge_context(tree: Tree, draft_probs: torch.Tensor | None, rule: VerifyRule | str, branches: list[list[int]],
                  first: str = "context") -> tuple[Tree, torch.Tensor | None]:
    """Merge context ``branches`` (token lists below the root) into a head ``tree`` as a trie.

    Returns the merged tree (breadth-first, parents first, siblings in check order) and its
    ``draft_probs`` (the head's row for a node the head grew, zeros for context-only nodes, whose
    children are all point masses). ``first`` orders the children of a node both proposers extend.
    With "context" first under a sampled rule, a context node that coincides with a drawn head
    child takes its place in the forward and the drawn child stays in the check order as a phantom;
    with "head" first the coinciding context child is the head's node (a point-mass duplicate,
    dropped). Deterministic and greedy trees hold point masses only: coinciding nodes are shared.
    """
    if not branches:
        return tree, draft_probs
    sampled = VerifyRule.of(rule).needs_draft_probs
    trie: dict = {}
    for branch in branches:
        level = trie
        for t in branch:
            level = level.setdefault(int(t), {})

    parents: list[int] = []
    tokens: list[int] = []
    head_of: list[int | None] = []  # head node index of each merged node (None: context only)
    point_mass: list[bool] = []
    phantoms: list[tuple[int, int, int]] = []
    queue: list[tuple[int, int | None, dict | None]] = [(ROOT, ROOT, trie)]  # (merged node, head node, trie)
    for parent, head, ctx in queue:
        head_kids = tree.children[head] if head is not None else []
        ctx = ctx or {}
        by_token = {}
        for h in head_kids:
            by_token.setdefault(tree.tokens[h], h)
        entries: list[tuple[int, int | None, dict | None, bool]] = []  # (token, head node, trie, point mass)
        phantom_at: list[tuple[int, int]] = []  # (slot, token)
        if first == "head":
            entries += [(tree.tokens[h], h, ctx.get(tree.tokens[h]) if by_token[tree.tokens[h]] == h else None,
                         not sampled) for h in head_kids]
            entries += [(t, None, sub, True) for t, sub in ctx.items() if t not in by_token]
        else:
            shared = {t: by_token[t] for t in ctx if t in by_token}
            entries += [(t, shared.get(t), sub, True) for t, sub in ctx.items()]
            for h in head_kids:
                t = tree.tokens[h]
                if t in ctx:  # repeats a point mass checked before it: its subtree (if shared) moved there
                    if sampled:  # a drawn child is still checked in its place, but it needs no row
                        phantom_at.append((len(entries), t))
                    continue
                entries.append((t, h, None, not sampled))
        for slot, t in phantom_at:
            phantoms.append((parent, slot, t))
        for t, h, sub, pm in entries:
            parents.append(parent)
            tokens.append(t)
            head_of.append(h)
            point_mass.append(pm)
            queue.append((len(tokens) - 1, h, sub))

    merged = Tree(parents, tokens, point_mass=point_mass if sampled else None, phantoms=phantoms)
    probs = None
    if draft_probs is not None:
        probs = draft_probs.new_zeros(len(tokens) + 1, draft_probs.shape[1])
        probs[0] = draft_probs[0]
        rows = [i + 1 for i, h in enumerate(head_of) if h is not None]
        if rows:
            probs[rows] = draft_probs[[head_of[r - 1] + 1 for r in rows]]
    return merged, probs


# ------------------------------------------------------------------------------------- the drafter


class ContextDrafter:
    """A drafter that adds context branches to ``inner``'s proposals (``inner``: a RoundDrafter, the
    head's; None: context only), for B requests, each with its own index (implements RoundDrafter).

    ``catch_up`` gives each request's index its committed tokens (the prompt after its first token,
    then every round's); ``propose`` merges each request's branches into its head tree (or the empty
    tree). ``context_s`` sums the seconds spent in the indexes and the merge (part of the draft time)."""

    def __init__(self, inner, config: ContextConfig):
        self.inner = inner
        self.config = config
        self.reset()

    def reset(self, requests: int = 1) -> None:
        if self.inner is not None:
            self.inner.reset(requests)
        self.indexes = [ContextIndex(self.config.max_ngram, self.config.min_ngram) for _ in range(requests)]
        self.context_s = 0.0
        self.alone_rounds = 0  # rounds proposed with the context branches alone (ContextConfig.alone_ngram)

    @property
    def requests(self) -> int:
        return len(self.indexes)

    def cache_bytes(self) -> int:
        return 0 if self.inner is None else self.inner.cache_bytes()

    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int] | None = None) -> None:
        """As the head drafter's (``counts[b]``: request b's pairs, the rest padding); each request's index
        takes its own tokens."""
        if self.inner is not None:
            self.inner.catch_up(features, next_tokens, counts)
        t0 = time.perf_counter()
        for b, tokens in enumerate(next_tokens.tolist()):
            self.indexes[b].extend(tokens if counts is None else tokens[: counts[b]])
        self.context_s += time.perf_counter() - t0

    def propose(self, sampling: SamplingConfig, generators: list[torch.Generator | None]) -> list[Proposal]:
        """One proposal per request: the head's tree of the request (or the empty tree) with the request's
        own context branches merged in. With ``alone_ngram``, when every request matched a suffix that
        long, the head is not run and the branches are proposed alone."""
        t0 = time.perf_counter()
        cfg = self.config
        found = [index.continuations(cfg.lookup_tokens, cfg.branches) for index in self.indexes]
        alone = cfg.alone_ngram is not None and all(index.match_length() >= cfg.alone_ngram
                                                    for index in self.indexes)
        self.context_s += time.perf_counter() - t0
        if self.inner is not None and not alone:
            heads = self.inner.propose(sampling, generators)
        else:
            heads = [Proposal.empty(sampling.greedy) for _ in self.indexes]
            self.alone_rounds += self.inner is not None
        t0 = time.perf_counter()
        proposals = []
        for head, branches in zip(heads, found, strict=True):
            tree, probs = merge_context(head.tree, head.draft_probs, head.rule, branches, cfg.first)
            proposals.append(Proposal(tree, probs, head.rule))
        self.context_s += time.perf_counter() - t0
        return proposals

    def select(self, requests: list[int]) -> None:
        if self.inner is not None:
            self.inner.select(requests)
        self.indexes = [self.indexes[r] for r in requests]

    def extend(self, other: ContextDrafter) -> None:
        if self.inner is not None:
            self.inner.extend(other.inner)
        self.indexes = self.indexes + other.indexes
