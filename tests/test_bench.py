"""`eagle-tree bench` end to end on tiny models (configs/bench-smoke.yaml), plus its measuring parts."""

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch

from eagle_tree.bench.aggregate import method_rows
from eagle_tree.bench.hf import hf_generate
from eagle_tree.bench.memory import PeakMemory
from eagle_tree.bench.runner import PLAIN, BenchModels, Method, PhaseResult
from eagle_tree.bench.timing import rotation
from eagle_tree.commands.bench import BenchConfig, main
from eagle_tree.commands.decode import DecodeConfig, load_models
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.data.tiny import build_tiny_assets
from eagle_tree.decoding.decoder import GenerateOutput
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.rounds import RoundStats
from eagle_tree.decoding.shapes import load_tuned_shape
from eagle_tree.utils.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "bench-smoke.yaml"
BASELINES = {"plain", "hf_generate", "hf_assisted", "hf_prompt_lookup"}
FINITE_KEYS = ["acceptance_length", "time_per_output_token_s", "speedup_vs_plain", "speedup_vs_hf_generate",
               "time_to_first_token_s", "latency_s", "gap_p50_s", "gap_p95_s", "draft_s_per_round",
               "verify_s_per_round", "other_s_per_round", "peak_memory_mb"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_tiny_assets(tmp_path_factory.mktemp("bench") / "assets")


@pytest.fixture(scope="module")
def smoke(assets, tmp_path_factory):
    """The smoke config as CI runs it, with a smaller test set and budget to keep the suite quick."""
    out = tmp_path_factory.mktemp("bench-out")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["--config", str(SMOKE), f"tiny_assets={assets['target'].parent}", f"output_dir={out}",
                   "test_limit=2", "max_new_tokens=16"])
    assert rc == 0
    return out, json.loads((out / "bench.json").read_text()), printed.getvalue()


@pytest.mark.slow
def test_smoke_bench_writes_json_markdown_and_plots(smoke):
    out, report, printed = smoke
    rows = {r["method"]: r for r in report["methods"]}
    assert BASELINES <= set(rows)
    assert {n for n in rows if n.startswith("chain-")} == {"chain-1", "chain-2", "chain-4"}
    assert {n for n in rows if n.startswith("tree-")} == {"tree-d3k2n6", "tree-d4k4n12"}
    for name, row in rows.items():
        for key in FINITE_KEYS:
            assert isinstance(row[key], float) and math.isfinite(row[key]), (name, key, row[key])
        assert row["temperature"] == 0.0 and row["tokens"] > 0 and row["prompts"] == 2 * 2
        assert row["time_per_output_token_s"] > 0 and row["acceptance_length"] >= 1.0
        assert row["outputs_match_plain"] is True, (name, row["output_mismatches"])
        assert len(row["time_per_output_token_s_repeats"]) == 2
    assert rows["plain"]["speedup_vs_plain"] == 1.0
    assert len(rows["tree-d4k4n12"]["survival"]) == 4 and rows["plain"]["survival"] == []
    # the assistant is the target's own weights: it drafts and (greedy) every draft token is accepted
    assert rows["hf_assisted"]["acceptance_length"] > 1.5
    assert rows["hf_generate"]["acceptance_length"] == 1.0
    cond = report["conditions"]
    for key in ("cpu", "cpu_count", "torch", "transformers", "torch_threads", "dtype", "memory_method"):
        assert cond[key] not in (None, "")
    assert cond["torch_threads"] == 1 and cond["target"]["parameters"] > 0 and cond["assistant"]["parameters"] > 0
    assert report["config"]["max_new_tokens"] == 16
    markdown = (out / "bench.md").read_text()
    assert "| method | shape | tau | ms/token | speed-up |" in markdown
    for name in rows:
        assert f"| {name}" in markdown
    assert markdown in printed
    for png in ("survival.png", "time_per_token.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert (out / "config.yaml").is_file()


@pytest.mark.slow
def test_smoke_bench_tunes_on_tuning_prompts_and_selects_by_time_per_token(smoke):
    out, report, _ = smoke
    tuning = report["tuning"]
    assert {s["name"] for s in tuning["shapes"]} == {"none", "chain-1", "chain-2", "chain-4", "tree-d3k2n6",
                                                    "tree-d4k4n12"}  # none: plain decoding, one token a round
    plain = next(s for s in tuning["shapes"] if s["name"] == "none")
    assert plain["tree"] is None and plain["committed"] == 1.0
    assert tuning["context"]["prompts"].endswith("tuning.jsonl")
    assert {c["phase"] for c in tuning["schedule"]} == {"tuning"}
    assert "plain" in {c["method"] for c in tuning["schedule"]}
    best = min(tuning["shapes"], key=lambda s: (s["round_s"] / s["committed"], s["tree"] is not None))
    assert tuning["selected"]["best"] == best["name"]
    assert all(tuning["selected"][k] != "none" for k in tuning["selected"] if k != "best")
    selected = {r["method"]: r["selected_as"] for r in report["methods"] if r["selected_as"]}
    assert "best" in selected["plain" if best["name"] == "none" else best["name"]]  # none: plain's row
    assert load_tuned_shape(out / "shapes.json") == (None if best["tree"] is None else TreeConfig(**best["tree"]))


@pytest.mark.slow
def test_smoke_bench_interleaves_methods(smoke):
    _, report, _ = smoke
    names = [r["method"] for r in report["methods"]]
    calls = [c for c in report["schedule"] if c["phase"] == "test"]
    assert len(calls) == len(names) * 2 * 2  # methods x prompts x repeats
    blocks = [calls[i : i + len(names)] for i in range(0, len(calls), len(names))]
    for block in blocks:
        assert sorted(c["method"] for c in block) == sorted(names)
        assert len({(c["repeat"], c["prompt"]) for c in block}) == 1
    assert len({block[0]["method"] for block in blocks}) == len(blocks)  # a different method leads each block
    for name in names:  # no method runs all its calls back to back
        positions = [i for i, c in enumerate(calls) if c["method"] == name]
        assert positions[-1] - positions[0] > len(positions) - 1


def test_interleaved_schedule_rotates():
    """run_phase's block k = (repeat, prompt) = divmod(k, n_prompts) runs the methods in rotation(n, k)."""
    calls = [(*divmod(k, 2), m) for k in range(2 * 2) for m in rotation(3, k)]
    assert sorted(calls) == [(r, p, m) for r in range(2) for p in range(2) for m in range(3)]
    assert [m for _, _, m in calls[:6]] == [0, 1, 2, 1, 2, 0]
    assert [calls[i][2] for i in range(0, 12, 3)] == [0, 1, 2, 0]
    two = [(*divmod(k, 3), m) for k in range(2 * 3) for m in rotation(2, k)]  # 2 methods, 3 prompts, 2 repeats
    assert two[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0)]
    assert len(two) == 12 and two[-2:] == [(1, 2, 1), (1, 2, 0)]


@pytest.mark.slow
def test_decode_auto_uses_the_tuned_shape(smoke, assets):
    out, report, _ = smoke
    cfg = DecodeConfig(target=str(assets["target"]), head=str(assets["head"]), mode="auto",
                       shapes=str(out / "shapes.json"))
    decoder, _ = load_models(cfg)
    best = next(s for s in report["tuning"]["shapes"] if s["name"] == report["tuning"]["selected"]["best"])
    if best["tree"] is None:  # none: plain decoding
        assert decoder.draft is None and decoder.drafter is None
    else:
        assert decoder.tree == TreeConfig(**best["tree"])


def test_decode_auto_decodes_plainly_where_the_tuning_chose_none(assets, tmp_path):
    from eagle_tree.bench.tuning import ShapeMeasurement, save_tuned_shapes

    path = tmp_path / "shapes.json"
    chain = ShapeMeasurement(TreeConfig.chain(2), 0.030, 2.0)  # 15 ms / token
    cfg = DecodeConfig(target=str(assets["target"]), head=str(assets["head"]), mode="auto", shapes=str(path),
                       max_new_tokens=8)
    save_tuned_shapes(path, [ShapeMeasurement(None, 0.010, 1.0), chain])  # 10 ms / token: do not speculate
    decoder, _ = load_models(cfg)
    assert decoder.draft is None and decoder.drafter is None
    ids = torch.tensor([5, 6, 7])
    assert decoder.generate(ids, 8).acceptance_lengths == [1] * 7
    save_tuned_shapes(path, [ShapeMeasurement(None, 0.020, 1.0), chain])  # the other direction: the chain pays
    decoder, _ = load_models(cfg)
    assert decoder.tree == TreeConfig.chain(2) and decoder.draft is not None


def _models(assets, assistant_dir):
    from transformers import AutoModelForCausalLM

    decoder, tok = load_models(DecodeConfig(target=str(assets["target"]), head=None, mode="plain"))
    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir).eval()
    return BenchModels(decoder.target, tok, assistant=assistant)


def test_hf_rounds_are_counted_per_target_forward(assets, tmp_path):
    from eagle_tree.data.tiny import tiny_causal_lm

    models = _models(assets, assets["assistant"])
    ids = torch.tensor([models.tokenizer.encode("def main():\n    x =")])
    greedy = SamplingConfig(temperature=0.0)
    plain = hf_generate(models.target.model, ids, 12, greedy)
    assert plain.new_tokens == 12 and len(plain.rounds) == 11  # the prefill token is not a round
    assert all(r.committed == 1 and r.tree_size == 0 and r.draft_s == 0 for r in plain.rounds)
    assert plain.prefill_s > 0 and len(plain.token_times) == 12 and plain.total_s >= plain.token_times[-1]

    assisted = models.run(Method("hf_assisted", "hf", assistant=True), ids, 24, greedy, 0, None)
    assert torch.equal(assisted.sequences, hf_generate(models.target.model, ids, 24, greedy).sequences)
    from_prefill = sum(t == assisted.prefill_s for t in assisted.token_times)  # the prefill forward's tokens
    assert from_prefill >= 1 and assisted.new_tokens == from_prefill + sum(r.committed for r in assisted.rounds)
    assert all(r.tree_size > 0 and r.draft_s > 0 for r in assisted.rounds[:-1])
    # the assistant has the target's weights: every drafted token is accepted, so each round commits
    # the tokens it verified plus the bonus (the last round may be cut by the budget)
    assert all(r.committed == r.tree_size + 1 for r in assisted.rounds[:-1])

    fixed = _models(assets, assets["assistant"])
    fixed.assistant_tokens = 4  # a fixed draft length: no heuristic schedule, no confidence stop
    out = fixed.run(Method("hf_assisted", "hf", assistant=True), ids, 24, greedy, 0, None)
    assert [(r.tree_size, r.committed) for r in out.rounds[:-1]] == [(4, 5)] * (len(out.rounds) - 1)
    assert torch.equal(out.sequences, assisted.sequences)

    # negative control: a different assistant makes some rounds reject part of their draft
    other = tiny_causal_lm("llama", vocab_size=len(models.tokenizer), num_layers=1, seed=7)
    other.save_pretrained(tmp_path / "other")
    models = _models(assets, tmp_path / "other")
    rejected = models.run(Method("hf_assisted", "hf", assistant=True), ids, 24, greedy, 0, None)
    assert any(r.committed < r.tree_size + 1 for r in rejected.rounds)
    assert torch.equal(rejected.sequences, assisted.sequences)

    sampled = hf_generate(models.target.model, ids, 6, SamplingConfig(temperature=0.8, top_k=10, top_p=0.9), seed=3)
    again = hf_generate(models.target.model, ids, 6, SamplingConfig(temperature=0.8, top_k=10, top_p=0.9), seed=3)
    assert sampled.new_tokens == 6 and torch.equal(sampled.sequences, again.sequences)


def test_peak_memory_sees_an_allocation():
    with PeakMemory() as idle:
        pass
    with PeakMemory() as busy:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    assert busy.peak_bytes > 48 * 2**20
    assert idle.peak_bytes < 16 * 2**20


def _out(tokens, total_s, prompt=(5, 6)):
    seq = torch.tensor([[*prompt, *tokens]])
    rounds = [RoundStats(0, 1, 0, 0.0, total_s / len(tokens), 0.0) for _ in tokens[1:]]
    return GenerateOutput(seq, len(prompt), rounds=rounds, prefill_s=0.1, total_s=total_s,
                          token_times=[0.1 * (i + 1) for i in range(len(tokens))])


def test_method_rows_speedup_and_mismatch():
    other = Method("other", "eagle", tree=TreeConfig.chain(2))
    outputs = {
        "plain": [[_out([1, 2, 3, 4], 2.0), _out([1, 2], 1.0)], [_out([1, 2, 3, 4], 4.0), _out([1, 2], 2.0)]],
        "other": [[_out([1, 2, 3, 4], 1.0), _out([1, 9], 0.5)], [_out([1, 2, 3, 4], 1.0), _out([1, 9], 0.5)]],
    }
    result = PhaseResult("test", [PLAIN, other], outputs, {"plain": 0, "other": 2**20}, [], "linux_vmhwm")
    rows = {r["method"]: r for r in method_rows(result, SamplingConfig(temperature=0.0))}
    assert rows["plain"]["outputs_match_plain"] is True and rows["plain"]["speedup_vs_plain"] == 1.0
    assert rows["other"]["outputs_match_plain"] is False
    assert rows["other"]["output_mismatches"] == [{"repeat": 0, "prompt": 1}, {"repeat": 1, "prompt": 1}]
    assert rows["other"]["speedup_vs_plain"] == pytest.approx(3.0)  # median of 2x and 4x
    assert rows["other"]["time_per_output_token_s"] == pytest.approx(1.5 / 6)
    # after the first token (prefill 0.1 s each): other (0.9 + 0.4) / 4 in both repeats; plain's median of
    # (1.9 + 0.9) / 4 and (3.9 + 1.9) / 4
    assert rows["other"]["decode_time_per_token_s"] == pytest.approx(1.3 / 4)
    assert rows["plain"]["decode_time_per_token_s"] == pytest.approx((2.8 / 4 + 5.8 / 4) / 2)
    assert rows["other"]["speedup_vs_hf_generate"] is None and rows["other"]["peak_memory_mb"] == 1.0
    sampled = {r["method"]: r for r in method_rows(result, SamplingConfig(temperature=0.7))}
    assert sampled["other"]["outputs_match_plain"] is None


def test_bench_configs_load():
    smoke = load_config(BenchConfig, SMOKE)
    assert smoke.tiny_assets and smoke.wandb.mode == "disabled" and smoke.sampling.temperature == 0.0
    ref = load_config(BenchConfig, ROOT / "configs" / "bench-reference.yaml")
    assert ref.target == "assets/reference/target" and ref.assistant == "assets/reference/assistant"
    assert ref.head == "assets/reference/head" and ref.tiny_assets is None
    assert ref.tuning_prompts.endswith("tuning.jsonl") and ref.test_prompts.endswith("test.jsonl")
    assert len(ref.trees) >= 2 and len(ref.chain_lengths) >= 3


@pytest.mark.parametrize("given", [[], ["--config", str(SMOKE)]])
def test_bench_recipe_defaults_to_the_reference_config(given, monkeypatch):
    import runpy

    import eagle_tree.commands.bench as command

    seen = []
    monkeypatch.setattr(command, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr("sys.argv", ["decode/bench.py", *given, "repeats=5"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "decode" / "bench.py"), run_name="__main__")
    assert exit_info.value.code == 0
    expected = given or ["--config", "configs/bench-reference.yaml"]
    assert seen == [[*expected, "repeats=5"]]


def test_reported_shapes_all_selected_and_head_only():
    from eagle_tree.bench.tuning import ShapeMeasurement, selection
    from eagle_tree.commands.bench import reported_shapes
    from eagle_tree.decoding.context import ContextConfig

    ctx = ContextConfig(lookup_tokens=8)
    # C / K per shape: the chain with context is the best of all, then the tree with context
    times = {"chain-4": 0.10, "tree-d3k2n6": 0.11, "chain-4+ctx8": 0.05, "tree-d3k2n6+ctx8": 0.06, "ctx8": 0.07}
    trees = [TreeConfig.chain(4), TreeConfig(depth=3, top_k=2, total_tokens=6),
             TreeConfig(depth=4, top_k=1, total_tokens=4, context=ctx),
             TreeConfig(depth=3, top_k=2, total_tokens=6, context=ctx), TreeConfig.context_only(ctx)]
    measured = [ShapeMeasurement(t, round_s=times[t.name], committed=1.0) for t in trees]
    chosen = selection(measured)
    names = {mode: [t.name for t in reported_shapes(mode, chosen, trees)] for mode in ("all", "selected", "head_only")}
    assert names["all"] == [t.name for t in trees]
    assert names["selected"] == ["chain-4+ctx8", "tree-d3k2n6+ctx8", "chain-4", "tree-d3k2n6"]
    assert names["head_only"] == ["chain-4", "tree-d3k2n6"]  # no context branch, no context-only shape
    # without context settings the best chain and tree are the head-only ones
    plain = [m for m in measured if m.tree.context is None]
    assert [t.name for t in reported_shapes("head_only", selection(plain), trees[:2])] == ["chain-4", "tree-d3k2n6"]
    with pytest.raises(ValueError, match="head_only"):
        reported_shapes("best", chosen, trees)


def test_decode_time_per_token_leaves_out_the_prefill_and_first_tokens():
    from eagle_tree.decoding.metrics import decode_time_per_token, summarize

    short, long = _out([1, 2, 3, 4], 1.0), _out([1, 2, 3, 4], 1.0)
    long.prefill_s, long.total_s = 0.5, 1.4  # a longer prompt: 0.4 s more prefill, the same decoding after it
    assert decode_time_per_token([short]) == pytest.approx(0.9 / 3)
    assert decode_time_per_token([long]) == pytest.approx(0.9 / 3)
    assert summarize("m", 0.0, [long]).time_per_output_token_s == pytest.approx(1.4 / 4)  # moves with the prefill
    assert summarize("m", 0.0, [short, long]).decode_time_per_token_s == pytest.approx(1.8 / 6)
    single = _out([7], 0.3)  # one token: all prefill, nothing after it, so it adds neither time nor tokens
    assert decode_time_per_token([short, single]) == pytest.approx(0.9 / 3)
    assert math.isnan(decode_time_per_token([single]))
