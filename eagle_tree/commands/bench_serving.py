"""``eagle-tree bench serving``: throughput and latency of batched decoding, per batch size, context
length and output budget, and under a continuous Poisson load (the logic: eagle_tree.bench.serving).

1. Tuning: per context length and batch size, every candidate draft shape (``none`` = plain decoding
   included) decodes batches of tuning prompts; the shape with the highest throughput is the tuned
   shape of that batch size. The crossover batch size is where the tuned shape becomes plain
   decoding (and stays so at every larger batch size measured).
2. Sweep: on the test prompts, per context length, output budget and batch size, every method
   (plain decoding, the configured head shapes, the tuned shape, Hugging Face batched ``generate``)
   decodes one batch per repeat, interleaved; per cell: throughput, TTFT, end-to-end latency (mean,
   p95), TPOT, p50 / p95 gaps between streamed tokens, peak memory, acceptance length.
3. Continuous load: per arrival rate, a stream of requests with seeded Poisson arrival times goes
   through ``SpeculativeDecoder.serve`` (continuous batching), queueing included in every figure.
4. Report in ``output_dir``: ``serving.json`` (every cell), ``serving.md`` (tables),
   ``throughput.png`` and ``latency_p95.png`` (against batch size, per method; one panel per context
   and output budget), ``config.yaml``.

``quick=true`` shrinks the sweep to a smoke run (:data:`QUICK`); ``tiny_assets=FOLDER`` uses tiny
random models instead of the reference assets (as in ``eagle-tree bench``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle_tree.bench.tuning import SERVING_CANDIDATES
from eagle_tree.commands.decode import CommandSampling
from eagle_tree.models.prepack import PrepackSetting
from eagle_tree.utils.checks import check_range
from eagle_tree.utils.config import ConfigValueError, config_to_dict, parse_cli, save_config

QUICK = {"batch_sizes": [1, 2], "contexts": [128], "output_budgets": [16], "tuning_tokens": 16, "repeats": 1,
         "tuning_repeats": 1, "warmup_tokens": 4, "arrival_rates": [4.0], "load_requests": 4, "load_max_batch": 2,
         "load_context": 128, "load_output_tokens": 16}
"""What ``quick=true`` sets (the candidate shapes become ``none`` and the shapes in ``methods``)."""


@dataclass
class ServingBenchConfig:
    """Serving sweep: plain, chain, tree, tuned and HF batched generate by batch size, context and output budget."""

    target: str = "assets/reference/target"
    """Target model folder or hub id."""
    head: str | None = "assets/reference/head"
    """EAGLE-3 head folder (null: only plain decoding and hf_generate)."""
    tuning_prompts: str = "assets/reference/prompts/tuning.jsonl"
    """Prompts the shapes are tuned on (never reported)."""
    test_prompts: str = "assets/reference/prompts/test.jsonl"
    """Prompts the sweep and the load are reported on."""
    device: str = "cpu"
    """Device of all models (e.g. cuda)."""
    threads: int | None = None
    """torch.set_num_threads (null: torch's default)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the target and the head."""
    target_prepack: PrepackSetting = False
    """CPU, float32: give the target's linear layers a oneDNN-packed weight for every forward
    (verification, batched steps, prefill), at twice the weights' memory; "auto": time both kernels at load
    and keep the faster (eagle_tree.models.prepack)."""
    head_int8: bool = False
    """CPU: the head drafts with a per-row int8 copy of its lm_head (eagle_tree.models.quantize)."""
    sampling: CommandSampling = field(default_factory=CommandSampling)
    """temperature (0 = greedy), top_k (0 = off), top_p (1.0 = off); the same for every method."""
    seed: int = 0
    """Seed of repeat r is seed + r (every method alike); the arrival times use seed."""
    stop_at_eos: bool = False
    """Stop a request at the tokenizer's EOS token (false: every request runs its whole output budget)."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    """Batch sizes of the sweep (requests decoded together, all starting at once)."""
    contexts: list[int] = field(default_factory=lambda: [128, 900])
    """Prompt lengths in tokens; each prompt is test prompts concatenated from a different start and cut
    to this length (eagle_tree.bench.serving.context_prompts)."""
    output_budgets: list[int] = field(default_factory=lambda: [32, 128, 512])
    """New tokens per request; capped per context so that prompt + output fits the target's positions."""
    methods: list[str] = field(default_factory=lambda: ["plain", "chain-2", "tree-d3k2n6", "tuned", "hf_generate"])
    """plain (draft=None), hf_generate (HF batched generate, left padding), tuned (the tuned shape of each
    batch size) and head shapes by name: chain-N, tree-dDkKnN (e.g. tree-d4k4n16), -sampled, +ctxN."""
    candidates: list[str] = field(default_factory=lambda: list(SERVING_CANDIDATES))
    """Shapes the tuning pass picks from per batch size (none = plain decoding)."""
    tuning_tokens: int = 64
    """Output budget of the tuning pass (capped like output_budgets)."""
    tuning_repeats: int = 1
    """Batches per candidate and batch size in the tuning pass."""
    repeats: int = 2
    """Batches per cell in the sweep (each on other prompts); figures pool them."""
    warmup_tokens: int = 8
    """Unrecorded batch of this many tokens per method and batch size before the measured ones, once per context
    (and per batch size in the tuning pass; 0: none)."""
    arrival_rates: list[float] = field(default_factory=lambda: [2.0, 4.0, 8.0])
    """Continuous load: Poisson arrival rates in requests per second (empty: no load phase)."""
    load_requests: int = 32
    """Requests per arrival rate."""
    load_max_batch: int = 8
    """Rows of the continuous batch (one of batch_sizes when `tuned` runs: its tuned shape is used)."""
    load_context: int = 128
    """Prompt length of the load's requests (one of contexts when `tuned` runs)."""
    load_output_tokens: int = 128
    """New tokens per request of the load (capped like output_budgets)."""
    quick: bool = False
    """Smoke run: replace the sweep axes by the small ones in QUICK (bench_serving.py) and the candidates by
    none plus the shapes in methods."""
    output_dir: str = "results/bench-serving"
    """Where serving.json, serving.md, the plots and config.yaml go (a new or empty folder, or an earlier
    serving bench's)."""
    overwrite: bool = False
    """Write into output_dir even when it holds files of these names that an earlier serving bench did not write."""
    tiny_assets: str | None = None
    """Build tiny random models and prompts in this folder (once) and use them instead of the paths above."""
    plots: bool = True
    """Write PNG plots (matplotlib, Agg)."""
    progress: bool = True
    """Show a progress bar over the cells (tqdm, on stderr)."""

    def __post_init__(self) -> None:
        from eagle_tree.bench.serving import NONE, TUNED, parse_method, parse_shape

        if self.quick:
            for key, value in QUICK.items():
                setattr(self, key, list(value) if isinstance(value, list) else value)
            shapes = [m for m in self.methods if m not in ("plain", "hf_generate", TUNED)]
            self.candidates = list(dict.fromkeys([NONE, *shapes]))
        for name in ("batch_sizes", "contexts", "output_budgets", "methods"):
            if not getattr(self, name):
                raise ConfigValueError(name, "must list at least one value")
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ConfigValueError(name, f"lists a value twice: {getattr(self, name)}")
        for name in ("batch_sizes", "contexts", "output_budgets"):
            for i, value in enumerate(getattr(self, name)):
                check_range(f"{name}[{i}]", value, 1)
        for name in ("tuning_tokens", "tuning_repeats", "repeats", "load_requests", "load_max_batch",
                     "load_context", "load_output_tokens"):
            check_range(name, getattr(self, name), 1)
        check_range("warmup_tokens", self.warmup_tokens, 0)
        check_range("threads", self.threads, 1, allow_none=True, meaning="torch's default")
        for i, rate in enumerate(self.arrival_rates):
            check_range(f"arrival_rates[{i}]", rate, 1e-9, integer=False)
        for i, name in enumerate(self.methods):
            try:
                parse_method(name)
            except ValueError as exc:
                raise ConfigValueError(f"methods[{i}]", str(exc)) from None
        for i, name in enumerate(self.candidates):
            try:
                parse_shape(name)
            except ValueError as exc:
                raise ConfigValueError(f"candidates[{i}]", str(exc)) from None
        if len(set(self.candidates)) != len(self.candidates):
            raise ConfigValueError("candidates", f"lists a shape twice: {self.candidates}")
        if TUNED in self.methods:
            if not self.candidates:
                raise ConfigValueError("candidates", "must list at least one shape when methods holds tuned")
            if self.arrival_rates and self.load_context not in self.contexts:
                raise ConfigValueError("load_context", f"must be one of contexts {self.contexts} (the tuned shape of "
                                       f"the load comes from that context's tuning), got {self.load_context}")
            if self.arrival_rates and self.load_max_batch not in self.batch_sizes:
                raise ConfigValueError("load_max_batch", f"must be one of batch_sizes {self.batch_sizes} (the tuned "
                                       f"shape of the load is that batch size's), got {self.load_max_batch}")

    @property
    def needs_head(self) -> bool:
        from eagle_tree.bench.serving import TUNED, parse_method, parse_shape

        shapes = [m.tree for m in map(parse_method, self.methods) if m is not None]
        if TUNED in self.methods:
            shapes += [parse_shape(c) for c in self.candidates]
        return any(tree is not None for tree in shapes)


KIND = "eagle-tree bench serving"
FILES = ("config.yaml", "serving.json", "serving.md", "throughput.png", "latency_p95.png")

NOTES = {
    "batching": "sweep: each batch of B requests starts together (all arrive and are admitted at 0) and requests "
                "leave as they finish (generate_batch); hf_generate is a static batch over left-padded prompts (a "
                "finished request is computed on pad tokens until the last one ends)",
    "continuous_load": "SpeculativeDecoder.serve: FIFO admission between rounds while fewer than max_batch requests "
                       "run; "
                       "the requests that have arrived by then are prefilled together as one batch before the next "
                       "round; arrivals follow the real clock (Poisson, seeded, the same times for every method); "
                       "hf_generate has no continuous batching and is not in the load",
    "prompts": "a prompt of context length L: test (or tuning) prompts from prompt i on, in file order and wrapping "
               "around, joined by a blank line, tokenized, cut to the first L tokens; request i of a batch starts "
               "at prompt r*B + i in repeat r",
    "output_budgets": "capped per context so that prompt + output <= the target's positions; budgets that cap to "
                      "the same value run once (see `budgets`)",
    "throughput_tok_s": "new tokens of every request / wall time of the calls (prefill included), over repeats",
    "ttft_s": "first token time - arrival (queueing included); latency_s: finish - arrival",
    "tpot_mean_s": "(finish - first token) / (new tokens - 1), mean over requests with at least two tokens",
    "gaps": "p50 / p95 over every gap between consecutive streamed tokens of a request (a round's tokens come "
            "out together: gaps of 0 inside a round)",
    "acceptance_length": "tokens committed per round, pooled over every request's rounds (1.0 without a draft)",
    "cache_peak_mb": "the largest size of the key/value buffers (target cache and head cache) during a call, max "
                     "over a cell's calls (eagle-tree methods only): the memory that grows with batch and context",
    "peak_memory_mb": "peak above the level at the start of each call, max over a cell's calls; see "
                      "conditions.memory_method",
    "tuned": "per context and batch size, the candidate shape with the highest throughput on the tuning prompts "
             "(tuning_tokens new tokens); when it is one of the cell's methods, that row is reused (reused_from)",
    "crossover_batch_size": "smallest batch size from which on the tuned shape is none (plain decoding) at every "
                            "larger batch size measured; null: speculation still wins at the largest",
    "outputs_match_plain": "greedy only: every request's output equals plain decoding's in the same cell",
    "hf_timing": "hf_generate token times come from a streamer: the time generate hands over each step's tokens, "
                 "after the forward and token choice (the same for every row of a step)",
}


def main(argv: list[str]) -> int:
    from eagle_tree.utils.checks import exit_on_input_error

    return exit_on_input_error(KIND, run, parse_cli(ServingBenchConfig, argv, prog=KIND))


def _positions(target: str) -> int | None:
    from transformers import AutoConfig

    from eagle_tree.utils.checks import check_target_path
    from eagle_tree.utils.prompts import max_positions

    check_target_path(target)
    return max_positions(AutoConfig.from_pretrained(target))


def plan_budgets(cfg: ServingBenchConfig, positions: int | None) -> dict:
    """Every context's output budgets (capped to the positions), the tuning budget and the load's;
    a context that leaves no room for output is an InputError naming the fix."""
    from eagle_tree.bench.serving import output_budgets
    from eagle_tree.utils.checks import InputError

    for name, values in (("contexts", cfg.contexts), ("load_context", [cfg.load_context])):
        for context in values:
            if positions is not None and context >= positions:
                raise InputError(f"{name}: a {context}-token prompt leaves no room for output in the target's "
                                 f"{positions} positions: use prompts of at most {positions - 1} tokens")
    return {"sweep": output_budgets(cfg.contexts, cfg.output_budgets, positions),
            "tuning": output_budgets(cfg.contexts, [cfg.tuning_tokens], positions),
            "load": output_budgets([cfg.load_context], [cfg.load_output_tokens], positions)}


def load_models(cfg: ServingBenchConfig):
    """BenchModels (target, tokenizer, head) through ``eagle-tree bench``'s loader."""
    from eagle_tree.commands.bench import BenchConfig, load_bench_models

    return load_bench_models(BenchConfig(target=cfg.target, head=cfg.head if cfg.needs_head else None,
                                         assistant=None, device=cfg.device, dtype=cfg.dtype,
                                         methods=["plain", "chain"] if cfg.needs_head else ["plain"],
                                         target_prepack=cfg.target_prepack, head_int8=cfg.head_int8))


def run(cfg: ServingBenchConfig) -> int:
    """Check the output folder, the prompts and the positions; load the models; tune, sweep, load; report."""
    import torch
    from tqdm import tqdm

    from eagle_tree.bench.machine import conditions
    from eagle_tree.bench.serving import HF_GENERATE, TUNED, Sweep, context_prompts
    from eagle_tree.data.tiny import build_tiny_assets
    from eagle_tree.utils.checks import InputError
    from eagle_tree.utils.outputs import check_output_dir, mark_output_dir
    from eagle_tree.utils.prompts import read_prompts

    started = time.perf_counter()
    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir, KIND, writes=FILES, overwrite=cfg.overwrite)
    if cfg.tiny_assets:
        paths = build_tiny_assets(cfg.tiny_assets)
        cfg.target, cfg.head = str(paths["target"]), str(paths["head"])
        cfg.tuning_prompts, cfg.test_prompts = str(paths["tuning_prompts"]), str(paths["test_prompts"])
    if cfg.needs_head and cfg.head is None:
        raise InputError("chain / tree shapes (in methods or, with tuned, in candidates) need a draft head: set "
                         "head=PATH, or keep only plain and hf_generate")
    tuning = TUNED in cfg.methods
    test_texts = read_prompts(cfg.test_prompts)
    tuning_texts = read_prompts(cfg.tuning_prompts) if tuning else []
    shared = set(test_texts) & set(tuning_texts)
    if shared:
        raise InputError(f"{len(shared)} prompt(s) appear in both {cfg.tuning_prompts} and {cfg.test_prompts}: "
                         "tune on other prompts than the ones reported")
    budgets = plan_budgets(cfg, _positions(cfg.target))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    models = load_models(cfg)
    mark_output_dir(out_dir, KIND)
    save_config(cfg, out_dir / "config.yaml")

    vocab, top = models.target.vocab_size, max(cfg.batch_sizes)
    eos = models.tokenizer.eos_token_id if cfg.stop_at_eos else None
    load_methods = [m for m in cfg.methods if m != HF_GENERATE] if cfg.arrival_rates else []
    total = ((len(cfg.contexts) * len(cfg.batch_sizes) if tuning else 0)
             + sum(len(b) for b in budgets["sweep"].values()) * len(cfg.batch_sizes)
             + len(cfg.arrival_rates) * len(load_methods))
    with tqdm(total=total, desc="serving bench", unit="cell", disable=not cfg.progress, file=sys.stderr) as bar:
        def tick(what: str) -> None:
            bar.set_postfix_str(what, refresh=False)
            bar.update()

        sweep = Sweep(models, cfg.sampling, seed=cfg.seed, eos_token_id=eos, repeats=cfg.repeats,
                      warmup_tokens=cfg.warmup_tokens, progress=tick)
        tuned = {}
        for context in cfg.contexts if tuning else []:
            prompts = context_prompts(models.tokenizer, tuning_texts, top * cfg.tuning_repeats, context, vocab)
            budget = budgets["tuning"][context][0]["budget"]
            tuned[context] = sweep.tune(cfg.candidates, prompts, cfg.batch_sizes, budget, cfg.tuning_repeats)
        cells = []
        for context in cfg.contexts:
            prompts = context_prompts(models.tokenizer, test_texts, top * cfg.repeats, context, vocab)
            for i, entry in enumerate(budgets["sweep"][context]):  # warmed up once per context
                rows = sweep.cells(cfg.methods, prompts, cfg.batch_sizes, entry["budget"],
                                   tuned=tuned[context]["tuned"] if tuning else None, warmup=i == 0)
                for row in rows:
                    cells.append({"context": context, "output_budget": entry["budget"],
                                  "output_budget_asked": entry["asked"], "capped": entry["capped"]} | row)
        load = None
        if load_methods:
            budget = budgets["load"][cfg.load_context][0]["budget"]
            prompts = context_prompts(models.tokenizer, test_texts, cfg.load_requests, cfg.load_context, vocab)
            shape = tuned[cfg.load_context]["tuned"][cfg.load_max_batch] if tuning else None
            load = {"context": cfg.load_context, "output_budget": budget, "max_batch": cfg.load_max_batch,
                    "requests": cfg.load_requests, "tuned_shape": shape,
                    "rows": sweep.load(load_methods, prompts, cfg.arrival_rates, budget, cfg.load_max_batch, shape)}

    report = {"conditions": conditions(models, cfg.dtype), "config": config_to_dict(cfg),
              "positions": _positions(cfg.target), "budgets": budgets, "tuning": tuned, "cells": cells, "load": load,
              "notes": NOTES, "run_s": time.perf_counter() - started}
    report = json.loads(json.dumps(report))  # int keys (batch sizes, contexts) as JSON writes them
    from eagle_tree.utils.atomic import write_text

    write_text(out_dir / "serving.json", json.dumps(report, indent=2, allow_nan=False))
    table = markdown_report(report)
    write_text(out_dir / "serving.md", table)
    plots = write_plots(report, out_dir) if cfg.plots else []
    print("\n" + table)
    print(f"results in {out_dir}/: serving.json, serving.md, config.yaml{', PNG plots' if plots else ''} "
          f"({report['run_s']:.0f} s)")
    return 0


# ---------------------------------------------------------------------------------- report


def _ms(value) -> str:
    return "-" if value is None else f"{1000 * value:.1f}"


def _num(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_report(report: dict) -> str:
    c = report["conditions"]
    lines = ["# eagle-tree bench serving", "",
             f"{c['cpu']} ({c['cpus_usable']} usable cores), {c['device']}, {c['dtype']}, torch {c['torch']} "
             f"({c['torch_threads']} threads), transformers {c['transformers']}; target "
             f"{c['target']['parameters']:,} parameters, {report['positions']} positions; sampling "
             f"temperature {report['config']['sampling']['temperature']}; peak memory: {c['memory_method']}; "
             f"run {report['run_s']:.0f} s", "",
             f"- Batching: {NOTES['batching']}.", f"- Prompts: {NOTES['prompts']}."]
    capped = [(ctx, e) for ctx, entries in report["budgets"]["sweep"].items() for e in entries if e["capped"]]
    if capped:
        lines.append("- Output budgets capped to fit the positions: " + "; ".join(
            f"context {ctx}: {', '.join(map(str, e['asked']))} -> {e['budget']}" for ctx, e in capped) + ".")
    lines.append("")
    if report["tuning"]:
        candidates = report["config"]["candidates"]
        lines += ["## Tuned shape per batch size (tuning prompts, throughput tok/s)", "",
                  "| context | batch | " + " | ".join(candidates) + " | tuned |",
                  "|---|---|" + "---|" * len(candidates) + "---|"]
        for ctx, t in report["tuning"].items():
            for batch, tps in t["throughput"].items():
                lines.append(f"| {ctx} | {batch} | " + " | ".join(_num(tps[s]) for s in candidates)
                             + f" | {t['tuned'][batch]} |")
        lines.append("")
        for ctx, t in report["tuning"].items():
            cross = t["crossover_batch_size"]
            lines.append(f"- Context {ctx}: " + (f"the tuned shape is plain decoding from batch size {cross} on."
                                                  if cross is not None else
                                                  "speculation still wins at the largest batch size (no crossover)."))
        lines.append("")
    lines += ["## Sweep (test prompts)", ""]
    groups: dict = {}
    for row in report["cells"]:
        groups.setdefault((row["context"], row["output_budget"]), []).append(row)
    for (ctx, budget), rows in groups.items():
        lines += [f"### Context {ctx} tokens, output {budget} tokens", "",
                  "| batch | method | shape | tok/s | x plain | x HF | TTFT ms | latency ms | p95 latency ms "
                  "| TPOT ms | gap p50 / p95 ms | peak MB | cache MB | tau | = plain |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            match = {True: "yes", False: f"NO ({r['mismatched_requests']})", None: "n/a"}[r["outputs_match_plain"]]
            name = r["method"] + (f" (= {r['reused_from']})" if r["reused_from"] else "")
            lines.append(
                f"| {r['batch_size']} | {name} | {r['shape']} | {_num(r['throughput_tok_s'])} | "
                f"{_num(r['throughput_vs_plain'], 2, 'x')} | {_num(r['throughput_vs_hf'], 2, 'x')} | "
                f"{_ms(r['ttft_mean_s'])} | {_ms(r['latency_mean_s'])} | {_ms(r['latency_p95_s'])} | "
                f"{_ms(r['tpot_mean_s'])} | {_ms(r['gap_p50_s'])} / {_ms(r['gap_p95_s'])} | "
                f"{r['peak_memory_mb']:.1f} | {_num(r.get('cache_peak_mb'), 1)} | {_num(r['acceptance_length'], 2)} | "
                f"{match} |")
        lines.append("")
    load = report["load"]
    if load:
        lines += ["## Continuous load (Poisson arrivals)", "",
                  f"{load['requests']} requests of {load['context']} prompt tokens and {load['output_budget']} new "
                  f"tokens per rate, at most {load['max_batch']} rows. Policy: {NOTES['continuous_load']}.", "",
                  "| rate req/s | method | shape | tok/s | TTFT ms | queue ms | latency ms | p95 latency ms | TPOT ms |"
                  " gap p50 / p95 ms | peak MB | cache MB | tau |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in load["rows"]:
            name = r["method"] + (f" (= {r['reused_from']})" if r["reused_from"] else "")
            lines.append(
                f"| {r['rate_rps']:g} | {name} | {r['shape']} | {_num(r['throughput_tok_s'])} | "
                f"{_ms(r['ttft_mean_s'])} | {_ms(r['queue_mean_s'])} | {_ms(r['latency_mean_s'])} | "
                f"{_ms(r['latency_p95_s'])} | {_ms(r['tpot_mean_s'])} | {_ms(r['gap_p50_s'])} / "
                f"{_ms(r['gap_p95_s'])} | {r['peak_memory_mb']:.1f} | {_num(r.get('cache_peak_mb'), 1)} | "
                f"{_num(r['acceptance_length'], 2)} |")
        lines.append("")
    return "\n".join(lines)


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """throughput.png and latency_p95.png: the figure against batch size, one line per method, one
    panel per (context, output budget): contexts in rows, budgets in columns."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups: dict = {}
    for row in report["cells"]:
        groups.setdefault(row["context"], {}).setdefault(row["output_budget"], []).append(row)
    n_rows, n_cols = len(groups), max(len(v) for v in groups.values())
    paths = []
    for key, label, scale, name in (("throughput_tok_s", "throughput (new tokens / s)", 1.0, "throughput.png"),
                                    ("latency_p95_s", "p95 end-to-end latency (ms)", 1000.0, "latency_p95.png")):
        fig = Figure(figsize=(4.2 * n_cols, 3.4 * n_rows))
        FigureCanvasAgg(fig)
        axes = fig.subplots(n_rows, n_cols, squeeze=False)
        for i, (ctx, budgets) in enumerate(groups.items()):
            for j in range(n_cols):
                ax = axes[i][j]
                if j >= len(budgets):
                    ax.set_visible(False)
                    continue
                budget, rows = list(budgets.items())[j]
                for method in dict.fromkeys(r["method"] for r in rows):
                    points = [(r["batch_size"], r[key]) for r in rows if r["method"] == method and r[key] is not None]
                    if points:
                        style = dict(linestyle="--", marker="s") if method == "tuned" else dict(marker="o")
                        ax.plot([b for b, _ in points], [scale * v for _, v in points], label=method, **style)
                batches = sorted({r["batch_size"] for r in rows})
                ax.set_xscale("log", base=2)
                ax.set_xticks(batches, [str(b) for b in batches])
                ax.set(title=f"context {ctx}, output {budget}", xlabel="batch size", ylabel=label)
                ax.grid(alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, bbox_to_anchor=(0.5, 1.02))
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    return paths


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
