"""``SpeculativeDecoder``: the public entry points of decoding, on the one round loop of
``decoding/rounds.py``.

``generate`` is the loop with one request, ``generate_batch`` with several from the start, ``serve``
with requests arriving over time. Without a draft the same loop is plain decoding (an empty tree: one
token per round), so the speed-up denominator uses the same cache code. Every entry point checks its
arguments first and refuses, with a ``ValueError`` naming the argument, what would decode wrongly or
not at all (token ids outside the vocabulary, empty prompts, a budget that is not a positive integer,
positions past the target's context, arrival times that are not finite numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.context import ContextDrafter
from eagle_tree.decoding.drafting import Drafter, OneSequence, RoundDrafter, SequenceDrafter, TreeConfig
from eagle_tree.decoding.rounds import BatchOutput, Request, RequestResult, RoundLoop, RoundStats
from eagle_tree.decoding.shapes import load_decoding_defaults
from eagle_tree.models.target import TargetModel


@dataclass
class GenerateOutput:
    """The output of ``generate``: one request's tokens, rounds and timing (seconds since the call)."""

    sequences: torch.Tensor  # (1, prompt + new)
    prompt_length: int
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0  # prefill and the first token: time to first token
    total_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # seconds since start when each token came out
    stopped_by: str = "length"  # "length" or "eos"

    @classmethod
    def of(cls, result: RequestResult) -> GenerateOutput:
        return cls(result.sequence[None], result.prompt_length, result.rounds, result.first_token_s, result.finish_s,
                   result.token_times, result.stopped_by)

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


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with an EAGLE-3 ``draft`` head (None: plain decoding).

    ``tree``: the draft shape; without it, the shapes in the head folder's ``decoding.json`` (one for
    greedy decoding, one for sampling; decoding/shapes.py, ``shape_for``), else ``TreeConfig()``. An
    entry of ``decoding.json`` may be plain decoding (``none``, read as None): that kind of decoding
    then runs without a drafter, and ``tree`` is None when the greedy entry is plain.
    ``tree.context`` adds context branches (decoding/context.py); with no head they draft alone.
    ``drafter`` replaces the head-driven drafter with a ``SequenceDrafter`` (``reset()``,
    ``catch_up(features, next_tokens)``, ``propose(sampling, generator) -> Proposal``) or a
    ``RoundDrafter`` of one request, for ``generate`` only; tests use it to force acceptance patterns.
    ``compile=True`` compiles the head's step with ``torch.compile`` (off by default: on CPU it costs
    about a minute of warm-up and did not speed the step up).
    """

    def __init__(self, target, draft=None, tree: TreeConfig | None = None,
                 drafter: SequenceDrafter | RoundDrafter | None = None, compile: bool = False):
        layers = None if draft is None else draft.config.feature_layers
        self.target = target if isinstance(target, TargetModel) else TargetModel(target, feature_layers=layers)
        self.draft = draft
        if draft is not None:
            draft.bind_target(self.target)
            draft.eval()
        # without tree=, the head folder's decoding.json (greedy and sampling shapes; None: plain
        # decoding), else TreeConfig()
        self.defaults = {} if tree is not None or drafter is not None else load_decoding_defaults(
            getattr(draft, "pretrained_path", None))
        self.tree: TreeConfig | None = tree if tree is not None else self.defaults.get("greedy", TreeConfig())
        if drafter is not None and not isinstance(drafter, RoundDrafter | SequenceDrafter):
            raise TypeError(f"drafter {type(drafter).__name__} lacks reset / catch_up / propose (SequenceDrafter)")
        self._custom = drafter
        self._kept: dict[TreeConfig, RoundDrafter | None] = {}  # the drafter of each shape generate used
        if compile:
            _compile(self.target, draft)

    @property
    def drafter(self) -> SequenceDrafter | RoundDrafter | None:
        """The drafter ``generate`` uses with the decoder's shape (the ``drafter=`` object if given;
        None: plain decoding)."""
        return self._custom if self._custom is not None else self._kept_drafter(self.tree)

    def shape_for(self, sampling: SamplingConfig) -> TreeConfig | None:
        """The draft shape for this kind of decoding: the head folder's shape for greedy decoding or for
        sampling, else the decoder's; None where that default is plain decoding (``none``)."""
        kind = "greedy" if sampling.greedy else "sampling"
        return self.defaults[kind] if kind in self.defaults else self.tree

    def _new_drafter(self, tree: TreeConfig | None) -> RoundDrafter | None:
        """A fresh drafter of ``tree``'s shape: the head's, with context branches if configured, or
        context branches alone (no head, or a context-only shape); None without either, or for ``tree``
        None (plain decoding)."""
        if tree is None:
            return None
        drafter = None if self.draft is None or not tree.head else Drafter(self.draft, tree)
        if tree.context is not None:  # context branches; no head: context only
            drafter = ContextDrafter(drafter, tree.context)
        return drafter

    def _kept_drafter(self, tree: TreeConfig | None) -> RoundDrafter | None:
        if tree is None:  # plain decoding: nothing to keep
            return None
        if tree not in self._kept:
            self._kept[tree] = self._new_drafter(tree)
        return self._kept[tree]

    def _drafters(self, tree: TreeConfig | None, one_request: bool):
        """The loop's factory of drafters for n requests, or None (plain decoding, ``tree`` None among
        them): for one request the ``drafter=`` object (as one request) or the decoder's kept drafter of
        ``tree``, reset; for several, a fresh drafter of ``tree`` per admission."""
        if self._custom is not None:
            kept = self._custom if isinstance(self._custom, RoundDrafter) else OneSequence(self._custom)
        elif self._kept_drafter(tree) is None:
            return None
        else:
            kept = self._kept_drafter(tree)

        def factory(requests: int) -> RoundDrafter:
            drafter = kept if one_request else self._new_drafter(tree)
            drafter.reset(requests)
            return drafter

        return factory

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        eos_token_id: int | list[int] | None = None,
    ) -> GenerateOutput:
        """Decode one prompt (``input_ids`` of shape (1, T) or (T,)): the round loop with one request,
        its generators seeded with ``seed`` (verifier) and ``seed + SEED_STRIDE`` (drafter)."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be one prompt of shape (1, T), got {tuple(input_ids.shape)}")
        prompt = self._prompt(input_ids.reshape(-1) if input_ids.dim() <= 2 else input_ids, "input_ids")
        out = self._run([Request(prompt, max_new_tokens)], 1, sampling, seed, eos_token_id, "max_new_tokens")
        return GenerateOutput.of(out.results[0])

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
        start, each request with its own tree of this decoder's shape, all verified in one target forward
        per round; requests leave as they reach EOS or ``max_new_tokens``. Returns a BatchOutput in input
        order (``.sequences``, ``.acceptance_lengths``, per-request timing). Request i draws from the
        generators of ``generate(prompts[i], seed=seed * len(prompts) + i)`` (decoding/rounds.py)."""
        requests = [Request(self._prompt(p, f"prompts[{i}]"), max_new_tokens) for i, p in enumerate(prompts)]
        if not requests:
            raise ValueError("generate_batch needs at least one prompt")
        return self._run(requests, len(requests), sampling, seed, eos_token_id, "max_new_tokens")

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
        first come, first served, at most ``max_batch`` requests; newcomers are prefilled together between
        rounds and requests leave as they finish (decoding/rounds.py). Per-request times include queueing."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        for i, req in enumerate(requests):
            req.prompt = self._prompt(req.prompt, f"requests[{i}].prompt")
            arrival = req.arrival_s
            if isinstance(arrival, bool) or not isinstance(arrival, int | float) or not math.isfinite(arrival):
                raise ValueError(f"requests[{i}].arrival_s must be a finite number of seconds, got {arrival!r}")
        return self._run(requests, max_batch, sampling, seed, eos_token_id, "requests[{i}].max_new_tokens")

    def _run(self, requests: list[Request], max_batch: int, sampling: SamplingConfig | None, seed: int,
             eos_token_id, budget_name: str) -> BatchOutput:
        """Check the budgets against the target's context, then run the round loop."""
        if self._custom is not None and (len(requests) > 1 or max_batch > 1):
            raise ValueError("batched decoding drafts with the head and context branches of the decoder's shape; "
                             "a drafter= object drafts for one sequence: use generate, or pass draft and tree")
        limit = self.target.max_positions
        for i, req in enumerate(requests):
            name, budget = budget_name.format(i=i), req.max_new_tokens
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {budget!r}")
            if limit is not None and len(req.prompt) + budget > limit:
                raise ValueError(f"{name}={budget} after a prompt of {len(req.prompt)} tokens runs past the target's "
                                 f"{limit} positions: lower {name} to at most {limit - len(req.prompt)}, or shorten "
                                 "the prompt")
        sampling = sampling or SamplingConfig(temperature=0.0)
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        tree = self.shape_for(sampling)  # None: this kind of decoding defaults to plain decoding, no drafter
        new_drafter = self._drafters(tree, one_request=len(requests) == 1)
        tree_slots = 1 + (0 if new_drafter is None else tree.total_tokens
                          + (0 if tree.context is None else tree.context.max_nodes))
        loop = RoundLoop(self.target, new_drafter, sampling, seed, len(requests), eos, tree_slots)
        return loop.serve(requests, max_batch)

    def _prompt(self, prompt, name: str) -> torch.Tensor:
        """A prompt as a non-empty 1-D long tensor of token ids in the target's vocabulary."""
        prompt = torch.as_tensor(prompt)
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 1-D token sequence, got shape {tuple(prompt.shape)}")
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got {prompt.dtype}")
        prompt = prompt.long().cpu()
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= self.target.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name} holds token id {bad}, outside the target's vocabulary [0, "
                             f"{self.target.vocab_size})")
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
