"""Side-by-side measurement of decoding methods on one target (MEASURING.md).

Every method is run on the same target object, tokenised prompts, sampling settings, seeds and
output budget, in an interleaved order (:func:`interleaved_schedule`), and every call returns a
:class:`~eagle_tree.decoding.decoder.GenerateOutput`, so one summary function serves them all:

- eagle-tree methods (``kind="eagle"``): plain decoding in eagle-tree's own loop (no draft: the
  speed-up denominator) and chain / tree drafting with the EAGLE-3 head;
- Hugging Face methods (``kind="hf"``): ``model.generate`` without speculation, with an assistant
  model (``assistant_model=``) and with prompt lookup (``prompt_lookup_num_tokens=``).

Hugging Face calls are observed from outside (:class:`HFRecorder`): a streamer timestamps each
``put()`` (the first is the prompt, each later one holds the tokens one target forward committed),
and forward hooks on the target and the assistant time their forwards and read the number of tokens
each target forward verified. The first target forward is the prefill (for assisted generation and
prompt lookup it also verifies a first draft); as in eagle-tree's loop its tokens count as output
and set the time to first token, but it is not a round. Each later forward is a round: committed =
tokens streamed, accepted = committed - 1, tree_size = draft tokens verified, verify_s = the target
forward, draft_s = assistant forwards, other_s = the rest of the time between two puts.

Peak memory (:class:`PeakMemory`) is the peak above the level at the start of a call: CUDA's
``max_memory_allocated`` on a GPU; on Linux CPU the peak resident set size (``VmHWM``, reset through
``/proc/self/clear_refs`` before each call); elsewhere the growth of ``ru_maxrss`` (which cannot be
reset, so later calls often read 0).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers.generation.streamers import BaseStreamer

from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.decoder import GenerateOutput, RoundStats, SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.metrics import per_position_acceptance, summarize
from eagle_tree.decoding.shapes import ShapeMeasurement, shape_name
from eagle_tree.models.target import TargetModel

# ------------------------------------------------------------------------------------- memory


class PeakMemory:
    """``with PeakMemory(device) as mem: ...`` then ``mem.peak_bytes``: the peak above the start."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.method = _memory_method(self.device)
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.method == "cuda_max_memory_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self.method == "linux_vmhwm":
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self._start = _proc_status_bytes("VmRSS")
        else:
            self._start = _ru_maxrss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "cuda_max_memory_allocated":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "linux_vmhwm":
            peak = _proc_status_bytes("VmHWM")
        else:
            peak = _ru_maxrss_bytes()
        self.peak_bytes = max(0, peak - self._start)


def _memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda_max_memory_allocated"
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _proc_status_bytes("VmHWM")
        return "linux_vmhwm"
    except (OSError, KeyError):
        return "ru_maxrss"


def _proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(key)


def _ru_maxrss_bytes() -> int:
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# ------------------------------------------------------------------------ Hugging Face generate


class _ForwardClock:
    """Forward hooks on one module: seconds spent in its forwards, and the last input length."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.elapsed = 0.0
        self.last_input_len = 0
        self._t0 = 0.0
        self._handles: list = []

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.last_input_len = int(ids.shape[-1]) if ids is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        self.elapsed += time.perf_counter() - self._t0

    def attach(self) -> None:
        self._handles = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.module.register_forward_hook(self._post, with_kwargs=True)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> float:
        elapsed, self.elapsed = self.elapsed, 0.0
        return elapsed


class HFRecorder(BaseStreamer):
    """A streamer (pass as ``streamer=``) that turns one ``generate`` call into a GenerateOutput.

    Use as a context manager around the call: it attaches the forward hooks and starts the clock.
    """

    def __init__(self, target: torch.nn.Module, assistant: torch.nn.Module | None = None):
        if assistant is target:
            raise ValueError("the assistant must be a separate model object (load it a second time)")
        self.target = _ForwardClock(target)
        self.assistant = _ForwardClock(assistant) if assistant is not None else None
        self.start = 0.0
        self.prompt_seen = False
        self.last_put = 0.0
        self.prefill_s: float | None = None
        self.rounds: list[RoundStats] = []
        self.token_times: list[float] = []
        self.tokens: list[int] = []

    def __enter__(self) -> HFRecorder:
        for clock in (self.target, self.assistant):
            if clock is not None:
                clock.attach()
        self.start = self.last_put = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        for clock in (self.target, self.assistant):
            if clock is not None:
                clock.detach()

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.prompt_seen:  # generate streams the prompt first
            self.prompt_seen = True
            return
        new = value.reshape(-1).tolist()
        verify_s = self.target.take()
        draft_s = self.assistant.take() if self.assistant is not None else 0.0
        if self.prefill_s is None:
            self.prefill_s = now - self.start
        else:
            round_s = now - self.last_put
            other_s = max(round_s - verify_s - draft_s, 0.0)
            tree_size = max(self.target.last_input_len - 1, 0)
            self.rounds.append(RoundStats(len(new) - 1, len(new), tree_size, draft_s, verify_s, other_s))
        self.last_put = now
        self.tokens += new
        self.token_times += [now - self.start] * len(new)

    def end(self) -> None:
        pass

    def output(self, input_ids: torch.Tensor, eos: set[int], total_s: float) -> GenerateOutput:
        sequences = torch.cat([input_ids.cpu(), torch.tensor([self.tokens], dtype=torch.long)], dim=1)
        out = GenerateOutput(sequences, input_ids.shape[1], rounds=self.rounds, prefill_s=self.prefill_s or 0.0,
                             total_s=total_s, token_times=self.token_times)
        out.stopped_by = "eos" if self.tokens and self.tokens[-1] in eos else "length"
        return out


def hf_generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    assistant=None,
    prompt_lookup_tokens: int | None = None,
) -> GenerateOutput:
    """One Hugging Face ``generate`` call (batch 1), observed by an :class:`HFRecorder`.

    Every sampling field is passed explicitly (and ``eos_token_id=None`` disables EOS), so the
    model's own generation config cannot change the settings; ``seed`` seeds the global RNG. The
    assistant drafts by its own ``generation_config`` (draft length, schedule, confidence stop), which
    HF's "heuristic" schedule updates in place after each call (BenchModels restores it per call).
    """
    input_ids = input_ids.to(model.device)
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, num_beams=1,
                                  pad_token_id=pad_token_id if pad_token_id is not None else eos_token_id)
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
    torch.manual_seed(seed)
    recorder = HFRecorder(model, assistant)
    with recorder:
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=recorder, **kwargs)
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)
        total_s = time.perf_counter() - recorder.start
    return recorder.output(input_ids, {eos_token_id} if eos_token_id is not None else set(), total_s)


# ------------------------------------------------------------------------------------ methods


@dataclass(frozen=True)
class Method:
    """One decoding method of a bench. eagle: ``tree`` None is plain decoding; hf: plain
    ``generate``, with the assistant model (``assistant=True``) or with prompt lookup."""

    name: str
    kind: Literal["eagle", "hf"]
    tree: TreeConfig | None = None
    assistant: bool = False
    prompt_lookup_tokens: int | None = None

    @property
    def shape(self) -> str:
        if self.kind == "eagle":
            return "no draft" if self.tree is None else shape_name(self.tree)
        if self.assistant:
            return "assistant model"
        return f"prompt lookup, {self.prompt_lookup_tokens} tokens" if self.prompt_lookup_tokens else "no draft"


PLAIN = Method("plain", "eagle")
HF_GENERATE = Method("hf_generate", "hf")


def eagle_method(tree: TreeConfig) -> Method:
    return Method(shape_name(tree), "eagle", tree=tree)


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

    def decoder(self, tree: TreeConfig | None) -> SpeculativeDecoder:
        if tree is not None and self.head is None:
            raise ValueError("eagle-tree chain / tree methods need a draft head (head=PATH)")
        if tree not in self._decoders:
            self._decoders[tree] = SpeculativeDecoder(self.target, self.head if tree is not None else None, tree=tree)
        return self._decoders[tree]

    def run(self, method: Method, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
            seed: int, eos_token_id: int | None) -> GenerateOutput:
        if method.kind == "eagle":
            return self.decoder(method.tree).generate(input_ids, max_new_tokens, sampling=sampling, seed=seed,
                                                      eos_token_id=eos_token_id)
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


def interleaved_schedule(n_methods: int, n_prompts: int, repeats: int) -> list[tuple[int, int, int]]:
    """(repeat, prompt, method) calls: for each repeat, for each prompt, every method once, in an
    order rotated by one place per (repeat, prompt) block so no method always runs first or last."""
    calls = []
    for r in range(repeats):
        for p in range(n_prompts):
            shift = (r * n_prompts + p) % max(n_methods, 1)
            calls += [(r, p, (shift + j) % n_methods) for j in range(n_methods)]
    return calls


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
) -> PhaseResult:
    """Warm every method up on the first ``warmup`` prompts (not recorded), then run the interleaved
    schedule. The seed of prompt p is ``seed + p`` in every method and repeat."""
    if len({m.name for m in methods}) != len(methods):
        raise ValueError(f"method names must be unique, got {[m.name for m in methods]}")
    device = models.target.device
    for p in range(min(warmup, len(prompts))):
        for method in methods:
            models.run(method, prompts[p], max_new_tokens, sampling, seed + p, eos_token_id)
    outputs = {m.name: [[None] * len(prompts) for _ in range(repeats)] for m in methods}
    peaks = dict.fromkeys(outputs, 0)
    schedule, memory_method = [], PeakMemory(device).method
    calls = interleaved_schedule(len(methods), len(prompts), repeats)
    for i, (r, p, m) in enumerate(calls):
        method = methods[m]
        with PeakMemory(device) as mem:
            out = models.run(method, prompts[p], max_new_tokens, sampling, seed + p, eos_token_id)
        outputs[method.name][r][p] = out
        peaks[method.name] = max(peaks[method.name], mem.peak_bytes)
        schedule.append({"phase": phase, "repeat": r, "prompt": p, "method": method.name})
        if log is not None:
            log(f"[{phase} {i + 1}/{len(calls)}] repeat {r} prompt {p} {method.name}: {out.new_tokens} tokens "
                f"in {out.total_s:.3f} s")
    return PhaseResult(phase, list(methods), outputs, peaks, schedule, memory_method)


# ---------------------------------------------------------------------------------- aggregation


def survival_depth(method: Method, outputs: Sequence[GenerateOutput]) -> int:
    """Depth of the survival curve: the tree depth (eagle) or the longest draft verified (hf)."""
    if method.kind == "eagle":
        return 0 if method.tree is None else method.tree.depth
    return max((r.tree_size for o in outputs for r in o.rounds), default=0)


def shape_measurements(result: PhaseResult) -> list[ShapeMeasurement]:
    """Per-round means C (seconds) and K (committed tokens) of every eagle shape of a phase."""
    measured = []
    for method in result.methods:
        if method.kind != "eagle" or method.tree is None:
            continue
        rounds = [r for rep in result.outputs[method.name] for o in rep for r in o.rounds]
        if not rounds:
            raise ValueError(f"{method.name} ran no speculative round; raise max_new_tokens")
        c = sum(r.total_s for r in rounds) / len(rounds)
        k = sum(r.committed for r in rounds) / len(rounds)
        measured.append(ShapeMeasurement(method.tree, c, k, len(rounds)))
    return measured


def _tpot(outputs: Sequence[GenerateOutput]) -> float:
    return sum(o.total_s for o in outputs) / max(sum(o.new_tokens for o in outputs), 1)


def method_rows(result: PhaseResult, sampling: SamplingConfig, plain: str = PLAIN.name,
                hf_plain: str = HF_GENERATE.name) -> list[dict]:
    """One dict per method: the DecodeSummary fields (pooled over repeats and prompts) with
    ``time_per_output_token_s`` the median over repeats of each repeat's cumulative time / tokens,
    plus the speed-ups (medians over repeats of the per-repeat ratio), per-position acceptance,
    peak memory, and, under greedy decoding, whether every output equals plain decoding's."""
    rows = []
    ref = result.outputs.get(plain)
    for method in result.methods:
        runs = result.outputs[method.name]
        flat = [o for rep in runs for o in rep]
        row = summarize(method.name, sampling.temperature, flat, depth=survival_depth(method, flat)).to_dict()
        per_repeat = [_tpot(rep) for rep in runs]
        row["time_per_output_token_s"] = statistics.median(per_repeat)
        row["time_per_output_token_s_repeats"] = per_repeat
        for key, base in (("speedup_vs_plain", plain), ("speedup_vs_hf_generate", hf_plain)):
            base_runs = result.outputs.get(base)
            row[key] = (statistics.median(_tpot(b) / _tpot(m) for b, m in zip(base_runs, runs, strict=True))
                        if base_runs is not None else None)
        row["per_position_acceptance"] = per_position_acceptance(row["survival"])
        row["peak_memory_mb"] = result.peak_bytes[method.name] / 2**20
        row.update(kind=method.kind, shape=method.shape, tree=_tree_dict(method.tree))
        if method.kind == "hf":
            row["time_split_source"] = "forward hooks (verify: target forwards, draft: assistant forwards)"
        mismatched, lengths = [], []
        if ref is not None:
            for r, rep in enumerate(runs):
                for p, out in enumerate(rep):
                    plain_out = ref[r][p]
                    if not torch.equal(out.sequences.cpu(), plain_out.sequences.cpu()):
                        mismatched.append({"repeat": r, "prompt": p})
                    if out.new_tokens != plain_out.new_tokens:
                        lengths.append({"repeat": r, "prompt": p, "tokens": out.new_tokens,
                                        "plain_tokens": plain_out.new_tokens, "stopped_by": out.stopped_by})
        greedy = sampling.greedy and ref is not None
        row["outputs_match_plain"] = (not mismatched) if greedy else None
        row["output_mismatches"] = mismatched if greedy else []
        row["length_differences"] = lengths
        rows.append(row)
    return rows


def _tree_dict(tree: TreeConfig | None) -> dict | None:
    if tree is None:
        return None
    return {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens, "sampled": tree.sampled}


# ----------------------------------------------------------------------------------- conditions


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def n_params(module) -> int | None:
    return None if module is None else sum(p.numel() for p in module.parameters())


def conditions(models: BenchModels, dtype: str) -> dict:
    """The machine, library versions, threads, precision and model sizes of a bench run."""
    import transformers

    target = models.target
    device = target.device
    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": str(device),
        "dtype": dtype,
        "attention": getattr(target.config, "_attn_implementation", None),
        "target": {"parameters": n_params(target.model), "layers": target.num_layers,
                   "hidden_size": target.hidden_size, "vocab_size": target.vocab_size},
        "head": None if models.head is None else {"parameters": n_params(models.head),
                                                  "feature_layers": list(models.head.config.feature_layers)},
        "assistant": None if models.assistant is None else {
            "parameters": n_params(models.assistant), "layers": models.assistant.config.num_hidden_layers},
        "memory_method": PeakMemory(device).method,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
