"""The speculative decoding round loop, for B requests of different lengths (``generate`` is B = 1).

Invariant between rounds, per request: ``L`` committed tokens; the target cache holds the first
``L - 1``; the last committed token is the root of the next tree, pending; the drafter has pending
the (feature, next token) pairs of the tokens committed since its last catch-up. One round
(``RoundLoop.step``), for every running request at once:

1. draft    - the drafter catches up on the newly committed pairs and grows one tree per request
              (``RoundDrafter.propose``; no drafter: the empty tree of plain decoding);
2. verify   - one target forward over every request's [root, tree] (``TargetModel.verify``);
3. accept   - the pure verifier walks each request's tree with that request's generator;
4. commit   - ``commit`` cuts the path at the budget, then after the first EOS; the target cache keeps
              each request's root and accepted nodes (``TargetCache.compact``).

Randomness: request ``i`` of ``n`` in a call with ``seed`` draws from ``request_generators(seed, n,
i)``: the verifier's generator seeded ``seed * n + i``, the drafter's that plus ``SEED_STRIDE``, so
requests never share draws, the verifier never reads draft noise, and a request's output is that of
``generate(prompt_i, seed=seed * n + i)`` (up to the float rounding of batched matrix products).

Scheduling (``serve``): first come, first served. Between two rounds, every request that has arrived
is admitted while fewer than ``max_batch`` run; the newcomers are prefilled together in one forward
(right-padded), their drafter catches up on their prompts, and they join the running requests (a copy
of the caches, once per admission). Requests that reach EOS or their budget leave after the round that
finished them (a copy of the caches, once per departure). Running requests wait while newcomers are
prefilled: a prefill is never split across rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import Proposal, VerifyResult, sample_token, verify_tree
from eagle_tree.decoding.drafting import RoundDrafter
from eagle_tree.models.cache import MIN_CAPACITY
from eagle_tree.models.target import TargetModel

SEED_STRIDE = 1_000_003  # the drafter generator's seed offset from the verifier's
OUTPUT_SLOTS = 4 * MIN_CAPACITY  # cache slots reserved for the output up front; more grow on demand


def request_generators(seed: int, requests: int, index: int) -> tuple[torch.Generator, torch.Generator]:
    """The verifier's and the drafter's generators of request ``index`` of ``requests`` in a call with
    ``seed`` (``generate``: one request, so its seed is ``seed``)."""
    s = seed * requests + index
    return torch.Generator().manual_seed(s), torch.Generator().manual_seed(s + SEED_STRIDE)


def commit(tree: Tree, result: VerifyResult, room: int, eos: set[int]) -> tuple[list[int], list[int]]:
    """What a round commits for one request: the accepted nodes' tokens and the next token, cut at
    ``room`` (the rest of its budget), then after the first EOS; and the accepted nodes whose cache
    entries stay (the last committed token is the next root, not yet in the cache)."""
    new = [tree.tokens[a] for a in result.accepted] + [result.next_token]
    new = new[:room]
    cut = next((i for i, t in enumerate(new) if t in eos), None)
    if cut is not None:
        new = new[: cut + 1]
    return new, result.accepted[: len(new) - 1]


def _total(times: RoundStats | RoundSplit) -> float:
    return times.draft_s + times.verify_s + times.other_s


@dataclass
class RoundStats:
    """One request's round: draft tokens accepted, tokens committed (accepted + correction/bonus, after
    the EOS / budget cut), tree size, and the round's time split in seconds (the batch's, shared by the
    requests that ran in it)."""

    accepted: int
    committed: int
    tree_size: int
    draft_s: float
    verify_s: float
    other_s: float
    total_s = property(lambda self: _total(self), doc="draft + verify + other seconds")


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
    rounds: list[RoundStats] = field(default_factory=list)  # its rounds (empty for the Hugging Face baselines)

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
class RoundSplit:
    """One round of the whole batch: requests in it and the time split in seconds."""

    requests: int
    draft_s: float
    verify_s: float
    other_s: float
    total_s = property(lambda self: _total(self), doc="draft + verify + other seconds")


@dataclass
class BatchOutput:
    """The requests' results in input order and the run's wall time."""

    results: list[RequestResult]
    total_s: float = 0.0
    rounds: int = 0  # target forwards of decoding rounds (prefills excluded)
    peak_cache_bytes: int = 0  # the largest size of the target's and the head's key/value buffers during the run
    splits: list[RoundSplit] = field(default_factory=list)  # every round's time split (len(splits) == rounds)

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


class RoundClock:
    """The time bookkeeping of the loop, kept out of the algorithm's lines: ``now()`` is the run's
    clock; ``phase(name)`` times a block as "draft", "verify" or "other" of the current round;
    ``close_round()`` returns the round's split and starts the next. On a CUDA device ``now`` and each
    phase end with a synchronisation, so that the split is the device's and not the launch queue's."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.start = time.perf_counter()
        self.split = {"draft": 0.0, "verify": 0.0, "other": 0.0}

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - self.start

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        yield
        if self.sync is not None:
            self.sync()
        self.split[name] += time.perf_counter() - t0

    def close_round(self, requests: int) -> RoundSplit:
        s = self.split
        self.split = {"draft": 0.0, "verify": 0.0, "other": 0.0}
        return RoundSplit(requests, s["draft"], s["verify"], s["other"])


@dataclass
class _Running:
    """A running request."""

    index: int  # in the call's request list
    tokens: list[int]
    budget: int
    result: RequestResult
    verifier: torch.Generator
    drafter_gen: torch.Generator
    pending: int = 0  # committed pairs the drafter has not seen (their features and tokens are in RoundLoop)

    @property
    def done(self) -> bool:
        return self.result.stopped_by == "eos" or len(self.tokens) - self.result.prompt_length >= self.budget


class RoundLoop:
    """The requests decoding together: their target cache, their drafter and their pending pairs.

    ``new_drafter(requests)``: a fresh drafter of ``requests`` requests (None: plain decoding);
    ``tree_slots``: the most entries a round adds to a request's cache (1 + the largest tree)."""

    def __init__(self, target: TargetModel, new_drafter: Callable[[int], RoundDrafter] | None,
                 sampling: SamplingConfig, seed: int, requests: int, eos: set[int], tree_slots: int):
        self.target, self.new_drafter, self.sampling = target, new_drafter, sampling
        self.seed, self.requests, self.eos, self.tree_slots = seed, requests, eos, tree_slots
        self.running: list[_Running] = []
        self.cache = target.new_cache(requests=0)
        self.drafter: RoundDrafter | None = None
        self.features: torch.Tensor | None = None  # (B, m, 3H) pending pairs' features (padded)
        self.next_tokens: torch.Tensor | None = None  # (B, m)
        self.clock = RoundClock(target.device)
        self.splits: list[RoundSplit] = []
        self.peak_cache_bytes = 0

    def now(self) -> float:
        return self.clock.now()

    # ------------------------------------------------------------------------------------ admission
    def admit(self, admitted: list[tuple[int, Request]]) -> None:
        """Prefill the newcomers together, draw their first tokens, catch their drafter up on their
        prompts and append them to the running requests."""
        t0 = self.now()
        prompts = [req.prompt.tolist() for _, req in admitted]
        budget = max(req.max_new_tokens for _, req in admitted)
        capacity = max(len(p) for p in prompts) + min(budget, OUTPUT_SLOTS) + self.tree_slots  # grows on demand
        cache = self.target.new_cache(capacity, requests=len(prompts))
        out = self.target.prefill(prompts, cache)
        newcomers = []
        for b, ((index, req), prompt) in enumerate(zip(admitted, prompts, strict=True)):
            verifier, drafter_gen = request_generators(self.seed, self.requests, index)
            p = processed_probs(out.logits[b, len(prompt) - 1], self.sampling)
            first = sample_token(p, self.sampling.greedy, verifier)
            result = RequestResult(torch.tensor(prompt), len(prompt), arrival_s=req.arrival_s, admitted_s=t0)
            if first in self.eos:
                result.stopped_by = "eos"
            newcomers.append(_Running(index, prompt + [first], req.max_new_tokens, result, verifier, drafter_gen))
        now = self.now()
        for new in newcomers:
            new.result.first_token_s = now
            new.result.token_times.append(now)
        drafter = None
        if self.new_drafter is not None:
            drafter = self.new_drafter(len(prompts))
            lengths = [len(p) for p in prompts]
            ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
            for b, new in enumerate(newcomers):  # pairs (f_j, x_{j+1}): positions 0..P-1, next tokens 1..P
                ids[b, : lengths[b]] = torch.tensor(new.tokens[1:])
            drafter.catch_up(out.features, ids.to(out.features.device), lengths)
        self.cache.extend(cache)
        if drafter is not None:
            if self.drafter is None or not self.running:
                self.drafter = drafter
            else:
                self.drafter.extend(drafter)
        self.running += newcomers
        if self.features is not None and self.drafter is not None:  # the newcomers have no pending pairs
            extra = len(self.running) - self.features.shape[0]
            self.features = torch.cat([self.features, self.features.new_zeros(extra, *self.features.shape[1:])])
            self.next_tokens = torch.cat([self.next_tokens, self.next_tokens.new_zeros(extra,
                                                                                       self.next_tokens.shape[1])])
        self._measure()

    def _measure(self) -> None:
        """Track the peak size of the key/value buffers (target cache and head cache)."""
        size = self.cache.nbytes + (0 if self.drafter is None else self.drafter.cache_bytes())
        self.peak_cache_bytes = max(self.peak_cache_bytes, size)

    # --------------------------------------------------------------------------------------- rounds
    def step(self) -> None:
        """One round for every running request: draft, verify in one forward, accept, commit."""
        running, clock = self.running, self.clock
        with clock.phase("draft"):  # 1. draft: catch up on the committed pairs, grow the trees
            proposals = self._draft()
        trees = [p.tree for p in proposals]
        starts = list(self.cache.lengths)  # each request's root goes to slot starts[b]
        with clock.phase("verify"):  # 2. verify: one target forward over every [root, tree]
            out = self.target.verify([r.tokens[-1] for r in running], trees, self.cache)
        with clock.phase("other"):
            kept, news, accepted = [], [], []
            for b, (r, proposal) in enumerate(zip(running, proposals, strict=True)):
                # 3. accept: the exact walk of the request's tree
                tree = proposal.tree
                p = processed_probs(out.logits[b, : len(tree) + 1], self.sampling, check=False)
                res = verify_tree(tree, p, proposal.draft_probs, proposal.rule, r.verifier)
                # 4. commit: the budget and EOS cuts; the root and the kept nodes stay in the cache
                new, nodes = commit(tree, res, r.budget - (len(r.tokens) - r.result.prompt_length), self.eos)
                if new[-1] in self.eos:
                    r.result.stopped_by = "eos"
                kept.append(Tree.cache_offsets(nodes))
                news.append(new)
                accepted.append(min(len(res.accepted), len(new)))
            self.cache.compact(starts, kept)
            if self.drafter is not None:
                self._pend(out.features, kept, news)
        split = clock.close_round(len(running))
        now = self.now()
        for r, new, tree, a in zip(running, news, trees, accepted, strict=True):
            r.tokens += new
            r.result.acceptance_lengths.append(len(new))
            r.result.rounds.append(RoundStats(a, len(new), len(tree), split.draft_s, split.verify_s, split.other_s))
            r.result.token_times += [now] * len(new)
        self.splits.append(split)
        self._measure()

    def _pend(self, features: torch.Tensor, kept: list[list[int]], news: list[list[int]]) -> None:
        """The drafter's next pairs: the kept entries' features (B, m, 3H) and the committed tokens (B, m),
        padded (one host-to-device copy for both index tables)."""
        m = max(len(k) for k in kept)
        tables = torch.tensor([[k + [k[-1]] * (m - len(k)) for k in kept], [n + [n[-1]] * (m - len(n)) for n in news]],
                              device=features.device)  # (2, B, m)
        self.features = features.gather(1, tables[0, :, :, None].expand(-1, -1, features.shape[2]))
        self.next_tokens = tables[1]
        for r, new in zip(self.running, news, strict=True):
            r.pending = len(new)

    def _draft(self) -> list[Proposal]:
        running = self.running
        if self.drafter is None:
            return [Proposal.empty(self.sampling.greedy) for _ in running]
        if self.features is not None and any(r.pending for r in running):
            # requests that joined since the last round were caught up at admission: 0 pairs
            self.drafter.catch_up(self.features, self.next_tokens, [r.pending for r in running])
        for r in running:
            r.pending = 0
        return self.drafter.propose(self.sampling, [r.drafter_gen for r in running])

    # ------------------------------------------------------------------------------------ departures
    def retire(self) -> list[_Running]:
        """Remove the finished requests; return them with their results completed."""
        done = [r for r in self.running if r.done]
        if not done:
            return []
        now = self.now()
        for r in done:
            r.result.finish_s = now
            r.result.sequence = torch.tensor(r.tokens, dtype=torch.long)
        keep = [b for b, r in enumerate(self.running) if not r.done]
        self.running = [self.running[b] for b in keep]
        self.cache.select(keep)
        if not keep:
            self.drafter = self.features = self.next_tokens = None
        elif self.drafter is not None:
            self.drafter.select(keep)
            if self.features is not None:
                index = torch.tensor(keep, dtype=torch.long, device=self.features.device)
                self.features, self.next_tokens = self.features[index], self.next_tokens[index]
        return done

    # ---------------------------------------------------------------------------------- the schedule
    def serve(self, requests: list[Request], max_batch: int) -> BatchOutput:
        """Run ``requests`` to completion, first come, first served, at most ``max_batch`` at once."""
        results: list[RequestResult | None] = [None] * len(requests)
        waiting = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
        while waiting or self.running:
            now = self.now()
            free = max_batch - len(self.running)
            arrived = [i for i in waiting if requests[i].arrival_s <= now][:free]
            if arrived:
                waiting = [i for i in waiting if i not in set(arrived)]
                self.admit([(i, requests[i]) for i in arrived])
                for r in self.retire():  # EOS as the first token
                    results[r.index] = r.result
            if not self.running:
                if waiting:
                    time.sleep(max(0.0, requests[waiting[0]].arrival_s - self.now()))
                continue
            self.step()
            for r in self.retire():
                results[r.index] = r.result
        return BatchOutput(results, self.now(), len(self.splits), self.peak_cache_bytes, self.splits)
