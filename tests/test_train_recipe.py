"""The training recipe's options on the toy target: a time budget (schedule.max_minutes), the copying check
beside the held-out prompts, held-out top-1 agreement, a head initialised from the target, deeper feature
layers; all read back from the run summary and the offline W&B run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eagle_tree.commands.train import main
from eagle_tree.data.copying import COPY_STYLES, copy_prompts
from eagle_tree.data.toy import default_cache_dir
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.loop import BUDGET_PROBE_STEPS
from eagle_tree.utils.config import ConfigError, load_config
from eagle_tree.utils.optim import lambda_schedule, lr_factor
from tests.helpers import PastKV
from tests.wandb_records import read_run

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TOY_CACHE = str(default_cache_dir())
REFERENCE_TOKENIZER = ROOT / "assets" / "reference" / "target"


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    out = home / "run"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
            mp.delenv(name, raising=False)
        mp.setenv("HOME", str(home))
        mp.setenv("WANDB_DIR", str(home))
        args = ["--config", str(SMOKE), f"output_dir={out}", f"target.toy_cache_dir={TOY_CACHE}", "progress=false",
                "schedule.max_minutes=0.05", "eval.every=0", "eval.at_start=true", "eval.num_prompts=2",
                "eval.max_new_tokens=12", "eval.copy_prompts=toy", "eval.copy_num_prompts=2",
                "eval.copy_max_new_tokens=12", "checkpoint.every=0", "model.init=target",
                "target.feature_layers=[1, 2, 3]"]
        assert main(args) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    runs = list((home / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    return out, summary, read_run(runs[0])


@pytest.mark.slow
def test_max_minutes_is_resolved_to_steps_and_recorded(budget_run):
    out, summary, run = budget_run
    budget = summary["budget"]
    assert budget["max_minutes"] == 0.05 and budget["timed_steps"] == BUDGET_PROBE_STEPS - 1
    assert budget["resolved_steps"] == max(BUDGET_PROBE_STEPS, int(0.05 * 60 / budget["measured_step_s"]))
    assert summary["steps"] == budget["resolved_steps"] > 3
    # the budget holds the optimiser steps: their time is within a few steps of it
    assert abs(summary["train_s"] - 3.0) < 3 * budget["measured_step_s"] + 1.0
    assert run.summary["run/total_steps"] == budget["resolved_steps"]
    head_config = json.loads((out / "final" / "config.json").read_text())
    assert head_config["feature_layers"] == [1, 2, 3]


@pytest.mark.slow
def test_copy_check_and_agreement_are_logged_beside_the_prompts(budget_run):
    _, summary, run = budget_run
    steps = [0, summary["steps"]]
    for key in ("eval/acceptance_length_chain", "eval/acceptance_length_tree", "eval/acceptance_length_copy_chain"):
        series = run.series(key)
        assert [s for s, _ in series] == steps, key
        assert all(math.isfinite(v) and v >= 1.0 for _, v in series), key
    assert run.summary["eval/acceptance_length_copy_chain"] == pytest.approx(
        summary["evals"][-1]["acceptance_length_copy_chain"])
    for s in range(5):  # ttt.steps of configs/smoke.yaml
        series = run.series(f"eval/acc_{s}")
        assert [st for st, _ in series] == steps and all(0.0 <= v <= 1.0 for _, v in series)
        sampled = run.series(f"eval/sampled_acc_{s}")
        assert [st for st, _ in sampled] == steps and all(0.0 < v < 1.0 for _, v in sampled)
    assert summary["evals"][-1]["overlap"] == pytest.approx([run.summary[f"eval/sampled_acc_{s}"] for s in range(5)])
    minutes = run.series("eval/train_minutes")
    assert minutes[0][1] == 0.0 and minutes[-1][1] == pytest.approx(summary["train_s"] / 60)


def test_copy_prompts_repeat_spans_of_the_reference_tokenizer_deterministically():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REFERENCE_TOKENIZER)
    prompts = copy_prompts("code", 8)
    assert prompts == copy_prompts("code", 8) and prompts != copy_prompts("code", 8, seed=1)
    for text in prompts:
        ids = tok(text)["input_ids"]
        span = ids[-24:-16]  # 8 tokens from the end: seen earlier at least twice (the context holds the span)
        occurrences = sum(ids[i:i + 8] == span for i in range(len(ids) - 8))
        assert occurrences >= 2, text
    for style in COPY_STYLES:
        assert len(set(copy_prompts(style, 8))) == 8
    with pytest.raises(ValueError, match="unknown copying style"):
        copy_prompts("prose")


def test_recipe_options_are_checked_in_the_config():
    with pytest.raises(ConfigError, match="feature_layers"):
        load_config(TrainConfig, None, ["target.feature_layers=[5, 2, 7]"])
    with pytest.raises(ConfigError, match="init_parts"):
        load_config(TrainConfig, None, ["model.init_parts=[lm_head, attention]"])
    with pytest.raises(ConfigError, match="max_minutes"):
        load_config(TrainConfig, None, ["schedule.max_minutes=0"])
    with pytest.raises(ConfigError, match="max_minutes"):
        load_config(TrainConfig, None, ["schedule.max_minutes=5", "schedule.epochs=1"])
    cfg = load_config(TrainConfig, None, ["model.init=target", "target.feature_layers=[2, 4, 7]"])
    assert cfg.model.init == "target" and cfg.target.feature_layers == [2, 4, 7]


def test_schedule_reads_a_step_count_resolved_later():
    import torch

    total = {"n": 10**9}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lambda_schedule(opt, 2, lambda: total["n"], "cosine", 0.1)
    for _ in range(3):
        opt.step()
        sched.step()
    total["n"] = 10
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(4, 2, 10, "cosine", 0.1))


@pytest.mark.slow
def test_resume_keeps_the_step_count_resolved_from_the_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "run"
    base = ["--config", str(SMOKE), f"output_dir={out}", f"target.toy_cache_dir={TOY_CACHE}", "progress=false",
            "schedule.max_minutes=0.06", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
            "checkpoint.every=6", "checkpoint.keep_last=null", "wandb.mode=disabled"]
    assert main(base) == 0
    first = json.loads((out / "train_summary.json").read_text())
    resolved = first["budget"]["resolved_steps"]
    assert resolved >= 12  # a checkpoint after the timing and before the end
    assert main([*base, f"resume={out / 'checkpoints' / 'step-6'}"]) == 0
    second = json.loads((out / "train_summary.json").read_text())
    assert second["budget"] == first["budget"] and second["steps"] == resolved


def test_heldout_agreement_counts_the_continuation_positions_only():
    """Step-0 agreement recomputed directly: the head's prediction at j (feature j, token j+1) against the target's
    top token for j+2, over the positions j+2 >= start whose target top token is in the draft vocabulary."""
    import torch

    from eagle_tree.data.tiny import tiny_causal_lm
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.models.target import TargetModel
    from eagle_tree.training.evaluate import heldout_agreement
    from eagle_tree.training.feature_cache import example_targets

    target = TargetModel(tiny_causal_lm("llama", initializer_range=0.1), feature_layers=(1, 2, 3))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    features, logits = example_targets(target, ids)
    # a draft vocabulary of the target's 3 most frequent top tokens here: agreement well above 0 by chance alone
    frequent = logits.argmax(-1).bincount(minlength=128).topk(3).indices
    head = Eagle3DraftModel.from_target(target, draft_vocab=frequent, init="target")
    t = ids.shape[0]
    with torch.no_grad():
        mask = torch.ones(1, 1, t - 1, t - 1, dtype=torch.bool).tril()
        _, draft_logits = head.step(head.fuse(features[None, : t - 1]), ids[None, 1:],
                                    torch.arange(t - 1)[None], PastKV(), mask)
    guess = head.draft_to_target[draft_logits[0].argmax(-1)]  # (T-1,): guess for token j+2 at position j
    top = logits.argmax(-1)  # top[j + 1]: the target's next token after j+1, i.e. token j+2
    for start in (0, 25):
        js = [j for j in range(t - 2) if j + 2 >= start and bool(head.t2d[top[j + 1]])]
        expected = sum(int(guess[j] == top[j + 1]) for j in js) / len(js)
        got = heldout_agreement(target, head, [(ids, start)], steps=2)[0]
        assert got == pytest.approx(expected), start
        assert 0.0 < got < 1.0
    assert heldout_agreement(target, head, [(ids, 0)], 1) != heldout_agreement(target, head, [(ids, 25)], 1)
