"""The speculative decoding round loop and its statistics.

Invariant between rounds: ``L`` committed tokens; the target cache holds the first ``L - 1``; the
last committed token is the root of the next tree, pending. One round:

1. draft    - the head catches up on the newly committed pairs and grows a tree (or a chain);
2. verify   - one target forward over [root, tree] under the tree mask;
3. accept   - the pure verifier walks the tree (exact acceptance) and returns path + next token;
4. update   - EOS / max_new_tokens cut the path; the target cache keeps root + accepted nodes.

Without a draft the same loop is plain decoding (an empty tree: one token per round), so the
speed-up denominator uses the same cache code.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import Proposal, VerifyRule, sample_token, verify_tree
from eagle_tree.decoding.batch import SEED_STRIDE, BatchOutput, BatchRun, Request, RequestResult
from eagle_tree.decoding.context import ContextDrafter
from eagle_tree.decoding.drafting import Drafter, DrafterProtocol, TreeConfig
from eagle_tree.decoding.shapes import load_decoding_defaults
from eagle_tree.models.target import TargetModel


@dataclass
class RoundStats:
    """One round: draft tokens accepted, tokens committed (accepted + correction/bonus, after the
    EOS / length cut), tree size and the time split in seconds."""

    accepted: int
    committed: int
    tree_size: int
    draft_s: float
    verify_s: float
    other_s: float

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.other_s


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # (1, prompt + new)
    prompt_length: int
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0  # prefill and the first token: time to first token
    total_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # seconds since start when each token came out
    stopped_by: str = "length"  # "length" or "eos"

    @property
    def new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens committed per speculative round (accepted draft tokens + correction or bonus). They
        sum to ``new_tokens - 1``: the first new token comes from the prefill and belongs to no round."""
        return [r.committed for r in self.rounds]

    @property
    def mean_acceptance_length(self) -> float:
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def time_per_output_token(self) -> float:
        """Cumulative wall time / committed tokens (never a mean of per-round ratios)."""
        return self.total_s / max(self.new_tokens, 1)


class RoundClock:
    """The time bookkeeping of ``generate``, kept out of the algorithm's lines: ``phase(name)`` times
    a block as "draft", "verify" or "other" of the current round; ``close_round`` files the round's
    RoundStats and the time its tokens came out. On a CUDA device each phase ends with a
    synchronisation, so that the split is the device's and not the launch queue's."""

    def __init__(self, result: GenerateOutput, device: torch.device):
        self.result = result
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.start = time.perf_counter()
        self.split = {"draft": 0.0, "verify": 0.0, "other": 0.0}

    def now(self) -> float:
        return time.perf_counter() - self.start

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        yield
        if self.sync is not None:
            self.sync()
        self.split[name] += time.perf_counter() - t0

    def first_token(self) -> None:
        self.result.prefill_s = self.now()
        self.result.token_times.append(self.result.prefill_s)

    def close_round(self, accepted: int, committed: int, tree_size: int) -> None:
        s = self.split
        self.result.rounds.append(RoundStats(accepted, committed, tree_size, s["draft"], s["verify"], s["other"]))
        self.result.token_times += [self.now()] * committed
        self.split = {"draft": 0.0, "verify": 0.0, "other": 0.0}

    def close(self) -> None:
        self.result.total_s = self.now()


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with an EAGLE-3 ``draft`` head (None: plain decoding).

    ``tree``: the draft shape; without it, the shapes in the head folder's ``decoding.json`` (one for
    greedy decoding, one for sampling; decoding/shapes.py), else ``TreeConfig()``. ``tree.context``
    adds context branches (decoding/context.py); with no head they draft alone.
    ``drafter`` replaces the head-driven Drafter with any DrafterProtocol object (``reset()``,
    ``catch_up(features, next_tokens)``, ``propose(sampling, generator) -> Proposal``); tests use this
    to force acceptance patterns. ``compile=True`` compiles the head's step with ``torch.compile``
    (off by default: on CPU it costs about a minute of warm-up and did not speed the step up).
    """

    def __init__(self, target, draft=None, tree: TreeConfig | None = None, drafter: DrafterProtocol | None = None,
                 compile: bool = False):
        layers = None if draft is None else draft.config.feature_layers
        self.target = target if isinstance(target, TargetModel) else TargetModel(target, feature_layers=layers)
        self.draft = draft
        # without tree=, the head folder's decoding.json (greedy and sampling shapes), else TreeConfig()
        self.defaults = {} if tree is not None or drafter is not None else load_decoding_defaults(
            getattr(draft, "pretrained_path", None))
        self._build(tree or self.defaults.get("greedy") or TreeConfig(), drafter)
        if compile:
            _compile(self.target, draft)

    def _build(self, tree: TreeConfig, drafter: DrafterProtocol | None = None) -> None:
        self.tree = tree
        self.custom_drafter = drafter is not None
        if self.draft is not None:
            self.draft.bind_target(self.target)
            self.draft.eval()
        drafter = drafter or self._new_drafter()
        if drafter is not None and not isinstance(drafter, DrafterProtocol):
            raise TypeError(f"drafter {type(drafter).__name__} lacks reset / catch_up / propose (DrafterProtocol)")
        self.drafter = drafter

    def _new_drafter(self, rows: int = 1):
        """A fresh drafter of this decoder's shape for ``rows`` rows: the head's (with context branches
        if configured), context branches alone, or None (plain decoding)."""
        draft, tree = self.draft, self.tree
        drafter = None if draft is None else Drafter(draft, tree)
        if tree.context is not None:  # context branches; no head: context only
            drafter = ContextDrafter(drafter, tree.context)
        if drafter is not None and rows != 1:
            drafter.reset(rows)
        return drafter

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        eos_token_id: int | list[int] | None = None,
    ) -> GenerateOutput:
        sampling, eos = self._prepare(sampling, eos_token_id)
        input_ids = torch.as_tensor(input_ids).long()
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be one non-empty prompt of shape (1, T), got {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        verifier_gen = torch.Generator().manual_seed(seed)
        draft_gen = torch.Generator().manual_seed(seed + SEED_STRIDE)  # independent of the verifier's
        device = self.target.device
        prompt_length = input_ids.shape[1]
        result = GenerateOutput(input_ids, prompt_length)
        clock = RoundClock(result, device)

        # sized once: the prompt, every new token and the largest tree a round can verify
        context = self.tree.context
        tree_rows = 1 + (0 if self.drafter is None else self.tree.total_tokens
                         + (0 if context is None else context.branches * context.lookup_tokens))
        cache = self.target.new_cache(prompt_length + max_new_tokens + tree_rows)
        prompt = input_ids.to(device)
        out = self.target.prefill(prompt, cache)
        first = sample_token(processed_probs(out.logits[0, -1], sampling), sampling.greedy, verifier_gen)
        tokens = prompt[0].tolist() + [first]
        clock.first_token()
        pending = None  # committed pairs the drafter has not seen: (features (1, m, 3H), next tokens (1, m))
        if self.drafter is not None:
            self.drafter.reset()
            # pairs (f_j, x_{j+1}) for the prompt: features of positions 0..P-1, next tokens 1..P
            pending = (out.features, torch.tensor([tokens[1:]], device=device))

        stop = first in eos
        while not stop and len(tokens) - prompt_length < max_new_tokens:
            with clock.phase("draft"):  # 1. draft: catch up on the committed pairs, grow a tree
                proposal = self._draft(pending, sampling, draft_gen)
            tree = proposal.tree
            with clock.phase("verify"):  # 2. verify: one target forward over [root, tree]
                out = self.target.verify(tokens[-1], tree, cache)
            with clock.phase("other"):
                # 3. accept: the exact walk of the tree
                p = processed_probs(out.logits[0], sampling)
                res = verify_tree(tree, p, proposal.draft_probs, proposal.rule, verifier_gen)
                # 4. update: cut the path at the length limit, then at EOS; keep the root and the
                # accepted nodes in the cache (the last new token is the next root, pending)
                new = [tree.tokens[a] for a in res.accepted] + [res.next_token]
                new = new[: max_new_tokens - (len(tokens) - prompt_length)]
                cut = next((i for i, t in enumerate(new) if t in eos), None)
                if cut is not None:
                    new = new[: cut + 1]
                rows = Tree.cache_rows(res.accepted[: len(new) - 1])
                self.target.compact_cache(cache, len(tokens) - 1, rows)
                if self.drafter is not None:
                    pending = (out.features[:, rows], torch.tensor([new], device=device))
                tokens += new
                stop = cut is not None
            clock.close_round(min(len(res.accepted), len(new)), len(new), len(tree))
        if tokens[-1] in eos:
            result.stopped_by = "eos"
        clock.close()
        result.sequences = torch.tensor([tokens], dtype=torch.long)
        return result

    def _prepare(self, sampling: SamplingConfig | None, eos_token_id) -> tuple[SamplingConfig, set[int]]:
        """The sampling config (greedy by default), the head folder's shape for this kind of decoding,
        and the set of EOS ids."""
        sampling = sampling or SamplingConfig(temperature=0.0)
        default = self.defaults.get("greedy" if sampling.greedy else "sampling")
        if default is not None and default != self.tree:  # the head folder's shape for this kind of decoding
            self._build(default)
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        return sampling, eos

    @torch.no_grad()
    def generate_batch(
        self,
        prompts,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        eos_token_id: int | list[int] | None = None,
    ) -> BatchOutput:
        """Decode several prompts (1-D token sequences of any lengths) together: one batch from the
        start, each row with its own tree of this decoder's shape, all verified in one target forward per
        round; rows leave as they reach EOS or ``max_new_tokens``. Returns a BatchOutput in input order
        (``.sequences``, ``.acceptance_lengths``, per-request timing). Row i draws from the generators of
        ``generate(prompts[i], seed=seed * len(prompts) + i)`` (decoding/batch.py)."""
        requests = [Request(_prompt(p, i), max_new_tokens) for i, p in enumerate(prompts)]
        if not requests:
            raise ValueError("generate_batch needs at least one prompt")
        return self.serve(requests, max_batch=len(requests), sampling=sampling, seed=seed, eos_token_id=eos_token_id)

    @torch.no_grad()
    def serve(
        self,
        requests: list[Request],
        max_batch: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        eos_token_id: int | list[int] | None = None,
    ) -> BatchOutput:
        """Continuous batching of ``requests`` (each with its arrival time, in seconds after the call):
        first come, first served, at most ``max_batch`` rows; newcomers are prefilled together between
        rounds and rows leave as they finish (decoding/batch.py). Per-request times include queueing."""
        if self.custom_drafter:
            raise ValueError("batched decoding drafts with the head and context branches of the decoder's shape; "
                             "a drafter= object drafts for one sequence: use generate, or pass draft and tree")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        for i, req in enumerate(requests):
            req.prompt = _prompt(req.prompt, i)
            budget = req.max_new_tokens
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ValueError(f"request {i}: max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
        sampling, eos = self._prepare(sampling, eos_token_id)
        context = self.tree.context
        extra = 1 + (0 if self.drafter is None else self.tree.total_tokens
                     + (0 if context is None else context.max_nodes))
        run = BatchRun(self.target, None if self.drafter is None else self._new_drafter, sampling, seed,
                       len(requests), eos, extra)
        results: list[RequestResult | None] = [None] * len(requests)
        waiting = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
        while waiting or run.rows:
            now = run.now()
            free = max_batch - len(run.rows)
            arrived = [i for i in waiting if requests[i].arrival_s <= now][:free]
            if arrived:
                waiting = [i for i in waiting if i not in set(arrived)]
                run.admit([(i, requests[i]) for i in arrived])
                for row in run.retire():  # EOS as the first token
                    results[row.index] = row.result
            if not run.rows:
                if waiting:
                    time.sleep(max(0.0, requests[waiting[0]].arrival_s - run.now()))
                continue
            run.step()
            for row in run.retire():
                results[row.index] = row.result
        return BatchOutput(results, run.now(), run.rounds, run.peak_cache_bytes)

    def _draft(self, pending, sampling: SamplingConfig, generator: torch.Generator) -> Proposal:
        """The round's proposal: the drafter's tree, or the empty tree of plain decoding."""
        if self.drafter is None:
            return Proposal(Tree([], []), None, VerifyRule.for_draft(sampling.greedy))
        self.drafter.catch_up(*pending)
        return self.drafter.propose(sampling, generator)


def _prompt(prompt, index: int) -> torch.Tensor:
    """A request's prompt as a non-empty 1-D long tensor."""
    prompt = torch.as_tensor(prompt).long().reshape(-1) if not isinstance(prompt, torch.Tensor) else prompt.long()
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"prompt {index} must be a non-empty 1-D token sequence, got shape {tuple(prompt.shape)}")
    return prompt


def _compile(target: TargetModel, draft) -> None:
    """torch.compile the head's step in place (dynamic shapes: the cache length and the frontier width
    change every round). The target's forward is left eager: its feature hooks are registered per call,
    which a compiled graph would have to guard on. CUDA graphs would further need static shapes: a
    fixed frontier width per level (the growth plan has it), caches read over their whole capacity
    with the length in a device tensor and masks hiding the unfilled tail, instead of views cut at a
    Python length."""
    if draft is not None:
        draft.step = torch.compile(draft.step, dynamic=True)
