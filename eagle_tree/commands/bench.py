"""``eagle-tree bench``: eagle-tree against Hugging Face baselines, side by side in one run.

1. Tuning: every candidate draft shape (``chain_lengths`` and ``trees``) and plain decoding (``none``:
   one token a round) decode the tuning prompts; per shape the mean round time C and mean committed
   tokens K give C / K, and the shape with the lowest C / K is selected per kind (eagle_tree.bench.tuning);
   the best of all may be ``none``, so the defaults it writes can say "do not speculate". The result goes
   to ``shapes.json``, which ``eagle-tree decode mode=auto shapes=...`` reads, and the best to
   ``decoding.json``.
2. Test: on the test prompts (never the tuning ones), every method runs with the same target object,
   prompts, sampling settings, seeds and output budget, interleaved and repeated: plain decoding in
   eagle-tree's loop (the speed-up denominator), HF ``generate``, HF assisted generation, HF prompt
   lookup, and the eagle-tree shapes (all candidates, or only the selected ones).
3. Report in ``output_dir``: ``bench.json`` (conditions, config, tuning, one row per method, the
   call order), ``bench.md`` (tables), ``survival.png`` and ``time_per_token.png``, ``config.yaml``.

``eagle-tree bench serving --config configs/bench-serving.yaml`` is the serving sweep instead (batch
sizes, context lengths, output budgets, continuous load; eagle_tree.commands.bench_serving).

``tiny_assets=FOLDER`` builds (once) a tiny random target, an untrained head, an assistant (the
target's own weights) and prompts there and uses them instead of the reference assets: the smoke run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle_tree.bench.mtbench import MTBenchSection
from eagle_tree.bench.tuning import CHAIN_LENGTHS, TREES
from eagle_tree.commands.decode import GenerationOptions
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.utils.checks import check_range
from eagle_tree.utils.config import config_to_dict, parse_cli, save_config
from eagle_tree.utils.tracking import WandbConfig

MethodKind = Literal["plain", "hf_generate", "hf_assisted", "hf_prompt_lookup", "chain", "tree", "context",
                     "head_defaults"]


@dataclass
class BenchConfig(GenerationOptions):
    """Benchmark eagle-tree (plain, chain, tree) against HF generate, assisted generation and prompt lookup."""

    target: str = "assets/reference/target"
    """Target model folder or hub id."""
    head: str | None = "assets/reference/head"
    """EAGLE-3 head folder (null: no chain / tree methods)."""
    assistant: str | None = "assets/reference/assistant"
    """Assistant model for HF assisted generation, same tokenizer as the target (null: skip that method)."""
    tuning_prompts: str = "assets/reference/prompts/tuning.jsonl"
    """Prompts the draft shapes are tuned on."""
    test_prompts: str = "assets/reference/prompts/test.jsonl"
    """Prompts the comparison is reported on (must share no prompt with the tuning file)."""
    tuning_limit: int | None = 8
    """Use only the first N tuning prompts."""
    test_limit: int | None = 16
    """Use only the first N test prompts."""
    mtbench: MTBenchSection = field(default_factory=MTBenchSection)
    """MT-bench as the test set (mtbench.enabled=true): both turns, reported overall, per category and per turn."""
    device: str = "cpu"
    """Device of all models (e.g. cuda)."""
    threads: int | None = None
    """torch.set_num_threads (null: torch's default)."""
    repeats: int = 3
    """Passes over the test prompts; times are medians over passes."""
    tuning_repeats: int = 1
    """Passes over the tuning prompts."""
    warmup: int = 1
    """Prompts every method decodes first in each phase, unrecorded."""
    chain_lengths: list[int] = field(default_factory=lambda: list(CHAIN_LENGTHS))
    """Candidate chain lengths."""
    trees: list[TreeConfig] = field(default_factory=lambda: list(TREES))
    """Candidate trees (depth, top_k, total_tokens, sampled)."""
    contexts: list[ContextConfig] = field(default_factory=list)
    """Context settings (lookup_tokens, max_ngram, min_ngram, branches, first): every candidate shape is
    also tuned with each of them; method `context` runs each alone (no head: prompt lookup in eagle-tree's loop)."""
    report_shapes: Literal["all", "selected", "head_only"] = "all"
    """Shapes in the test comparison: every candidate; only the selected ones (the best chain and tree, the
    best without and with context, and with context settings the best chain and tree without context); or
    head_only: the best chain and tree without context alone (the rows a long run such as the full MT-bench
    needs beside method head_defaults, which is the tuned best, and method context)."""
    methods: list[MethodKind] = field(default_factory=lambda: [
        "plain", "hf_generate", "hf_assisted", "hf_prompt_lookup", "chain", "tree"])
    """Methods to compare (plain always runs: it is the speed-up denominator). context: context branches
    without a head, one method per `contexts` entry; head_defaults: the head folder's decoding.json."""
    prompt_lookup_tokens: int = 10
    """prompt_lookup_num_tokens of HF prompt lookup."""
    assistant_tokens: int | None = None
    """Fixed draft length for HF assisted generation, without HF's confidence stop (null: HF's own heuristics)."""
    head_defaults: bool = False
    """Write the tuned best shape into the head folder's decoding.json (greedy or sampling entry), the
    defaults of SpeculativeDecoder(target, head); it is always written to output_dir/decoding.json. The best
    may be plain decoding (`none`: no shape beat a plain step), which the default decoder then uses."""
    output_dir: str = "results/bench"
    """Where bench.json, bench.md, the plots, shapes.json and config.yaml go (a new or empty folder, or an
    earlier bench's: files of the same names that something else wrote are never replaced)."""
    overwrite: bool = False
    """Write into `output_dir` even when it holds files of these names that an earlier bench did not write."""
    resume: bool = True
    """Continue an interrupted run of the same config in `output_dir`: the blocks (a prompt of a repeat, every
    method) recorded in its bench_journal.jsonl are read back, not run again (false: measure everything afresh).
    The journal is removed once the report is written."""
    max_minutes: float | None = None
    """Stop between blocks after this many minutes (exit status 3, no report yet); the same command continues
    the run. For benchmarks longer than one sitting, such as the full MT-bench (null: no limit)."""
    tiny_assets: str | None = None
    """Build tiny random models and prompts in this folder (once) and use them instead of the paths above."""
    plots: bool = True
    """Write PNG plots (matplotlib, Agg)."""
    verbose: bool = False
    """Print one line per generate call."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging of the summary and plots."""

    def __post_init__(self) -> None:
        check_range("max_minutes", self.max_minutes, 0, allow_none=True, meaning="no limit", integer=False)
        for name in ("tuning_limit", "test_limit"):
            check_range(name, getattr(self, name), 1, allow_none=True, meaning="all prompts")
        for name in ("max_new_tokens", "repeats", "tuning_repeats", "prompt_lookup_tokens"):
            check_range(name, getattr(self, name), 1)
        check_range("warmup", self.warmup, 0)
        check_range("threads", self.threads, 1, allow_none=True, meaning="torch's default")
        check_range("assistant_tokens", self.assistant_tokens, 1, allow_none=True, meaning="HF's heuristics")
        for i, n in enumerate(self.chain_lengths):
            check_range(f"chain_lengths[{i}]", n, 1)


def load_bench_models(cfg: BenchConfig):
    """BenchModels for the config (``eagle_tree.bench.runner.load_bench_models``)."""
    from eagle_tree.bench.runner import load_bench_models as load

    return load(cfg.target, cfg.head, cfg.methods, cfg.dtype, cfg.device, cfg.assistant, cfg.assistant_tokens,
                prepack=cfg.target_prepack, head_int8=cfg.head_int8)


def _kernels(models) -> str | bool:
    """The target's linear kernels as its layers hold them (target_prepack true, or auto's timing), "+head"
    since the head's layers follow them: part of a journal's identity, so blocks on other kernels are not
    read back."""
    from eagle_tree.models.prepack import packed_kernels

    kernels = packed_kernels(models.target.model)
    return f"{kernels}+head" if kernels else False


def baseline_methods(cfg: BenchConfig):
    from eagle_tree.bench.runner import HEAD_DEFAULTS, HF_GENERATE, PLAIN, Method, context_only_method

    methods = [PLAIN]
    if "hf_generate" in cfg.methods:
        methods.append(HF_GENERATE)
    if "hf_assisted" in cfg.methods:
        methods.append(Method("hf_assisted", "hf", assistant=True))
    if "hf_prompt_lookup" in cfg.methods:
        methods.append(Method("hf_prompt_lookup", "hf", prompt_lookup_tokens=cfg.prompt_lookup_tokens))
    if "context" in cfg.methods:
        alone = {m.name: m for m in (context_only_method(TreeConfig(context=c)) for c in cfg.contexts)}
        methods += list(alone.values())  # one per setting; alone_ngram means nothing without a head
    if "head_defaults" in cfg.methods:
        methods.append(HEAD_DEFAULTS)
    return methods


def candidate_shapes(cfg: BenchConfig) -> list[TreeConfig]:
    """The tuning candidates of the config (``eagle_tree.bench.tuning.candidate_shapes``)."""
    from eagle_tree.bench.tuning import candidate_shapes as candidates

    head_shapes = "chain" in cfg.methods or "tree" in cfg.methods
    return candidates(cfg.chain_lengths if "chain" in cfg.methods else [], cfg.trees if "tree" in cfg.methods else [],
                      cfg.contexts, context_only=head_shapes and "context" in cfg.methods)


def _decoding_folders(cfg: BenchConfig, out_dir: Path) -> list[Path]:
    """Where the tuned defaults go: the output folder, and the head folder with head_defaults=true."""
    return [out_dir] + ([Path(cfg.head)] if cfg.head_defaults and cfg.head else [])


def tune_shapes(cfg: BenchConfig, models, tuning_ids, out_dir: Path, resume=None, **common):
    """Run every candidate shape and plain decoding (the candidate ``none``) on the tuning prompts; write
    shapes.json and the best into decoding.json; return (the tuning's dict, selection)."""
    from eagle_tree.bench.runner import PLAIN, eagle_method, run_phase
    from eagle_tree.bench.tuning import save_tuned_shapes, selection, shape_measurements
    from eagle_tree.decoding.shapes import save_decoding_defaults

    shapes = candidate_shapes(cfg)
    print(f"tuning {len(shapes)} shapes and plain decoding on {len(tuning_ids)} prompts x {cfg.tuning_repeats} "
          f"({cfg.tuning_prompts})")
    result = run_phase("tuning", [PLAIN] + [eagle_method(s) for s in shapes], models, tuning_ids,
                       cfg.tuning_repeats, resume=resume, **common)
    measured = shape_measurements(result)
    tuning = save_tuned_shapes(out_dir / "shapes.json", measured, temperature=cfg.sampling.temperature,
                               prompts=cfg.tuning_prompts, n_prompts=len(tuning_ids),
                               max_new_tokens=cfg.max_new_tokens, target=cfg.target, head=cfg.head)
    chosen = selection(measured)
    source = dict(by="eagle-tree bench", temperature=cfg.sampling.temperature, prompts=cfg.tuning_prompts,
                  n_prompts=len(tuning_ids), threads=cfg.threads, device=cfg.device, dtype=cfg.dtype,
                  time_per_token_s=chosen["best"].time_per_token, committed=chosen["best"].committed)
    for folder in _decoding_folders(cfg, out_dir):
        save_decoding_defaults(folder, chosen["best"].tree, greedy=cfg.sampling.greedy, **source)
    return tuning | {"schedule": result.schedule}, chosen


def main(argv: list[str]) -> int:
    from eagle_tree.utils.checks import exit_on_input_error

    return exit_on_input_error("eagle-tree bench", run, parse_cli(BenchConfig, argv, prog="eagle-tree bench"))


def run(cfg: BenchConfig) -> int:
    """Check the output folder and read the prompts, load the models, check the prompts against the
    target, then tune, compare and report."""
    import torch

    from eagle_tree.bench.aggregate import method_rows
    from eagle_tree.bench.machine import conditions
    from eagle_tree.bench.runner import HEAD_DEFAULTS, PLAIN, eagle_method, head_defaults_shape, run_phase
    from eagle_tree.bench.timing import Stopped
    from eagle_tree.data.tiny import build_tiny_assets
    from eagle_tree.utils.checks import InputError
    from eagle_tree.utils.outputs import check_output_dir, mark_output_dir
    from eagle_tree.utils.prompts import encode_for_target, read_prompt_file
    from eagle_tree.utils.tracking import RunLogger

    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir, BENCH_KIND, writes=BENCH_FILES, overwrite=cfg.overwrite, recognise=_is_old_bench)
    if cfg.head_defaults and cfg.head and not cfg.tiny_assets:  # its decoding.json is merged, never another file
        from eagle_tree.decoding.shapes import is_decoding_file
        from eagle_tree.utils.outputs import check_output_file

        check_output_file(Path(cfg.head) / "decoding.json", BENCH_KIND, overwrite=cfg.overwrite,
                          recognise=is_decoding_file)
    if cfg.tiny_assets:
        for key, path in build_tiny_assets(cfg.tiny_assets).items():
            setattr(cfg, key, str(path))
    shapes, tuning, chosen = candidate_shapes(cfg), None, {}
    test_prompts = [] if cfg.mtbench.enabled else read_prompt_file(cfg.test_prompts)[: cfg.test_limit]
    tuning_prompts = read_prompt_file(cfg.tuning_prompts)[: cfg.tuning_limit] if shapes else []
    shared = {p.text for p in tuning_prompts} & {p.text for p in test_prompts}
    if shared:
        raise InputError(f"{len(shared)} prompt(s) appear in both {cfg.tuning_prompts} and {cfg.test_prompts}: "
                         "tune on other prompts than the ones reported")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    models = load_bench_models(cfg)
    if models.target.prepack_choice is not None:
        print(f"target kernels: {models.target.prepack_choice.describe()}")
    test_ids, tuning_ids = (encode_for_target(prompts, models.target, models.tokenizer, cfg.max_new_tokens,
                                              cfg.truncate_prompts)
                            for prompts in (test_prompts, tuning_prompts))
    mark_output_dir(out_dir, BENCH_KIND)
    save_config(cfg, out_dir / "config.yaml")
    eos = models.tokenizer.eos_token_id if cfg.stop_at_eos else None
    resume = _resume(cfg, models, out_dir)  # max_minutes counts from here: the turn-1 answers are in the sitting
    if cfg.mtbench.enabled:  # turn 2 follows the model's own greedy turn-1 answer (eagle_tree.bench.mtbench)
        from eagle_tree.bench.mtbench import TURN1_FILE, build_prompts

        try:
            test_prompts = build_prompts(cfg.mtbench, models.target, models.tokenizer, out_dir, cfg.max_new_tokens,
                                         eos, stop=resume.stop)
        except Stopped as stop:
            print(f"stopped by max_minutes={cfg.max_minutes} after {stop.done} of {stop.blocks} MT-bench turn-1 "
                  f"answers; they are in {out_dir / TURN1_FILE}: run the same command again to continue")
            return STOPPED
        shared = {p.text for p in tuning_prompts} & {p.text for p in test_prompts}
        if shared:
            raise InputError(f"{len(shared)} tuning prompt(s) of {cfg.tuning_prompts} are MT-bench turns: tune on "
                             "other prompts than the ones reported")
        test_ids = encode_for_target([p.as_prompt() for p in test_prompts], models.target, models.tokenizer,
                                     cfg.max_new_tokens, cfg.truncate_prompts)
    common = dict(max_new_tokens=cfg.max_new_tokens, sampling=cfg.sampling, seed=cfg.seed, warmup=cfg.warmup,
                  eos_token_id=models.tokenizer.eos_token_id if cfg.stop_at_eos else None,
                  log=print if cfg.verbose else None)
    try:
        # 1. tuning: shapes measured on the tuning prompts, never on the test prompts
        if shapes:
            tuning, chosen = tune_shapes(cfg, models, tuning_ids, out_dir, resume=resume, **common)
            shapes = reported_shapes(cfg.report_shapes, chosen, shapes)
        # a context-only shape is compared as the `context` method (context-only-ctxN), not twice
        shapes = [s for s in shapes if s.head] if "context" in cfg.methods else shapes
        resumed = {"tuning": resume.resumed}

        # 2. the comparison on the test prompts
        methods = baseline_methods(cfg) + [eagle_method(s) for s in shapes]
        source = "MT-bench" if cfg.mtbench.enabled else cfg.test_prompts
        print(f"comparing {len(methods)} methods on {len(test_ids)} prompts x {cfg.repeats} ({source})")
        result = run_phase("test", methods, models, test_ids, cfg.repeats, resume=resume, **common)
        resumed["test"] = resume.resumed
    except Stopped as stop:
        print(f"stopped by max_minutes={cfg.max_minutes} after {stop.done} of {stop.blocks} blocks of this phase; "
              f"they are in {resume.journal.path}: run the same command again to continue")
        return STOPPED
    rows = method_rows(result, cfg.sampling)
    for row in rows:
        row["selected_as"] = sorted(k for k, m in chosen.items() if (row["tree"] and m.name == row["method"])
                                    or (not m.drafted and row["method"] == PLAIN.name))  # best none: plain's row
        if row["method"] == HEAD_DEFAULTS.name:  # the shape the head folder's decoding.json gave this decoding
            row["shape"] = head_defaults_shape(models.decoder(None, True), cfg.sampling)

    # 3. the report
    report = {"conditions": conditions(models, cfg.dtype), "config": config_to_dict(cfg), "tuning": tuning,
              "methods": rows, "schedule": result.schedule, "notes": NOTES,
              "sittings": {"count": len(resume.earlier_sittings) + 1, "blocks_read_back": resumed}}
    if cfg.mtbench.enabled:
        from eagle_tree.bench.mtbench import group_rows

        report["groups"] = group_rows(result, test_prompts, cfg.sampling)
        report["prompts"] = [{"where": p.where, "category": p.category, "turn": p.turn} for p in test_prompts]
    (out_dir / "bench.json").write_text(json.dumps(_json_safe(report), indent=2, allow_nan=False))
    table = markdown_report(report)
    if "groups" in report:
        from eagle_tree.bench.mtbench import markdown_groups

        table += "\n" + markdown_groups(report["groups"])
    (out_dir / "bench.md").write_text(table)
    plots = write_plots(rows, out_dir) if cfg.plots else []
    resume.journal.remove()  # the run is complete: a rerun measures again
    print("\n" + table)
    with RunLogger(cfg.wandb, run_config=config_to_dict(cfg), job_type="bench") as logger:
        logger.summary({f"bench/{r['method']}/{k}": v for r in rows for k, v in r.items()
                        if isinstance(v, int | float) and not isinstance(v, bool)})
        for path in plots:
            logger.log_image(f"bench/{path.stem}", path)
    best = chosen.get("best")
    selected = "" if best is None else f"; {best.name} selected in shapes.json" + (
        "" if best.drafted else " (plain decoding: no draft shape beat a plain step)")
    print(f"results in {out_dir}/: bench.json, bench.md, config.yaml{', PNG plots' if plots else ''}{selected}")
    return 0


SELECTED = ("chain", "tree", "no_context", "context", "head_only_chain", "head_only_tree")
"""The selection keys (eagle_tree.bench.tuning.selection) whose shapes report_shapes=selected compares."""
HEAD_ONLY = ("head_only_chain", "chain", "head_only_tree", "tree")
"""The keys report_shapes=head_only reads; ``chain`` and ``tree`` are head-only when no context was tuned."""


def reported_shapes(report_shapes: str, chosen: dict, candidates: list[TreeConfig]) -> list[TreeConfig]:
    """The shapes the test comparison runs, from the tuning's selection ``chosen`` (key -> measurement):
    every candidate (``all``), the :data:`SELECTED` ones, or the best chain and tree without context
    (``head_only``), each shape once."""
    if report_shapes == "all":
        return candidates
    if report_shapes == "selected":
        return list(dict.fromkeys(chosen[k].tree for k in SELECTED if k in chosen))
    if report_shapes == "head_only":
        return list(dict.fromkeys(chosen[k].tree for k in HEAD_ONLY
                                  if k in chosen and chosen[k].tree.head and chosen[k].tree.context is None))
    raise ValueError(f"report_shapes must be all, selected or head_only, got {report_shapes!r}")
BENCH_KIND = "eagle-tree bench"
BENCH_FILES = ("config.yaml", "bench.json", "bench.md", "shapes.json", "decoding.json", "survival.png",
               "time_per_token.png", "mtbench_turn1.jsonl", "bench_journal.jsonl")
STOPPED = 3  # exit status of a run stopped by max_minutes


def _resume(cfg: BenchConfig, models, out_dir: Path):
    """The journal of this output folder (eagle_tree.bench.journal), with what else decides the figures."""
    import time

    import torch

    from eagle_tree.bench.journal import JOURNAL_FILE, Journal, weights_fingerprint
    from eagle_tree.bench.runner import Resume

    journal = Journal(out_dir / JOURNAL_FILE)
    if not cfg.resume:
        journal.remove()
    identity = {"target": weights_fingerprint(models.target.model), "head": weights_fingerprint(models.head),
                "assistant": weights_fingerprint(models.assistant), "assistant_tokens": cfg.assistant_tokens,
                "threads": torch.get_num_threads(), "device": cfg.device, "dtype": cfg.dtype,
                # packed weights serve one-row steps and the head's layers since 2026-12-03: older journals are unread
                "target_prepack": _kernels(models), "head_int8": cfg.head_int8}
    deadline = None if cfg.max_minutes is None else time.monotonic() + 60 * cfg.max_minutes
    sitting = journal.sittings()
    if sitting:
        print(f"{journal.path} holds an interrupted run: blocks of this same config are read back, not run "
              "again (resume=false measures afresh)")
    return Resume(journal, identity, sitting, stop=None if deadline is None else lambda: time.monotonic() > deadline)


def _is_old_bench(path: Path) -> bool:
    """A bench folder written before bench folders were marked: its bench.json holds a bench report."""
    try:
        report = json.loads((path / "bench.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"conditions", "methods", "schedule"} <= set(report)


NOTES = {
    "acceptance_length": "tokens committed per round (accepted draft tokens + correction/bonus), over rounds after "
                         "the prefill; HF methods: measured with a streamer, one put per target forward",
    "time_per_output_token_s": "median over repeats of (cumulative wall time / committed tokens) per repeat, "
                               "prefill included",
    "decode_time_per_token_s": "median over repeats of (wall time after each call's first token / the tokens "
                               "committed after it): decoding alone, the prefill excluded",
    "speedup_vs_plain": "median over repeats of plain's time per output token / the method's, same repeat",
    "time_split": "eagle-tree: draft (with draft-cache catch-up), verify, other (sampling, cache); HF: target forward"
                  " time as verify, assistant forward time as draft, the rest of the time between puts as other",
    "peak_memory_mb": "peak above the level at the start of each call, max over calls; see conditions.memory_method",
    "outputs_match_plain": "greedy only (null when sampling): every output token equals eagle-tree plain decoding's",
    "hf_rounds": "HF's first target forward is the prefill (for assisted / prompt lookup it also verifies a first "
                 "draft): its tokens count as output, not as a round; in rounds cut by EOS or the budget, "
                 "accepted = committed - 1",
}


def _json_safe(value):
    """NaN (e.g. gaps of a single-token output) -> None, recursively."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _ms(value) -> str:
    return "-" if value is None or value != value else f"{1000 * value:.2f}"


def markdown_report(report: dict) -> str:
    c = report["conditions"]
    lines = ["# eagle-tree bench", "",
             f"{c['cpu']} ({c['cpus_usable']} usable cores), {c['device']}, {c['dtype']}, torch {c['torch']} "
             f"({c['torch_threads']} threads), transformers {c['transformers']}; target "
             f"{c['target']['parameters']:,} parameters; peak memory: {c['memory_method']}", ""]
    sittings = report.get("sittings", {})
    if sittings.get("count", 1) > 1:
        back = sittings["blocks_read_back"]
        lines += [f"Measured in {sittings['count']} sittings (an interrupted run resumed from its journal; blocks "
                  f"read back: tuning {back.get('tuning', 0)}, test {back.get('test', 0)}): each block's methods "
                  "ran together, blocks of different sittings may have seen different machine states.", ""]
    if report["tuning"]:
        t = report["tuning"]
        lines += ["## Tuning (draft shape by lowest C / K; none: plain decoding, one token a round)", "",
                  "| shape | rounds | C ms/round | K tokens/round | C/K ms | selected |", "|---|---|---|---|---|---|"]
        for s in t["shapes"]:
            sel = ", ".join(k for k, n in t["selected"].items() if n == s["name"])
            lines.append(f"| {s['name']} | {s['rounds']} | {_ms(s['round_s'])} | {s['committed']:.2f} | "
                         f"{_ms(s['time_per_token_s'])} | {sel} |")
        steps = [s for kind in t["marginal"] for s in t["marginal"][kind]]
        if steps:
            lines += ["", "Marginal rule (a growth step helps when dC/dK < C/K):", "",
                      "| step | dC ms | dK | dC/dK ms | C/K ms | helps |", "|---|---|---|---|---|---|"]
            lines += [f"| {s['small']} -> {s['large']} | {_ms(s['d_round_s'])} | {s['d_committed']:+.2f} | "
                      f"{_ms(s['marginal_s'])} | {_ms(s['threshold_s'])} | {'yes' if s['helps'] else 'no'} |"
                      for s in steps]
        lines.append("")
    lines += ["## Comparison on the test prompts", "",
              "| method | shape | tau | ms/token | speed-up | TTFT ms | latency ms | gap p50/p95 ms | "
              "draft/verify/other ms/round | peak MB | = plain |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["methods"]:
        match = {True: "yes", False: "NO", None: "n/a"}[r["outputs_match_plain"]]
        speedup = "-" if r["speedup_vs_plain"] is None else f"{r['speedup_vs_plain']:.2f}x"
        name = r["method"] + (f" ({', '.join(r['selected_as'])})" if r.get("selected_as") else "")
        lines.append(
            f"| {name} | {r['shape']} | {r['acceptance_length']:.2f} | {_ms(r['time_per_output_token_s'])} | "
            f"{speedup} | {_ms(r['time_to_first_token_s'])} | {_ms(r['latency_s'])} | "
            f"{_ms(r['gap_p50_s'])} / {_ms(r['gap_p95_s'])} | {_ms(r['draft_s_per_round'])} / "
            f"{_ms(r['verify_s_per_round'])} / {_ms(r['other_s_per_round'])} | {r['peak_memory_mb']:.1f} | {match} |")
    return "\n".join(lines) + "\n"


def write_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """survival.png (Pr(A >= i) per method with a draft) and time_per_token.png (ms by method)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    paths = []
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in rows:
        if r["survival"]:
            ax.plot(range(1, len(r["survival"]) + 1), r["survival"], marker="o", label=r["method"])
    ax.set(xlabel="draft depth i", ylabel="Pr(accepted >= i)", title="Survival of draft tokens", ylim=(0, 1.02))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.lines:
        ax.legend(fontsize=8)
    paths.append(out_dir / "survival.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")

    fig = Figure(figsize=(7, 0.4 * len(rows) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = [r["method"] for r in rows]
    ax.barh(names, [1000 * r["time_per_output_token_s"] for r in rows], color="tab:blue")
    ax.invert_yaxis()
    plain = next((r for r in rows if r["method"] == "plain"), None)
    if plain is not None:
        ax.axvline(1000 * plain["time_per_output_token_s"], color="gray", linestyle="--", label="plain (eagle-tree)")
        ax.legend(fontsize=8)
    ax.set(xlabel="time per output token (ms, median over repeats)", title="Time per output token by method")
    paths.append(out_dir / "time_per_token.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    return paths


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
