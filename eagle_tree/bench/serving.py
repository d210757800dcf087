"""The serving sweep (``eagle-tree bench serving``): batched and continuous-load decoding, measured.

Every method decodes a batch of requests through one call that returns a
:class:`~eagle_tree.decoding.rounds.BatchOutput` (per-request token times): eagle-tree's
``SpeculativeDecoder.generate_batch`` (plain decoding, draft=None, and the head's chain and tree
shapes) and Hugging Face's batched ``generate`` over left-padded prompts (eagle_tree.bench.hf). The
continuous-load mode drives ``SpeculativeDecoder.serve`` with Poisson arrivals.

The pieces, each usable alone:

- shapes and methods by name: ``none`` (plain), ``chain-4``, ``tree-d4k4n16`` (``-sampled``, ``+ctx8``
  as ``TreeConfig.name`` spells them), ``hf_generate``, ``tuned``;
- :func:`context_prompts`: requests of an exact prompt length built from a prompt file;
- :func:`batch_figures`: the per-cell figures (throughput, TTFT, latency, TPOT, gaps, acceptance);
- :func:`pick_tuned` and :func:`crossover_batch_size`: the tuned shape per batch size and where it
  becomes plain decoding;
- :func:`tune`, :func:`run_cells` and :func:`run_load`: the three phases of the sweep.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from eagle_tree.bench.hf import hf_generate_batch
from eagle_tree.bench.runner import BenchModels
from eagle_tree.bench.timing import interleave, rotated, rotation
from eagle_tree.bench.tuning import NONE, crossover_batch_size, pick_tuned
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.metrics import quantile
from eagle_tree.decoding.rounds import BatchOutput, Request

TUNED = "tuned"
"""The method that runs, per context and batch size, the shape the tuning pass picked."""
HF_GENERATE = "hf_generate"
PLAIN = "plain"

def parse_shape(name: str) -> TreeConfig | None:
    """The draft shape a name stands for: ``none`` -> None (plain decoding), else
    ``TreeConfig.from_name`` (``chain-4``, ``tree-d4k4n16``, ``-sampled``, ``+ctx8x2-g2to4``, ...)."""
    return None if name == NONE else TreeConfig.from_name(name)


@dataclass(frozen=True)
class ServingMethod:
    """One method of the sweep: eagle-tree's batched loop with a draft shape (``tree`` None: plain
    decoding) or Hugging Face's batched ``generate``."""

    name: str
    kind: Literal["eagle", "hf"]
    tree: TreeConfig | None = None

    @property
    def shape(self) -> str:
        if self.kind == "hf":
            return "hf generate (no draft)"
        return NONE if self.tree is None else self.tree.name


def shape_method(shape: str) -> ServingMethod:
    """The eagle-tree method of a shape name (``none``: the method ``plain``)."""
    tree = parse_shape(shape)
    return ServingMethod(PLAIN if tree is None else shape, "eagle", tree)


def parse_method(name: str) -> ServingMethod | None:
    """``plain``, ``hf_generate`` or a shape name as a method; ``tuned`` -> None (resolved per batch size)."""
    if name == TUNED:
        return None
    if name == HF_GENERATE:
        return ServingMethod(HF_GENERATE, "hf")
    if name == PLAIN:
        return shape_method(NONE)
    try:
        return shape_method(name)
    except ValueError as exc:
        raise ValueError(f"unknown method {name!r}: expected plain, hf_generate, tuned or a draft shape ({exc})") \
            from None


# ---------------------------------------------------------------------------------- prompts


def context_prompts(tokenizer, texts: Sequence[str], n: int, length: int, vocab_size: int | None = None,
                    separator: str = "\n\n") -> list[torch.Tensor]:
    """``n`` prompts of exactly ``length`` tokens (1-D) from the prompt texts of a file.

    Prompt i starts with text ``i mod len(texts)``; the texts that follow it in file order (wrapping
    around to the first) are appended, joined by ``separator``, until the tokenized text holds at
    least ``length`` tokens, which is then cut to its first ``length`` tokens. So every prompt begins
    where a prompt of the file begins, consecutive prompts differ, and the target continues the text
    at the cut. The text is tokenized as a whole (``tokenizer.encode``, special tokens as the
    tokenizer adds them).
    """
    if not texts:
        raise ValueError("context_prompts needs at least one prompt text")
    if length < 1 or n < 0:
        raise ValueError(f"need length >= 1 and n >= 0, got length={length}, n={n}")
    prompts = []
    for i in range(n):
        parts, ids, start, after_cycle = [], [], i % len(texts), -1
        while len(ids) < length:
            if parts and len(parts) % len(texts) == 0:  # one more pass over every text
                if len(ids) <= after_cycle:
                    raise ValueError("the prompt texts add no tokens: they cannot fill a prompt")
                after_cycle = len(ids)
            parts.append(texts[(start + len(parts)) % len(texts)])
            ids = list(tokenizer.encode(separator.join(parts), verbose=False))  # no "longer than the model" warning
        ids = ids[:length]
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"the tokenizer gives ids outside the target's vocabulary of {vocab_size}: "
                             "it does not match the target model")
        prompts.append(torch.tensor(ids, dtype=torch.long))
    return prompts


def output_budgets(contexts: Iterable[int], budgets: Iterable[int], positions: int | None) -> dict[int, list[dict]]:
    """Per context length, its output budgets, each capped so that prompt + output fits the target's
    ``positions`` (None: no limit); budgets that cap to the same value are run once. Each entry:
    ``{"budget": run, "asked": [configured budgets it stands for], "capped": bool}``."""
    out = {}
    for context in contexts:
        room = None if positions is None else positions - context
        if room is not None and room < 1:
            raise ValueError(f"a {context}-token context leaves no position for output: the target has {positions}")
        entries: dict[int, dict] = {}
        for asked in budgets:
            run = asked if room is None else min(asked, room)
            entry = entries.setdefault(run, {"budget": run, "asked": [], "capped": False})
            entry["asked"].append(asked)
            entry["capped"] = entry["capped"] or run != asked
        out[context] = list(entries.values())
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds after the start) of ``n`` requests of a Poisson process of ``rate``
    requests per second: cumulative exponential gaps from ``random.Random(seed)``, the first gap
    included (the first request does not arrive at 0)."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"an arrival rate must be a positive number of requests per second, got {rate!r}")
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


# ---------------------------------------------------------------------------------- figures


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def batch_figures(outputs: Sequence[BatchOutput]) -> dict[str, Any]:
    """The figures of a cell over its calls (repeats): throughput = all new tokens / all calls' wall
    time; means, p50 / p95 over requests (latency) or over every gap between a request's consecutive
    tokens; TPOT over requests with at least two tokens; acceptance length = tokens committed per
    round, pooled over every request's rounds; queue = admitted - arrival."""
    results = [r for o in outputs for r in o.results]
    tokens = sum(r.new_tokens for r in results)
    total = sum(o.total_s for o in outputs)
    gaps = [g for r in results for g in r.gaps]
    latencies = [r.latency_s for r in results]
    rounds = [n for r in results for n in r.acceptance_lengths]
    return {
        "calls": len(outputs),
        "requests": len(results),
        "new_tokens": tokens,
        "total_s": total,
        "throughput_tok_s": tokens / total if total > 0 else None,
        "ttft_mean_s": _mean([r.ttft_s for r in results]),
        "latency_mean_s": _mean(latencies),
        "latency_p50_s": quantile(latencies, 0.5),
        "latency_p95_s": quantile(latencies, 0.95),
        "tpot_mean_s": _mean([r.tpot_s for r in results if r.new_tokens > 1]),
        "gap_p50_s": quantile(gaps, 0.5),
        "gap_p95_s": quantile(gaps, 0.95),
        "acceptance_length": sum(rounds) / len(rounds) if rounds else None,
        "queue_mean_s": _mean([r.admitted_s - r.arrival_s for r in results]),
        "eos_stops": sum(r.stopped_by == "eos" for r in results),
        "cache_peak_mb": max((o.peak_cache_bytes for o in outputs), default=0) / 2**20 or None,
    }


# ---------------------------------------------------------------------------------- running


def run_batch(models: BenchModels, method: ServingMethod, prompts: Sequence[torch.Tensor], max_new_tokens: int,
              sampling: SamplingConfig, seed: int, eos_token_id: int | None) -> BatchOutput:
    """One batch of ``prompts`` (all starting together) by ``method``."""
    if method.kind == "hf":
        pad = getattr(models.tokenizer, "pad_token_id", None)
        return hf_generate_batch(models.target.model, list(prompts), max_new_tokens, sampling, seed=seed,
                                 eos_token_id=eos_token_id, pad_token_id=pad)
    decoder = models.decoder(method.tree)
    return decoder.generate_batch(list(prompts), max_new_tokens, sampling=sampling, seed=seed,
                                  eos_token_id=eos_token_id)


def run_serve(models: BenchModels, method: ServingMethod, requests: Sequence[Request], max_batch: int,
              sampling: SamplingConfig, seed: int, eos_token_id: int | None) -> BatchOutput:
    """A request stream through eagle-tree's continuous batching (``SpeculativeDecoder.serve``)."""
    if method.kind != "eagle":
        raise ValueError(f"{method.name}: only eagle-tree methods serve a request stream")
    return models.decoder(method.tree).serve(list(requests), max_batch=max_batch, sampling=sampling, seed=seed,
                                             eos_token_id=eos_token_id)


@dataclass
class Sweep:
    """What every phase shares: the models, sampling, seed, EOS, repeats, warm-up budget and a progress
    callback (called with a short description once per batch size of a phase and per load run)."""

    models: BenchModels
    sampling: SamplingConfig
    seed: int = 0
    eos_token_id: int | None = None
    repeats: int = 1
    warmup_tokens: int = 0
    progress: Callable[[str], None] | None = None

    def _tick(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what)

    def _warm(self, method: ServingMethod, prompts: Sequence[torch.Tensor]) -> None:
        if self.warmup_tokens:
            run_batch(self.models, method, prompts, self.warmup_tokens, self.sampling, self.seed, self.eos_token_id)

    def _batch_call(self, method: ServingMethod, prompts: Sequence[torch.Tensor], batch: int,
                    max_new_tokens: int) -> Callable[[int], BatchOutput]:
        """Repeat r of a cell: prompts r*B .. r*B + B - 1, seed ``seed + r``."""
        return lambda r: run_batch(self.models, method, prompts[r * batch:(r + 1) * batch], max_new_tokens,
                                   self.sampling, self.seed + r, self.eos_token_id)

    def _serve_call(self, method: ServingMethod, requests: Sequence[Request], max_batch: int
                    ) -> Callable[[int], BatchOutput]:
        return lambda _: run_serve(self.models, method, requests, max_batch, self.sampling, self.seed,
                                   self.eos_token_id)

    def tune(self, candidates: Sequence[str], prompts: Sequence[torch.Tensor], batch_sizes: Sequence[int],
             max_new_tokens: int, tuning_repeats: int = 1) -> dict:
        """Per batch size B, every candidate shape decodes batches of B tuning prompts (pass r takes
        prompts r*B .. r*B + B - 1), in an order rotated by one place per batch size; the shape with
        the highest throughput (new tokens / wall time, over the passes) is picked. Returns
        ``{"throughput": {B: {shape: tok/s}}, "tuned": {B: shape}, "crossover_batch_size": B or None}``."""
        methods = [shape_method(c) for c in candidates]
        throughput, tuned = {}, {}
        for b_index, batch in enumerate(batch_sizes):
            _check_pool(prompts, batch * tuning_repeats, "tuning")
            for i in rotation(len(methods), b_index):
                self._warm(methods[i], prompts[:batch])
            runs = interleave({c: self._batch_call(m, prompts, batch, max_new_tokens)
                               for c, m in zip(candidates, methods, strict=True)},
                              tuning_repeats, offset=b_index, device=self.models.target.device)
            outputs = {c: [t.value for t in calls] for c, calls in runs.items()}
            throughput[batch] = {c: batch_figures(outputs[c])["throughput_tok_s"] or 0.0 for c in candidates}
            tuned[batch] = pick_tuned(throughput[batch])
            self._tick(f"tuning batch {batch}: {tuned[batch]}")
        return {"throughput": throughput, "tuned": tuned, "crossover_batch_size": crossover_batch_size(tuned)}

    def cells(self, methods: Sequence[str], prompts: Sequence[torch.Tensor], batch_sizes: Sequence[int],
              max_new_tokens: int, tuned: Mapping[int, str] | None = None, compare_to: str = PLAIN,
              warmup: bool = True) -> list[dict]:
        """One row per (batch size, method) at one context and output budget. Repeat r decodes prompts
        r*B .. r*B + B - 1 with seed ``seed + r`` in every method; methods run interleaved (the order
        rotated per batch size and repeat), each warmed up first (unrecorded; ``warmup=False``: not, e.g.
        when an earlier call warmed the same batch sizes at another output budget). ``tuned`` resolves the
        method ``tuned`` per batch size; when its shape is already a method of the cell, that method's
        row is reused (``reused_from``). Greedy rows say whether every request's output equals
        ``compare_to``'s."""
        rows = []
        fixed = {name: parse_method(name) for name in methods if name != TUNED}
        for b_index, batch in enumerate(batch_sizes):
            _check_pool(prompts, batch * self.repeats, "test")
            cell = dict(fixed)
            reuse = None
            if TUNED in methods:
                if tuned is None or batch not in tuned:
                    raise ValueError(f"method tuned needs a tuned shape for batch size {batch}")
                method = shape_method(tuned[batch])
                reuse = next((n for n, m in fixed.items() if m.kind == "eagle" and m.tree == method.tree), None)
                if reuse is None:
                    cell[TUNED] = method
            if warmup:
                for name in rotated(list(cell), b_index):
                    self._warm(cell[name], prompts[:batch])
            runs = interleave({name: self._batch_call(method, prompts, batch, max_new_tokens)
                               for name, method in cell.items()},
                              self.repeats, offset=b_index, device=self.models.target.device, memory=True)
            outputs = {name: [t.value for t in calls] for name, calls in runs.items()}
            peaks = {name: max(t.peak_bytes for t in calls) if calls else 0 for name, calls in runs.items()}
            by_name = {}
            for name, method in cell.items():
                row = {"batch_size": batch, "method": name, "kind": method.kind, "shape": method.shape,
                       "reused_from": None, "peak_memory_mb": peaks[name] / 2**20}
                row.update(batch_figures(outputs[name]))
                row.update(_match(outputs[name], outputs.get(compare_to), self.sampling))
                by_name[name] = row
            if reuse is not None:
                by_name[TUNED] = by_name[reuse] | {"method": TUNED, "reused_from": reuse}
            for name in methods:
                row = by_name[name]
                for key, base in (("throughput_vs_plain", PLAIN), ("throughput_vs_hf", HF_GENERATE)):
                    ref = by_name.get(base)
                    ok = ref is not None and ref["throughput_tok_s"] and row["throughput_tok_s"] is not None
                    row[key] = row["throughput_tok_s"] / ref["throughput_tok_s"] if ok else None
                rows.append(row)
            self._tick(f"batch {batch}, {max_new_tokens} tokens")
        return rows

    def load(self, methods: Sequence[str], prompts: Sequence[torch.Tensor], rates: Sequence[float],
             max_new_tokens: int, max_batch: int, tuned_shape: str | None = None) -> list[dict]:
        """One row per (arrival rate, method), in the order of ``methods``: ``len(prompts)`` requests with
        Poisson arrival times (seed ``seed``; the same times for every method at a rate) served by
        continuous batching with at most ``max_batch`` requests, the methods run in an order rotated per
        rate. hf_generate is skipped (it has no continuous batching); ``tuned`` runs ``tuned_shape``, or
        reuses the row of the method that has that shape."""
        rows = []
        fixed = {name: parse_method(name) for name in methods if name not in (TUNED, HF_GENERATE)}
        run, reuse = dict(fixed), None
        if TUNED in methods:
            if tuned_shape is None:
                raise ValueError("method tuned needs the tuned shape of the load's batch size")
            tuned = shape_method(tuned_shape)
            reuse = next((n for n, m in fixed.items() if m.tree == tuned.tree), None)
            if reuse is None:
                run[TUNED] = tuned
        for i, rate in enumerate(rates):
            arrivals = poisson_arrivals(len(prompts), rate, self.seed)
            requests = [Request(p, max_new_tokens, t) for p, t in zip(prompts, arrivals, strict=True)]
            span = arrivals[-1] if arrivals else 0.0
            runs = interleave({name: self._serve_call(method, requests, max_batch) for name, method in run.items()},
                              1, offset=i, device=self.models.target.device, memory=True,
                              log=lambda t, rate=rate: self._tick(f"load {rate}/s {t.method}"))
            by_name = {}
            for name, method in run.items():
                (t,) = runs[name]
                by_name[name] = {"rate_rps": rate, "method": name, "shape": method.shape, "max_batch": max_batch,
                                 "reused_from": None, "offered_rps": len(requests) / span if span > 0 else None,
                                 "peak_memory_mb": t.peak_bytes / 2**20} | batch_figures([t.value])
            if reuse is not None:
                by_name[TUNED] = by_name[reuse] | {"method": TUNED, "reused_from": reuse}
                self._tick(f"load {rate}/s tuned (= {reuse})")
            rows += [by_name[name] for name in methods if name in by_name]
        return rows


def _check_pool(prompts: Sequence, needed: int, what: str) -> None:
    if len(prompts) < needed:
        raise ValueError(f"{needed} {what} prompts needed (batch size x repeats), only {len(prompts)} built")


def _match(outputs: Sequence[BatchOutput], reference: Sequence[BatchOutput] | None, sampling: SamplingConfig) -> dict:
    """Greedy: whether every request's sequence equals the reference method's (null when sampling or
    without that method), and how many requests differ."""
    if reference is None or not sampling.greedy:
        return {"outputs_match_plain": None, "mismatched_requests": None}
    mismatched = sum(not torch.equal(a.cpu(), b.cpu()) for o, ref in zip(outputs, reference, strict=True)
                     for a, b in zip(o.sequences, ref.sequences, strict=True))
    return {"outputs_match_plain": mismatched == 0, "mismatched_requests": mismatched}
