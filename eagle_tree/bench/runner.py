"""Side-by-side runs of decoding methods on one target (docs/MEASURING.md, "The bench").

Every method is run on the same target object, tokenised prompts, sampling settings, seeds and
output budget, interleaved by the one timing harness (eagle_tree.bench.timing), and every call returns a
:class:`~eagle_tree.decoding.decoder.GenerateOutput`, so one summary (eagle_tree.bench.aggregate)
serves them all:

- eagle-tree methods (``kind="eagle"``): plain decoding in eagle-tree's own loop (no draft: the
  speed-up denominator), chain / tree drafting with the EAGLE-3 head (with or without context
  branches), the head's own defaults (its decoding.json), and context branches alone (no head: a
  prompt-lookup decoder in the same loop);
- Hugging Face methods (``kind="hf"``): ``model.generate`` without speculation, with an assistant
  model (``assistant_model=``) and with prompt lookup (``prompt_lookup_num_tokens=``), observed by
  eagle_tree.bench.hf.

Each call's peak memory comes from eagle_tree.bench.memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from eagle_tree.bench.hf import hf_generate
from eagle_tree.bench.memory import PeakMemory
from eagle_tree.bench.timing import Timed, interleave, rotated
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.decoder import GenerateOutput, SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.models.target import TargetModel


@dataclass(frozen=True)
class Method:
    """One decoding method of a bench. eagle: ``tree`` None is plain decoding (``use_head=False``) or
    the head folder's default shapes (``use_head=True``); a tree with context and ``use_head=False``
    drafts with context branches alone; hf: plain ``generate``, with the assistant model
    (``assistant=True``) or with prompt lookup."""

    name: str
    kind: Literal["eagle", "hf"]
    tree: TreeConfig | None = None
    assistant: bool = False
    prompt_lookup_tokens: int | None = None
    use_head: bool | None = None  # None: a head when a tree is given

    @property
    def head(self) -> bool:
        return self.tree is not None if self.use_head is None else self.use_head

    @property
    def shape(self) -> str:
        if self.kind == "eagle":
            if self.tree is None:
                return "head defaults (decoding.json)" if self.head else "no draft"
            if not self.head or not self.tree.head:
                return "context only, " + self.tree.context.name
            return self.tree.name
        if self.assistant:
            return "assistant model"
        return f"prompt lookup, {self.prompt_lookup_tokens} tokens" if self.prompt_lookup_tokens else "no draft"


PLAIN = Method("plain", "eagle")
HF_GENERATE = Method("hf_generate", "hf")


def eagle_method(tree: TreeConfig) -> Method:
    return Method(tree.name, "eagle", tree=tree)


def context_only_method(tree: TreeConfig) -> Method:
    """Context branches without a head: a prompt-lookup decoder in eagle-tree's loop."""
    if tree.context is None:
        raise ValueError("a context-only method needs TreeConfig(context=ContextConfig(...))")
    only = TreeConfig.context_only(tree.context)
    return Method(f"context-only-{only.context.name}", "eagle", tree=only, use_head=False)


HEAD_DEFAULTS = Method("head_defaults", "eagle", use_head=True)


def head_defaults_shape(decoder: SpeculativeDecoder, sampling: SamplingConfig) -> str:
    """The shape column of method head_defaults: the shape the head folder's decoding.json gives this
    kind of decoding, "none, plain decoding" where its entry declines to speculate."""
    tree = decoder.shape_for(sampling)
    source = "decoding.json" if decoder.defaults else "no decoding.json, TreeConfig()"
    return f"head defaults ({source}): " + ("none, plain decoding" if tree is None else tree.name)


@dataclass
class BenchModels:
    """The models every method shares: one target object, its tokenizer, the head and the assistant."""

    target: TargetModel
    tokenizer: Any
    head: Any = None
    assistant: Any = None
    assistant_tokens: int | None = None
    _decoders: dict = field(default_factory=dict, init=False, repr=False)
    _assistant_generation_config: Any = field(default=None, init=False, repr=False)

    def decoder(self, tree: TreeConfig | None, use_head: bool | None = None) -> SpeculativeDecoder:
        """The decoder of a tree shape (None: plain; with ``use_head``: the head folder's defaults)."""
        use_head = tree is not None if use_head is None else use_head
        if use_head and self.head is None:
            raise ValueError("eagle-tree chain / tree methods need a draft head (head=PATH)")
        if (tree, use_head) not in self._decoders:
            self._decoders[tree, use_head] = SpeculativeDecoder(self.target, self.head if use_head else None, tree=tree)
        return self._decoders[tree, use_head]

    def run(self, method: Method, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
            seed: int, eos_token_id: int | None) -> GenerateOutput:
        if method.kind == "eagle":
            return self.decoder(method.tree, method.head).generate(input_ids, max_new_tokens, sampling=sampling,
                                                                   seed=seed, eos_token_id=eos_token_id)
        assistant = None
        if method.assistant:
            if self.assistant is None:
                raise ValueError(f"method {method.name} needs an assistant model (assistant=PATH)")
            assistant = self.assistant
            self._reset_assistant()
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return hf_generate(self.target.model, input_ids, max_new_tokens, sampling, seed=seed,
                           eos_token_id=eos_token_id, pad_token_id=pad, assistant=assistant,
                           prompt_lookup_tokens=method.prompt_lookup_tokens)

    def _reset_assistant(self) -> None:
        """Give every call the same starting draft settings: HF's "heuristic" schedule writes the draft
        length it adapted back into the assistant's generation config. With ``assistant_tokens`` set,
        the draft length is fixed (constant schedule, no confidence stop)."""
        import copy

        if self._assistant_generation_config is None:
            config = copy.deepcopy(self.assistant.generation_config)
            if self.assistant_tokens is not None:
                config.num_assistant_tokens = self.assistant_tokens
                config.num_assistant_tokens_schedule = "constant"
                config.assistant_confidence_threshold = 0.0
            self._assistant_generation_config = config
        self.assistant.generation_config = copy.deepcopy(self._assistant_generation_config)


# ---------------------------------------------------------------------------------- scheduling


@dataclass
class Resume:
    """Journalling of a phase (eagle_tree.bench.journal): finished blocks of an earlier run of the same
    phase are read back instead of run, each new block is appended, and ``stop()`` (asked between blocks)
    ends the phase early with eagle_tree.bench.timing.Stopped. ``identity``: what else decides the
    figures (weights, threads, device, dtype), hashed into the phase's key."""

    journal: Any
    identity: dict
    sitting: int = 0
    stop: Callable[[], bool] | None = None
    resumed: int = 0  # set by run_phase: blocks read back
    earlier_sittings: set = field(default_factory=set)  # the sittings those blocks came from


def method_identity(method: Method, models: BenchModels) -> list:
    """What a method is, for a journal key (the head's default shapes for head_defaults: a None entry,
    plain decoding, reads differently from every drafted shape and from no entry)."""
    defaults = repr(models.decoder(None, True).defaults) if method.kind == "eagle" and method.tree is None \
        and method.head else None
    return [method.name, method.kind, method.shape, repr(method.tree), method.assistant, method.prompt_lookup_tokens,
            defaults]


@dataclass
class PhaseResult:
    """Outputs of one phase (tuning or test): ``outputs[name][repeat][prompt]``."""

    phase: str
    methods: list[Method]
    outputs: dict[str, list[list[GenerateOutput]]]
    peak_bytes: dict[str, int]
    schedule: list[dict]
    memory_method: str


def run_phase(
    phase: str,
    methods: Sequence[Method],
    models: BenchModels,
    prompts: Sequence[torch.Tensor],
    repeats: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int = 0,
    eos_token_id: int | None = None,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
    resume: Resume | None = None,
) -> PhaseResult:
    """Warm every method up on the first ``warmup`` prompts (not recorded), then run the interleaved
    schedule. The seed of prompt p is ``seed + p`` in every method and repeat. With ``resume``, blocks
    journalled by an earlier run of the same phase are read back, not run (:class:`Resume`)."""
    if len({m.name for m in methods}) != len(methods):
        raise ValueError(f"method names must be unique, got {[m.name for m in methods]}")
    device, n = models.target.device, len(prompts)
    total = repeats * n * len(methods)

    def method_call(method: Method) -> Callable[[int], GenerateOutput]:
        def call(block: int) -> GenerateOutput:  # block = repeat * n + prompt
            p = block % n
            return models.run(method, prompts[p], max_new_tokens, sampling, seed + p, eos_token_id)
        return call

    order: list[Timed[GenerateOutput]] = []

    def record(t: Timed[GenerateOutput]) -> None:
        order.append(t)
        if log is not None:
            log(f"[{phase} {len(order)}/{total}] repeat {t.block // n} prompt {t.block % n} {t.method}: "
                f"{t.value.new_tokens} tokens in {t.value.total_s:.3f} s")

    journal = {}
    if resume is not None:
        import hashlib

        from eagle_tree.bench.journal import phase_key

        digest = hashlib.sha256()
        for p in prompts:
            digest.update(p.detach().cpu().numpy().tobytes() + b"|")
        key = phase_key(phase=phase, methods=[method_identity(m, models) for m in methods],
                        prompts=digest.hexdigest(), repeats=repeats, max_new_tokens=max_new_tokens,
                        sampling=repr(sampling), seed=seed, eos=eos_token_id, identity=resume.identity)
        done, sittings = resume.journal.load(key, prompts, [m.name for m in methods])
        done = {b: calls for b, calls in done.items() if b < repeats * n}
        resume.resumed = len(done)
        resume.earlier_sittings |= sittings if done else set()
        journal = dict(done=done, stop=resume.stop,
                       on_block=lambda b, calls: resume.journal.append(key, b, calls, resume.sitting))
        if done:
            print(f"{phase}: {len(done)} of {repeats * n} blocks read back from {resume.journal.path}")
    runs = interleave({m.name: method_call(m) for m in methods}, repeats * n, warmup=range(min(warmup, n)),
                      device=device, memory=True, log=record, **journal)
    outputs = {name: [[t.value for t in calls[r * n:(r + 1) * n]] for r in range(repeats)]
               for name, calls in runs.items()}
    peaks = {name: max((t.peak_bytes for t in calls), default=0) for name, calls in runs.items()}
    ran: dict[int, list[str]] = {}
    for t in order:  # the order the calls ran in; blocks read back from a journal ran in their rotation
        ran.setdefault(t.block, []).append(t.method)
    resumed = set(journal.get("done", ()))
    names = [m.name for m in methods]
    schedule = [{"phase": phase, "repeat": b // n, "prompt": b % n, "method": name} | ({"resumed": True} if b in
                resumed else {}) for b in range(repeats * n) for name in (rotated(names, b) if b in resumed
                                                                         else ran.get(b, []))]
    memory_method = PeakMemory(device).method
    return PhaseResult(phase, list(methods), outputs, peaks, schedule, memory_method)


def load_bench_models(target: str, head: str | None, methods, dtype: str, device: str = "cpu",
                      assistant: str | None = None, assistant_tokens: int | None = None,
                      prepack: bool = False, head_int8: bool = False) -> BenchModels:
    """BenchModels: the target and head through the decoders' loader (``load_decoder``), plus the
    assistant model when ``methods`` hold hf_assisted; moved to ``device``."""
    from eagle_tree.decoding.loading import load_decoder
    from eagle_tree.utils.checks import InputError, check_finite_weights, check_target_path

    wants_head = any(m in methods for m in ("chain", "tree", "head_defaults"))
    if wants_head and head is None:
        raise InputError("methods chain / tree need a draft head: set head=PATH or drop them from `methods`")
    if "hf_assisted" in methods:
        if assistant is None:
            raise InputError("method hf_assisted needs an assistant model: set assistant=PATH or drop it")
        check_target_path(assistant, "assistant")
    head = head if wants_head else None
    decoder, tokenizer = load_decoder(target, head, "tree" if head else "plain", dtype, TreeConfig(), prepack=prepack,
                                      head_int8=head_int8)
    model, draft = decoder.target, decoder.draft
    helper = None
    if "hf_assisted" in methods:
        from transformers import AutoModelForCausalLM

        helper = AutoModelForCausalLM.from_pretrained(assistant, dtype=getattr(torch, dtype)).eval()
        check_finite_weights(helper, f"the assistant model in {assistant}")
    if device != "cpu":
        model.model.to(device)
        for module in (draft, helper):
            if module is not None:
                module.to(device)
    return BenchModels(model, tokenizer, head=draft, assistant=helper, assistant_tokens=assistant_tokens)
