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
from dataclasses import dataclass, field

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import sample_token, verify_tree
from eagle_tree.decoding.context import ContextDrafter
from eagle_tree.decoding.drafting import Drafter, Proposal, TreeConfig
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


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with an EAGLE-3 ``draft`` head (None: plain decoding).

    ``tree``: the draft shape; without it, the shapes in the head folder's ``decoding.json`` (one for
    greedy decoding, one for sampling; decoding/shapes.py), else ``TreeConfig()``. ``tree.context``
    adds context branches (decoding/context.py); with no head they draft alone.
    ``drafter`` replaces the head-driven Drafter with any object offering ``reset()``,
    ``catch_up(features, next_tokens)`` and ``propose(sampling, generator) -> Proposal`` (tests use
    this to force acceptance patterns).
    """

    def __init__(self, target, draft=None, tree: TreeConfig | None = None, drafter=None):
        layers = None if draft is None else draft.config.feature_layers
        self.target = target if isinstance(target, TargetModel) else TargetModel(target, feature_layers=layers)
        self.draft = draft
        # without tree=, the head folder's decoding.json (greedy and sampling shapes), else TreeConfig()
        self.defaults = {} if tree is not None or drafter is not None else load_decoding_defaults(
            getattr(draft, "pretrained_path", None))
        self._build(tree or self.defaults.get("greedy") or TreeConfig(), drafter)

    def _build(self, tree: TreeConfig, drafter=None) -> None:
        self.tree = tree
        draft = self.draft
        if drafter is None and self.tree.context is not None:  # context branches; no head: context only
            drafter = ContextDrafter(Drafter(draft, self.tree) if draft is not None else None, self.tree.context)
        if draft is not None:
            draft.bind_target(self.target)
            draft.eval()
            drafter = drafter or Drafter(draft, self.tree)
        self.drafter = drafter

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        eos_token_id: int | list[int] | None = None,
    ) -> GenerateOutput:
        sampling = sampling or SamplingConfig(temperature=0.0)
        default = self.defaults.get("greedy" if sampling.greedy else "sampling")
        if default is not None and default != self.tree:  # the head folder's shape for this kind of decoding
            self._build(default)
        input_ids = torch.as_tensor(input_ids).long()
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be one non-empty prompt of shape (1, T), got {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        verifier_gen = torch.Generator().manual_seed(seed)
        draft_gen = torch.Generator().manual_seed(seed + 1_000_003)  # independent of the verifier's
        device = self.target.device

        start = time.perf_counter()
        cache = self.target.new_cache()
        prompt = input_ids.to(device)
        out = self.target.prefill(prompt, cache)
        first = sample_token(processed_probs(out.logits[0, -1], sampling), sampling.greedy, verifier_gen)
        tokens = prompt[0].tolist() + [first]
        result = GenerateOutput(input_ids, prompt.shape[1])
        result.prefill_s = time.perf_counter() - start
        result.token_times.append(result.prefill_s)
        if self.drafter is not None:
            self.drafter.reset()
            # pairs (f_j, x_{j+1}) for the prompt: features of positions 0..P-1, next tokens 1..P
            pending = (out.features, torch.tensor([tokens[1:]], device=device))

        while first not in eos and len(tokens) - prompt.shape[1] < max_new_tokens:
            t0 = time.perf_counter()
            if self.drafter is not None:  # 1. draft
                self.drafter.catch_up(*pending)
                proposal = self.drafter.propose(sampling, draft_gen)
            else:
                proposal = _empty_proposal(sampling)
            t1 = time.perf_counter()
            tree = proposal.tree
            out = self.target.verify(tokens[-1], tree, cache)  # 2. verify
            t2 = time.perf_counter()
            p = processed_probs(out.logits[0], sampling)  # 3. accept
            res = verify_tree(tree, p, proposal.draft_probs, proposal.rule, verifier_gen)
            new = [tree.tokens[a] for a in res.accepted] + [res.next_token]
            room = max_new_tokens - (len(tokens) - prompt.shape[1])
            new = new[:room]  # 4. update: the length limit, then EOS, cut the path
            stop = next((i for i, t in enumerate(new) if t in eos), None)
            if stop is not None:
                new = new[: stop + 1]
            kept_nodes = res.accepted[: len(new) - 1]  # the last new token is the next root, pending
            rows = [0] + [1 + a for a in kept_nodes]
            self.target.compact_cache(cache, len(tokens) - 1, rows)
            if self.drafter is not None:
                pending = (out.features[:, rows], torch.tensor([new], device=device))
            tokens += new
            t3 = time.perf_counter()
            accepted = min(len(res.accepted), len(new))
            result.rounds.append(RoundStats(accepted, len(new), len(tree), t1 - t0, t2 - t1, t3 - t2))
            now = t3 - start
            result.token_times += [now] * len(new)
            if stop is not None:
                result.stopped_by = "eos"
                break
        else:
            if first in eos:
                result.stopped_by = "eos"
        result.total_s = time.perf_counter() - start
        result.sequences = torch.tensor([tokens], dtype=torch.long)
        return result


def _empty_proposal(sampling: SamplingConfig) -> Proposal:
    return Proposal(Tree([], []), None, TreeConfig.chain(1).rule(sampling))
