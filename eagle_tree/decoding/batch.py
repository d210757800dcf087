"""Batched speculative decoding: several requests of different lengths decoded together, one target
forward per round for all of them, and a small continuous-batching scheduler.

Every row (request) has its own tree of the configured shape; the trees are verified in one target
forward under one (B, 1, T, past + T) mask (``TargetModel.verify_rows``), each row is accepted by the
exact verifier with its own generators, and each row's cache keeps exactly its committed entries
(``BatchCache.compact_rows``: one gather per layer over the moved entries). The head drafts all rows
in one forward per level (``Drafter.propose_rows``). Without a head (and without context branches)
the same loop is batched plain decoding, the honest denominator of batched speed-ups.

Randomness: request ``i`` of a call with ``seed`` draws from the generators that
``SpeculativeDecoder.generate(prompt_i, seed=seed * n + i)`` would use (``n`` requests), so rows never
share random draws and a row's output is that of ``generate`` on its prompt alone (up to the float
rounding of batched matrix products).

Scheduling (``serve``): first come, first served. Between two rounds, every request that has arrived
is admitted while a row is free (at most ``max_batch`` rows); the newcomers are prefilled together in
one forward (right-padded), their head catches up on their prompts, and they join the running rows
(a copy of the caches, once per admission). Rows that reach EOS or their budget leave after the round
that finished them (a copy of the caches, once per departure). Running rows wait while newcomers are
prefilled: a prefill is never split across rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import Proposal, VerifyRule, sample_token, verify_tree
from eagle_tree.models.target import TargetModel

SEED_STRIDE = 1_000_003  # the draft generator's seed offset, as in SpeculativeDecoder.generate


@dataclass
class Request:
    """One request of a served load: a prompt (1-D token ids), its output budget and its arrival time
    in seconds after the start of the run."""

    prompt: torch.Tensor
    max_new_tokens: int
    arrival_s: float = 0.0


@dataclass
class RequestResult:
    """One request's output and timing; every time is in seconds since the start of the run."""

    sequence: torch.Tensor  # 1-D: prompt + new tokens
    prompt_length: int
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per round
    arrival_s: float = 0.0
    admitted_s: float = 0.0  # its prefill started
    first_token_s: float = 0.0
    finish_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each new token came out (a round's tokens together)
    stopped_by: str = "length"  # "length" or "eos"

    @property
    def new_tokens(self) -> int:
        return int(self.sequence.shape[0]) - self.prompt_length

    @property
    def ttft_s(self) -> float:
        """Time to first token, queueing included."""
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        """End-to-end latency, queueing included."""
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        return (self.finish_s - self.first_token_s) / max(self.new_tokens - 1, 1)

    @property
    def gaps(self) -> list[float]:
        """Gaps between consecutive streamed tokens (zero inside a round's burst)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def mean_acceptance_length(self) -> float:
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0


@dataclass
class BatchOutput:
    """The requests' results in input order and the run's wall time."""

    results: list[RequestResult]
    total_s: float = 0.0
    rounds: int = 0  # target forwards of decoding rounds (prefills excluded)
    peak_cache_bytes: int = 0  # the largest size of the target's and the head's key/value buffers during the run

    @property
    def sequences(self) -> list[torch.Tensor]:
        return [r.sequence for r in self.results]

    @property
    def acceptance_lengths(self) -> list[list[int]]:
        return [r.acceptance_lengths for r in self.results]

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.results)

    @property
    def throughput(self) -> float:
        """New tokens per second over the whole run."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0


@dataclass
class _Row:
    """A running request."""

    index: int
    tokens: list[int]
    budget: int
    result: RequestResult
    verifier: torch.Generator
    drafter_gen: torch.Generator
    pending: int = 0  # committed pairs the drafter has not seen (their features and tokens are in _Batch)

    @property
    def done(self) -> bool:
        return self.result.stopped_by == "eos" or len(self.tokens) - self.result.prompt_length >= self.budget


class BatchRun:
    """The rows decoding together: their target cache, their drafter and their pending pairs.

    ``new_drafter(rows)``: a fresh drafter of ``rows`` rows (None: plain decoding); ``rule``: the
    verification rule of the proposals for an empty tree; ``extra_rows``: the most rows a round adds
    to a request's cache (1 + the largest tree)."""

    def __init__(self, target: TargetModel, new_drafter, sampling: SamplingConfig, seed: int, requests: int,
                 eos: set[int], extra_rows: int):
        self.target, self.new_drafter, self.sampling = target, new_drafter, sampling
        self.seed, self.requests, self.eos, self.extra_rows = seed, requests, eos, extra_rows
        self.rows: list[_Row] = []
        self.cache = target.new_batch_cache(0)
        self.drafter = None
        self.features: torch.Tensor | None = None  # (B, m, 3H) pending pairs' features (padded)
        self.next_tokens: torch.Tensor | None = None  # (B, m)
        self.start = time.perf_counter()
        self.sync = torch.cuda.synchronize if target.device.type == "cuda" else None
        self.rounds = 0
        self.peak_cache_bytes = 0

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - self.start

    # ------------------------------------------------------------------------------------ admission
    def admit(self, admitted: list[tuple[int, Request]]) -> None:
        """Prefill the newcomers together, draw their first tokens, catch their drafter up on their
        prompts and append them to the running rows."""
        t0 = self.now()
        prompts = [req.prompt.tolist() for _, req in admitted]
        capacity = max(len(p) + req.max_new_tokens for p, (_, req) in zip(prompts, admitted, strict=True))
        cache = self.target.new_batch_cache(len(prompts), capacity + self.extra_rows)
        out = self.target.prefill_rows(prompts, cache)
        new_rows = []
        for b, ((index, req), prompt) in enumerate(zip(admitted, prompts, strict=True)):
            s = self.seed * self.requests + index
            verifier = torch.Generator().manual_seed(s)
            drafter_gen = torch.Generator().manual_seed(s + SEED_STRIDE)
            p = processed_probs(out.logits[b, len(prompt) - 1], self.sampling)
            first = sample_token(p, self.sampling.greedy, verifier)
            result = RequestResult(torch.tensor(prompt), len(prompt), arrival_s=req.arrival_s, admitted_s=t0)
            row = _Row(index, prompt + [first], req.max_new_tokens, result, verifier, drafter_gen)
            if first in self.eos:
                result.stopped_by = "eos"
            new_rows.append(row)
        drafter = None
        if self.new_drafter is not None:
            drafter = self.new_drafter(len(prompts))
            lengths = [len(p) for p in prompts]
            ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
            for b, row in enumerate(new_rows):  # pairs (f_j, x_{j+1}): positions 0..P-1, next tokens 1..P
                ids[b, : lengths[b]] = torch.tensor(row.tokens[1:])
            drafter.catch_up(out.features, ids.to(out.features.device), lengths)
        now = self.now()
        for row in new_rows:
            row.result.first_token_s = now
            row.result.token_times.append(now)
        self.cache.add_rows(cache)
        if drafter is not None:
            if self.drafter is None or not self.rows:
                self.drafter = drafter
            else:
                self.drafter.add_rows(drafter)
        self.rows += new_rows
        self._pad_pending()
        self._measure()

    def _measure(self) -> None:
        """Track the peak size of the key/value buffers (target cache and head cache)."""
        size = sum(t.numel() * t.element_size() for layer in self.cache.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))
        cache = getattr(self.drafter, "cache", None) or getattr(getattr(self.drafter, "inner", None), "cache", None)
        if cache is not None and cache.k is not None:
            size += cache.k.numel() * cache.k.element_size() * 2
        self.peak_cache_bytes = max(self.peak_cache_bytes, size)

    def _pad_pending(self) -> None:
        """Pending pairs after rows joined or left: the newcomers have none (caught up at admission)."""
        if self.features is None or self.drafter is None:
            return
        b = len(self.rows)
        if self.features.shape[0] < b:
            extra = b - self.features.shape[0]
            self.features = torch.cat([self.features, self.features.new_zeros(extra, *self.features.shape[1:])])
            self.next_tokens = torch.cat([self.next_tokens, self.next_tokens.new_zeros(extra,
                                                                                       self.next_tokens.shape[1])])

    # --------------------------------------------------------------------------------------- rounds
    def step(self) -> None:
        """One round for every running row: draft, verify in one forward, accept, update."""
        rows = self.rows
        proposals = self._draft()
        trees = [p.tree for p in proposals]
        starts = list(self.cache.lengths)  # each row's root goes to slot starts[b]
        out = self.target.verify_rows([row.tokens[-1] for row in rows], trees, self.cache)
        keeps, news = [], []
        for b, (row, proposal) in enumerate(zip(rows, proposals, strict=True)):
            tree = proposal.tree
            p = processed_probs(out.logits[b, : len(tree) + 1], self.sampling, check=False)
            res = verify_tree(tree, p, proposal.draft_probs, proposal.rule, row.verifier)
            new = [tree.tokens[a] for a in res.accepted] + [res.next_token]
            new = new[: row.budget - (len(row.tokens) - row.result.prompt_length)]
            cut = next((i for i, t in enumerate(new) if t in self.eos), None)
            if cut is not None:
                new = new[: cut + 1]
                row.result.stopped_by = "eos"
            keeps.append(Tree.cache_rows(res.accepted[: len(new) - 1]))
            news.append(new)
        self.cache.compact_rows(starts, keeps)
        if self.drafter is not None:  # the accepted rows' features and the committed tokens, padded
            m = max(len(k) for k in keeps)
            index = torch.tensor([k + [k[-1]] * (m - len(k)) for k in keeps], device=out.features.device)
            self.features = out.features.gather(1, index[:, :, None].expand(-1, -1, out.features.shape[2]))
            self.next_tokens = torch.tensor([n + [n[-1]] * (m - len(n)) for n in news], device=index.device)
            for row, new in zip(rows, news, strict=True):
                row.pending = len(new)
        now = self.now()
        for row, new in zip(rows, news, strict=True):
            row.tokens += new
            row.result.acceptance_lengths.append(len(new))
            row.result.token_times += [now] * len(new)
        self.rounds += 1
        self._measure()

    def _draft(self) -> list[Proposal]:
        rows = self.rows
        if self.drafter is None:
            rule = VerifyRule.for_draft(self.sampling.greedy)
            return [Proposal(Tree([], []), None, rule) for _ in rows]
        if self.features is not None and any(row.pending for row in rows):
            # rows that joined since the last round were caught up at admission: 0 pairs
            self.drafter.catch_up(self.features, self.next_tokens, [row.pending for row in rows])
        for row in rows:
            row.pending = 0
        return self.drafter.propose_rows(self.sampling, [row.drafter_gen for row in rows])

    # ------------------------------------------------------------------------------------ departures
    def retire(self) -> list[_Row]:
        """Remove the finished rows; return them with their results completed."""
        done = [row for row in self.rows if row.done]
        if not done:
            return []
        now = self.now()
        for row in done:
            row.result.finish_s = now
            row.result.sequence = torch.tensor(row.tokens, dtype=torch.long)
        keep = [b for b, row in enumerate(self.rows) if not row.done]
        self.rows = [self.rows[b] for b in keep]
        self.cache.select_rows(keep)
        if not keep:
            self.drafter = self.features = self.next_tokens = None
        elif self.drafter is not None:
            self.drafter.select_rows(keep)
            if self.features is not None:
                index = torch.tensor(keep, dtype=torch.long, device=self.features.device)
                self.features, self.next_tokens = self.features[index], self.next_tokens[index]
        return done
