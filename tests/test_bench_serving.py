"""`eagle-tree bench serving`: config checks, the sweep's figures, tuned shapes and crossover, the
Hugging Face batched baseline, and smoke runs of the command.

Two kinds of smoke run: ``test_smoke_run_with_fake_decoders`` runs the whole command on tiny models
with :class:`FakeDecoder` standing in for eagle-tree's batched engine (a virtual clock with a known
cost model, so the tuned shapes and the crossover are predictable); the Hugging Face baseline in it is
real. ``test_smoke_run_with_the_batched_engine`` runs the same command on eagle-tree's real
``SpeculativeDecoder.generate_batch`` / ``serve`` (skipped where the engine lacks them).
"""

import contextlib
import io
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle_tree.bench import hf as hf_module
from eagle_tree.bench.hf import hf_generate, hf_generate_batch, left_pad
from eagle_tree.bench.runner import BenchModels
from eagle_tree.bench.serving import (
    Sweep,
    batch_figures,
    context_prompts,
    output_budgets,
    parse_method,
    parse_shape,
    poisson_arrivals,
)
from eagle_tree.bench.tuning import NONE, crossover_batch_size, pick_tuned
from eagle_tree.cli import main as cli_main
from eagle_tree.commands.bench_serving import QUICK, ServingBenchConfig
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.data.tiny import build_tiny_assets
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.metrics import quantile
from eagle_tree.decoding.rounds import BatchOutput, RequestResult
from eagle_tree.utils.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "bench-serving.yaml"
GREEDY = SamplingConfig(temperature=0.0)


# ---------------------------------------------------------------------------------- a fake engine


class FakeDecoder:
    """The batched engine's API on a virtual clock. Cost model: a round over B rows with a draft of n
    tokens takes ``4 + B * (1 + n)`` ms and commits ``1 + depth // 2`` tokens per row; a prefill takes
    ``2 + B`` ms. Row tokens: (sum of the prompt + k) mod 97, the same for every shape (``wrong=True``
    changes them: a negative control of the output comparison)."""

    def __init__(self, tree: TreeConfig | None, wrong: bool = False):
        self.tree, self.wrong = tree, wrong
        self.n = 0 if tree is None else tree.total_tokens
        self.per_round = 1 if tree is None else 1 + tree.depth // 2

    def _token(self, prompt, k):
        return (int(prompt.sum()) + k + (7 if self.wrong else 0)) % 97

    def _round_s(self, rows):
        return (4 + rows * (1 + self.n)) / 1000

    def generate_batch(self, prompts, max_new_tokens, sampling=None, seed=0, eos_token_id=None):
        from eagle_tree.decoding.rounds import Request

        return self.serve([Request(p, max_new_tokens) for p in prompts], max_batch=len(prompts))

    def serve(self, requests, max_batch, sampling=None, seed=0, eos_token_id=None):
        clock, queue, active, done = 0.0, list(range(len(requests))), {}, {}
        while queue or active:
            arrived = [i for i in queue if requests[i].arrival_s <= clock][: max_batch - len(active)]
            if not arrived and not active:
                clock = requests[queue[0]].arrival_s
                continue
            if arrived:  # FIFO admission between rounds, newcomers prefilled as one batch
                admitted = clock
                clock += (2 + len(arrived)) / 1000
                for i in arrived:
                    queue.remove(i)
                    active[i] = {"admitted": admitted, "times": [clock], "lengths": []}
            else:
                clock += self._round_s(len(active))
                for state in active.values():
                    state["lengths"].append(self.per_round)
                    state["times"] += [clock] * self.per_round
            for i in list(active):
                state = active[i]
                if len(state["times"]) >= requests[i].max_new_tokens:
                    cut = len(state["times"]) - requests[i].max_new_tokens
                    if cut:
                        state["times"] = state["times"][:-cut]
                        state["lengths"][-1] -= cut
                    done[i] = active.pop(i)
        results = []
        for i, req in enumerate(requests):
            state = done[i]
            tokens = [self._token(req.prompt, k) for k in range(len(state["times"]))]
            results.append(RequestResult(
                sequence=torch.cat([req.prompt, torch.tensor(tokens)]), prompt_length=len(req.prompt),
                acceptance_lengths=state["lengths"], arrival_s=req.arrival_s, admitted_s=state["admitted"],
                first_token_s=state["times"][0], finish_s=state["times"][-1], token_times=state["times"],
                stopped_by="length"))
        return BatchOutput(results=results, total_s=clock)


def fake_models(wrong: set[str] = frozenset()) -> BenchModels:
    models = BenchModels(target=SimpleNamespace(device=torch.device("cpu")), tokenizer=None)
    models.decoder = lambda tree, use_head=None: FakeDecoder(tree, wrong=tree is not None and tree.name in wrong)
    return models


def _result(times, arrival=0.0, admitted=0.0, prompt=(5, 6), lengths=None, stopped="length"):
    seq = torch.tensor([*prompt, *range(len(times))])
    return RequestResult(sequence=seq, prompt_length=len(prompt), acceptance_lengths=lengths or [1] * (len(times) - 1),
                         arrival_s=arrival, admitted_s=admitted, first_token_s=times[0], finish_s=times[-1],
                         token_times=list(times), stopped_by=stopped)


# ---------------------------------------------------------------------------------- config


def test_config_loads_and_quick_shrinks_it():
    cfg = load_config(ServingBenchConfig, CONFIG)
    assert cfg.batch_sizes == [1, 2, 4, 8, 16] and cfg.contexts == [128, 900]
    assert cfg.output_budgets == [32, 128, 512] and NONE in cfg.candidates
    assert {"plain", "tuned", "hf_generate"} <= set(cfg.methods)
    assert cfg.target == "assets/reference/target" and cfg.head == "assets/reference/head"
    assert cfg.tuning_prompts.endswith("tuning.jsonl") and cfg.test_prompts.endswith("test.jsonl")
    quick = load_config(ServingBenchConfig, CONFIG, ["quick=true"])
    assert quick.batch_sizes == QUICK["batch_sizes"] and quick.contexts == QUICK["contexts"]
    shapes = [m for m in cfg.methods if parse_method(m) is not None and parse_method(m).tree is not None]
    assert quick.candidates == [NONE, *shapes]


@pytest.mark.parametrize("override, message", [
    ("batch_sizes=[1, 0]", "batch_sizes[1] must be an integer >= 1"),
    ("batch_sizes=[2, 2]", "lists a value twice"),
    ("batch_sizes=[]", "must list at least one value"),
    ("methods=[plain, beam]", "unknown method 'beam'"),
    ("methods=[plain, tree-d4k4]", "unknown method 'tree-d4k4'"),
    ("candidates=[none, chain-0]", "candidates[1]"),
    ("contexts=[128, -5]", "contexts[1] must be an integer >= 1"),
    ("arrival_rates=[0]", "arrival_rates[0]"),
    ("load_max_batch=3", "load_max_batch must be one of batch_sizes"),
])
def test_config_rejects_bad_values(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ServingBenchConfig, CONFIG, [override])


def test_context_longer_than_positions_is_refused(tmp_path, capsys):
    rc = cli_main(["bench", "serving", "--config", str(CONFIG), "contexts=[128, 1024]", "load_context=128",
                     f"output_dir={tmp_path / 'out'}", "progress=false"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "a 1024-token prompt leaves no room for output in the target's 1024 positions" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_shape_names_round_trip():
    for tree in (TreeConfig.chain(3), TreeConfig(depth=4, top_k=4, total_tokens=16),
                 TreeConfig(depth=3, top_k=2, total_tokens=10, sampled=True)):
        assert parse_shape(tree.name) == tree
    assert parse_shape("none") is None
    assert parse_shape("chain-1+ctx8").context.lookup_tokens == 8
    assert parse_method("plain").tree is None and parse_method("hf_generate").kind == "hf"
    assert parse_method("tuned") is None
    with pytest.raises(ValueError, match="not a draft shape"):
        parse_shape("tree-d4k1n4")  # a chain spelled as a tree: one name per shape


# ---------------------------------------------------------------------------------- figures


def test_quantile_matches_torch_quantile():
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.4]
    for q in (0.0, 0.5, 0.95, 1.0):
        assert quantile(values, q) == pytest.approx(float(torch.quantile(torch.tensor(values), q)))
    assert quantile([], 0.5) is None and quantile([2.0], 0.95) == 2.0


def test_batch_figures_on_known_results():
    a = _result([1.0, 1.0, 2.0, 3.0], arrival=0.5, admitted=0.8, lengths=[2, 1])  # burst of 2, then 1, 1
    b = _result([2.0, 4.0], arrival=0.0, admitted=0.0, lengths=[1])
    figures = batch_figures([BatchOutput([a], total_s=3.0), BatchOutput([b], total_s=5.0)])
    assert figures["new_tokens"] == 6 and figures["throughput_tok_s"] == pytest.approx(6 / 8)
    assert figures["ttft_mean_s"] == pytest.approx((0.5 + 2.0) / 2)
    assert figures["latency_mean_s"] == pytest.approx((2.5 + 4.0) / 2)
    assert figures["latency_p95_s"] == pytest.approx(2.5 + 0.95 * 1.5)
    assert figures["tpot_mean_s"] == pytest.approx((2.0 / 3 + 2.0) / 2)
    assert figures["gap_p50_s"] == pytest.approx(1.0)  # gaps 0, 1, 1, 2
    assert figures["gap_p95_s"] == pytest.approx(1.0 + 0.85 * 1.0)
    assert figures["acceptance_length"] == pytest.approx(4 / 3)
    assert figures["queue_mean_s"] == pytest.approx(0.15)


def test_pick_tuned_and_crossover():
    assert pick_tuned({"none": 10.0, "chain-2": 12.0, "tree-d3k2n6": 11.0}) == "chain-2"
    assert pick_tuned({"none": 10.0, "chain-2": 10.0}) == "none"  # a tie: the first listed
    assert crossover_batch_size({1: "chain-2", 2: "chain-1", 4: NONE, 8: NONE}) == 4
    assert crossover_batch_size({1: "chain-2", 4: NONE, 8: "chain-1"}) is None  # speculation wins at the largest
    assert crossover_batch_size({1: NONE, 2: NONE}) == 1
    assert crossover_batch_size({1: "tree-d3k2n6", 16: "chain-1"}) is None


def test_tuning_picks_by_throughput_and_finds_the_crossover():
    """Under FakeDecoder's cost model chain-2 beats plain below batch 4 and loses above it."""
    prompts = [torch.tensor([i + 3, i + 4]) for i in range(8)]
    sweep = Sweep(fake_models(), GREEDY)
    tuning = sweep.tune(["none", "chain-2"], prompts, [1, 2, 8], max_new_tokens=61)
    assert tuning["tuned"] == {1: "chain-2", 2: "chain-2", 8: NONE}
    assert tuning["crossover_batch_size"] == 8
    assert tuning["throughput"][1]["chain-2"] > tuning["throughput"][1]["none"]


def test_cells_reuse_the_tuned_row_and_catch_a_mismatch():
    prompts = [torch.tensor([i + 3, i + 4, i + 5]) for i in range(8)]
    sweep = Sweep(fake_models(wrong={"chain-1"}), GREEDY, repeats=2, warmup_tokens=2)
    rows = sweep.cells(["plain", "chain-2", "chain-1", "tuned"], prompts, [1, 4], 10,
                       tuned={1: "chain-2", 4: "tree-d2k2n4"})
    by = {(r["batch_size"], r["method"]): r for r in rows}
    assert len(rows) == 8 and by[1, "tuned"]["reused_from"] == "chain-2" and by[1, "tuned"]["shape"] == "chain-2"
    assert by[4, "tuned"]["reused_from"] is None and by[4, "tuned"]["shape"] == "tree-d2k2n4"
    assert by[4, "chain-2"]["requests"] == 8 and by[4, "chain-2"]["new_tokens"] == 8 * 10
    assert by[1, "plain"]["throughput_vs_plain"] == 1.0 and by[1, "plain"]["acceptance_length"] == 1.0
    assert by[1, "chain-2"]["acceptance_length"] == pytest.approx(9 / 5)  # 9 tokens after the first: 2,2,2,2,1
    assert by[4, "chain-2"]["outputs_match_plain"] is True
    assert by[4, "chain-1"]["outputs_match_plain"] is False and by[4, "chain-1"]["mismatched_requests"] == 8
    sampled = Sweep(fake_models(), SamplingConfig(temperature=0.7)).cells(["plain", "chain-2"], prompts, [2], 4)
    assert all(r["outputs_match_plain"] is None for r in sampled)


def test_load_counts_queueing():
    prompts = [torch.tensor([i + 3, i + 4]) for i in range(6)]
    sweep = Sweep(fake_models(), GREEDY, seed=3)
    slow, fast = sweep.load(["plain", "hf_generate"], prompts, [0.5, 1000.0], max_new_tokens=8, max_batch=2)
    assert slow["method"] == fast["method"] == "plain"  # hf_generate has no continuous batching
    assert fast["queue_mean_s"] > slow["queue_mean_s"] >= 0 and fast["ttft_mean_s"] > slow["ttft_mean_s"]
    assert poisson_arrivals(6, 0.5, 3) == poisson_arrivals(6, 0.5, 3)
    many = poisson_arrivals(4000, 5.0, 0)
    assert all(b > a for a, b in zip(many, many[1:], strict=False)) and many[-1] / 4000 == pytest.approx(0.2, rel=0.05)


def test_output_budgets_are_capped_to_the_positions():
    plan = output_budgets([128, 900], [32, 128, 512], 1024)
    assert [e["budget"] for e in plan[128]] == [32, 128, 512] and not any(e["capped"] for e in plan[128])
    assert plan[900] == [{"budget": 32, "asked": [32], "capped": False},
                         {"budget": 124, "asked": [128, 512], "capped": True}]
    with pytest.raises(ValueError, match="no position for output"):
        output_budgets([1024], [32], 1024)


def test_context_prompts_have_the_exact_length():
    from eagle_tree.data.tiny import char_tokenizer

    tok = char_tokenizer()
    texts = ["abc", "defgh", "ij"]
    prompts = context_prompts(tok, texts, 4, 12)
    assert all(p.shape == (12,) for p in prompts)
    assert tok.decode(prompts[0]) == "abc\n\ndefgh\n\n" and tok.decode(prompts[1]) == "defgh\n\nij\n\na"
    assert tok.decode(prompts[3]).startswith("abc")  # wraps around the file
    with pytest.raises(ValueError, match="vocabulary"):
        context_prompts(tok, texts, 1, 12, vocab_size=50)


# ---------------------------------------------------------------------------------- HF baseline


@pytest.fixture(scope="module")
def tiny_lm():
    from eagle_tree.data.tiny import tiny_causal_lm

    return tiny_causal_lm("llama", vocab_size=96, num_layers=2, attn_implementation="sdpa", initializer_range=0.2)


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g) for n in lengths]


def test_hf_batch_matches_per_prompt_generate(tiny_lm):
    prompts = _prompts((5, 11, 3, 8))
    out = hf_generate_batch(tiny_lm, prompts, 10, GREEDY, pad_token_id=0)
    for prompt, result in zip(prompts, out.results, strict=True):
        alone = hf_generate(tiny_lm, prompt[None], 10, GREEDY)
        assert torch.equal(result.sequence, alone.sequences[0])
        assert result.new_tokens == 10 and len(result.token_times) == 10 and result.acceptance_lengths == [1] * 9
        assert 0 < result.first_token_s <= result.finish_s <= out.total_s and result.stopped_by == "length"
        assert all(g > 0 for g in result.gaps)
    assert out.throughput == pytest.approx(40 / out.total_s)
    # every row's k-th token came out in the same step
    assert all(r.token_times == out.results[0].token_times for r in out.results)


def test_hf_batch_rows_stop_at_their_own_eos(tiny_lm):
    prompts = _prompts((4, 9, 6), seed=2)
    free = hf_generate_batch(tiny_lm, prompts, 12, GREEDY, pad_token_id=0)
    eos = int(free.results[1].sequence[9 + 3])  # row 1's fourth new token
    out = hf_generate_batch(tiny_lm, prompts, 12, GREEDY, eos_token_id=eos, pad_token_id=0)
    for prompt, result in zip(prompts, out.results, strict=True):
        alone = hf_generate(tiny_lm, prompt[None], 12, GREEDY, eos_token_id=eos)
        assert torch.equal(result.sequence, alone.sequences[0])
    assert out.results[1].stopped_by == "eos" and out.results[1].new_tokens <= 4
    assert out.results[1].finish_s < max(r.finish_s for r in out.results) or all(
        r.stopped_by == "eos" for r in out.results)


def test_hf_batch_negative_control_right_padding_breaks_it(tiny_lm, monkeypatch):
    """The comparison above fails when the padding is put on the wrong side."""
    def right_pad(prompts, pad):
        ids, mask = left_pad(prompts, pad)
        return ids.flip(1), mask.flip(1)  # reversed prompts, pads last: wrong on both counts

    prompts = _prompts((5, 11, 3, 8))
    monkeypatch.setattr(hf_module, "left_pad", right_pad)
    out = hf_generate_batch(tiny_lm, prompts, 6, GREEDY, pad_token_id=0)
    alone = [hf_generate(tiny_lm, p[None], 6, GREEDY).sequences[0] for p in prompts]
    assert any(not torch.equal(r.sequence, a) for r, a in zip(out.results, alone, strict=True))


def test_hf_batch_sampling_is_seeded(tiny_lm):
    prompts = _prompts((4, 7))
    warm = SamplingConfig(temperature=0.9, top_k=20)
    a = hf_generate_batch(tiny_lm, prompts, 8, warm, seed=5, pad_token_id=0)
    b = hf_generate_batch(tiny_lm, prompts, 8, warm, seed=5, pad_token_id=0)
    c = hf_generate_batch(tiny_lm, prompts, 8, warm, seed=6, pad_token_id=0)
    assert all(torch.equal(x, y) for x, y in zip(a.sequences, b.sequences, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(a.sequences, c.sequences, strict=True))


# ---------------------------------------------------------------------------------- smoke runs


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_tiny_assets(tmp_path_factory.mktemp("serving") / "assets")


def _smoke(assets, out, extra=()):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cli_main(["bench", "serving", "--config", str(CONFIG), "quick=true", f"output_dir={out}",
                       f"tiny_assets={assets['target'].parent}", "progress=false", "threads=1", *extra])
    assert rc == 0
    return json.loads((out / "serving.json").read_text()), (out / "serving.md").read_text(), printed.getvalue()


def _check_report(report, markdown, out, real_engine):
    cfg = report["config"]
    methods = cfg["methods"]
    assert len(report["cells"]) == len(QUICK["batch_sizes"]) * len(methods)
    for row in report["cells"]:
        assert row["context"] == 128 and row["output_budget"] == 16 and row["new_tokens"] == 16 * row["requests"]
        for key in ("throughput_tok_s", "ttft_mean_s", "latency_mean_s", "latency_p95_s", "tpot_mean_s",
                    "gap_p50_s", "gap_p95_s", "acceptance_length"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] >= 0, (row["method"], key)
        if real_engine or row["kind"] == "eagle":  # the fake's tokens are not the tiny target's
            assert row["outputs_match_plain"] is True, row
        assert f"| {row['batch_size']} | {row['method']}" in markdown
    assert set(report["tuning"]["128"]["tuned"]) == {"1", "2"}
    load = report["load"]["rows"]
    assert [r["method"] for r in load] == [m for m in methods if m != "hf_generate"]
    assert all(r["requests"] == QUICK["load_requests"] and r["queue_mean_s"] >= 0 for r in load)
    assert "FIFO admission between rounds" in markdown and "Tuned shape per batch size" in markdown
    for png in ("throughput.png", "latency_p95.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["run_s"] > 0 and (out / "config.yaml").is_file()


def test_smoke_run_with_fake_decoders(assets, tmp_path, monkeypatch):
    """The command end to end; FakeDecoder stands in for eagle-tree's batched engine, HF generate is real."""
    monkeypatch.setattr(BenchModels, "decoder", lambda self, tree, use_head=None: FakeDecoder(tree))
    out = tmp_path / "out"
    report, markdown, printed = _smoke(assets, out)
    _check_report(report, markdown, out, real_engine=False)
    assert markdown in printed
    hf = [r for r in report["cells"] if r["method"] == "hf_generate"]
    assert hf and all(r["acceptance_length"] == 1.0 for r in hf)


def test_smoke_run_with_the_batched_engine(assets, tmp_path):
    """The command end to end on the real engine (tiny random target, untrained head)."""
    out = tmp_path / "out"
    report, markdown, _ = _smoke(assets, out)
    _check_report(report, markdown, out, real_engine=True)


def test_smoke_run_on_a_prepacked_target(assets, tmp_path):
    """target_prepack reaches the serving bench's target: its linear layers are packed, and batched
    eagle-tree outputs still equal batched plain decoding on the same target."""
    from eagle_tree.commands.bench_serving import ServingBenchConfig, load_models
    from eagle_tree.models.prepack import PackedLinear, prepack_available

    if not prepack_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    cfg = ServingBenchConfig(target=str(assets["target"]), head=str(assets["head"]), target_prepack=True)
    packed = [m for m in load_models(cfg).target.model.modules() if isinstance(m, PackedLinear)]
    assert packed  # the negative control is the default: test_smoke_run_with_the_batched_engine has none
    out = tmp_path / "out"
    report, markdown, _ = _smoke(assets, out, ["target_prepack=true"])
    assert report["config"]["target_prepack"] is True
    _check_report(report, markdown, out, real_engine=True)
