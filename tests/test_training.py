"""`eagle-tree train` end to end on the toy target: W&B keys, checkpoint layout, the trained head's real
acceptance length against an untrained head's, schedules, precision fallback, config schema."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eagle_tree as et
from eagle_tree.commands.train import main
from eagle_tree.data.toy import default_cache_dir
from eagle_tree.training.checkpoint import latest_checkpoint
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.data import batches
from eagle_tree.training.evaluate import evaluate_acceptance
from eagle_tree.training.loop import resolve_mixed_precision, train
from eagle_tree.training.stream import DataStream
from eagle_tree.utils.config import load_config
from eagle_tree.utils.optim import lr_factor
from tests.wandb_records import read_run

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TOY_CACHE = str(default_cache_dir())  # read once, before any test changes HOME
TTT_STEPS = 5  # configs/smoke.yaml
# Trained minus untrained committed tokens per round (greedy, held-out toy prompts). An untrained head
# proposes a near-random token from 48 (chance acceptance ~1/48, so about 1.02 tokens per round); the
# trained head reached 2.2 (chain) / 3.0 (tree) after 150 steps when this test was written. 0.5 is far
# beyond what chance or an off-by-one in training could give, with room for BLAS / machine differences.
MARGIN = 0.5


def quiet_env(monkeypatch, home: Path) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_DIR", str(home))


def smoke_args(out: Path, *extra: str) -> list[str]:
    return ["--config", str(SMOKE), f"output_dir={out}", f"target.toy_cache_dir={TOY_CACHE}", "progress=false",
            *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One smoke run of 150 steps, W&B offline: evaluations at steps 0, 75 and 150, checkpoints every 75."""
    home = tmp_path_factory.mktemp("home")
    out = home / "run"
    with pytest.MonkeyPatch.context() as mp:
        quiet_env(mp, home)
        args = smoke_args(out, "schedule.max_steps=150", "eval.every=75", "checkpoint.every=75",
                          "checkpoint.keep_last=1", "wandb.name=smoke-test")
        assert main(args) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    runs = list((home / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    return out, summary, read_run(runs[0])


@pytest.mark.slow
def test_wandb_offline_run_holds_every_key(trained):
    _, summary, run = trained
    per_step = ["train/loss", "train/sim_acceptance_length", "train/lr", "train/tokens_per_s",
                *(f"train/acc_{s}" for s in range(TTT_STEPS)), *(f"train/loss_{s}" for s in range(TTT_STEPS))]
    for key in per_step:
        series = run.series(key)
        assert [step for step, _ in series] == list(range(1, 151)), key
        assert all(math.isfinite(v) for _, v in series), key
    for mode in ("chain", "tree"):
        series = run.series(f"eval/acceptance_length_{mode}")
        assert [step for step, _ in series] == [0, 75, 150]
        assert all(math.isfinite(v) and v >= 1.0 for _, v in series)
        curve = run.table(f"eval/survival_{mode}_table")
        assert curve["columns"] == ["i", "Pr(A >= i)"]
        probs = [p for _, p in curve["data"]]
        assert len(probs) == 5 and all(0.0 <= p <= 1.0 for p in probs)
        assert probs == sorted(probs, reverse=True)  # a survival curve never rises
        assert run.summary[f"eval/acceptance_length_{mode}"] == summary["evals"][-1][f"acceptance_length_{mode}"]
    # the simulated acceptance length is the chain formula applied to the logged accuracies
    last = run.history[-1] if "train/acc_0" in run.history[-1] else [r for r in run.history if "train/acc_0" in r][-1]
    accs = [last[f"train/acc_{s}"] for s in range(TTT_STEPS)]
    expected, survive = 1.0, 1.0
    for a in accs:
        survive *= a
        expected += survive
    assert last["train/sim_acceptance_length"] == pytest.approx(expected)
    assert run.config["optim"]["lr"] == 3e-3 and run.exit_code == 0


@pytest.mark.slow
def test_checkpoint_layout_and_final_head(trained):
    out, summary, _ = trained
    assert summary["steps"] == 150 and summary["world_size"] == 1
    ckpt = latest_checkpoint(out)
    assert ckpt == out / "checkpoints" / "step-150"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-150"]  # keep_last=1, no partials
    assert {"config.json", "model.safetensors", "training_state.pt", "config.yaml"} <= {p.name for p in ckpt.iterdir()}
    state = torch.load(ckpt / "training_state.pt", weights_only=True)
    assert state["step"] == 150 and state["progress"]["tokens"] == summary["tokens"]
    assert load_config(TrainConfig, ckpt / "config.yaml").schedule.max_steps == 150
    final = et.Eagle3DraftModel.from_pretrained(out / "final")
    from_ckpt = et.Eagle3DraftModel.from_pretrained(ckpt)
    for (name, a), (_, b) in zip(final.state_dict().items(), from_ckpt.state_dict().items(), strict=True):
        if name != "embed_tokens.weight":
            assert torch.equal(a, b), name
    assert final.config.draft_vocab_size == 48
    assert (out / "final" / "config.yaml").is_file()


@pytest.mark.slow
def test_trained_head_accepts_clearly_more_than_an_untrained_one(trained):
    """The done-when: real acceptance length (SpeculativeDecoder, greedy, held-out prompts) of the trained
    head beats the untrained head's by MARGIN tokens per round, in chain and in tree mode; the saved head
    reproduces the logged figure."""
    out, summary, _ = trained
    first, last = summary["evals"][0], summary["evals"][-1]
    assert first["step"] == 0 and last["step"] == 150
    assert first["acceptance_length_chain"] < 1.2  # the untrained baseline is at chance level
    for mode in ("chain", "tree"):
        assert last[f"acceptance_length_{mode}"] >= first[f"acceptance_length_{mode}"] + MARGIN, (mode, summary)

    cfg = load_config(TrainConfig, out / "config.yaml")
    from eagle_tree.training.resolve import load_target, read_prompts

    target, tok = load_target(cfg)
    prompts = [tok(p, return_tensors="pt")["input_ids"][0] for p in read_prompts(cfg)]
    head = et.Eagle3DraftModel.from_pretrained(out / "final", target=target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the run (threads: 1); more threads only contend on a shared 2-core machine
    try:
        again = evaluate_acceptance(target, head, prompts, cfg.eval, tok.eos_token_id)
    finally:
        torch.set_num_threads(threads)
    assert again["acceptance_length_chain"] == pytest.approx(last["acceptance_length_chain"])
    assert again["acceptance_length_tree"] == pytest.approx(last["acceptance_length_tree"])


@pytest.mark.slow
def test_init_from_loads_weights_only(trained, tmp_path, monkeypatch):
    """A warm start with lr 0 leaves the loaded weights untouched; its step count starts at 0."""
    out, _, _ = trained
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = load_config(TrainConfig, SMOKE, [f"output_dir={tmp_path / 'warm'}", f"target.toy_cache_dir={TOY_CACHE}",
                                           f"model.init_from={out / 'final'}", "optim.lr=0", "schedule.max_steps=1",
                                           "eval.prompts=null", "checkpoint.every=0", "progress=false"])
    result = train(cfg)
    assert result.steps == 1
    a = et.Eagle3DraftModel.from_pretrained(out / "final").state_dict()
    b = et.Eagle3DraftModel.from_pretrained(result.final_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if k != "embed_tokens.weight")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_or_falls_back(precision, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    args = smoke_args(tmp_path / precision, f"optim.mixed_precision={precision}", "schedule.max_steps=2",
                      "eval.prompts=null", "checkpoint.every=0", "data.limit=32")
    assert main(args) == 0
    summary = json.loads((tmp_path / precision / "train_summary.json").read_text())
    expected, notice = resolve_mixed_precision(precision, "cpu")
    assert summary["mixed_precision"] == expected
    assert math.isfinite(summary["final_metrics"]["train/loss"])
    assert (notice is not None) == ("notice:" in capsys.readouterr().out)


def test_wandb_disabled_writes_no_run(tmp_path, monkeypatch):
    quiet_env(monkeypatch, tmp_path)
    args = smoke_args(tmp_path / "run", "wandb.mode=disabled", "schedule.max_steps=1", "eval.prompts=null",
                      "checkpoint.every=0", "data.limit=16")
    assert main(args) == 0
    assert not (tmp_path / "wandb").exists()
    assert et.Eagle3DraftModel.from_pretrained(tmp_path / "run" / "final").config.draft_vocab_size == 48


def test_unknown_config_key_is_rejected_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--config", str(SMOKE), "optim.lrr=1"])
    assert info.value.code == 2
    assert "did you mean 'optim.lr'?" in capsys.readouterr().err


def test_mixed_precision_rules():
    assert resolve_mixed_precision("bf16", "cuda") == ("bf16", None)
    assert resolve_mixed_precision("fp16", "cuda") == ("fp16", None)
    assert resolve_mixed_precision("no", "cpu") == ("no", None)
    assert resolve_mixed_precision("bf16", "cpu", cpu_bf16=True) == ("bf16", None)
    mode, notice = resolve_mixed_precision("bf16", "cpu", cpu_bf16=False)
    assert mode == "no" and "bf16" in notice
    mode, notice = resolve_mixed_precision("fp16", "cpu")
    assert mode == "no" and "GPU" in notice


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays(kind):
    f = [lr_factor(n, 10, 100, kind, 0.1) for n in range(101)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10], strict=False))
    if kind == "constant":
        assert f[100] == 1.0
    else:
        assert f[100] == pytest.approx(0.1)
        assert all(a >= b - 1e-12 for a, b in zip(f[10:], f[11:], strict=False))
        assert f[55] == pytest.approx(0.55)  # halfway: cosine and linear agree at the midpoint


def test_data_stream_crosses_epochs_and_resumes():
    examples = [{"input_ids": list(range(i + 2)), "loss_mask": [0] + [1] * (i + 1)} for i in range(10)]
    expected = [b.indices for e in range(3) for b in batches(examples, 4, seed=5, epoch=e)]
    stream = DataStream(examples, 4, seed=5, pad_id=0)
    got = [b.indices for b in stream.take(7)]
    assert got == expected[:7]
    position = stream.position()
    assert position == {"epoch": 2, "index": 1}
    resumed = DataStream(examples, 4, seed=5, pad_id=0, **position)
    assert [b.indices for b in resumed.take(2)] == expected[7:9]


def test_every_config_field_has_help():
    """Every option line of `eagle-tree train --help` (sections included) carries a help text."""
    from eagle_tree.utils.config import format_help

    lines = format_help(TrainConfig, "eagle-tree train").splitlines()
    options = lines[next(i for i, line in enumerate(lines) if line.startswith("options")) + 1:]
    entries = [i for i, line in enumerate(options) if line.startswith("  ") and not line.startswith("      ")]
    assert len(entries) > 60
    for i in entries:
        name, _, rest = options[i].strip().partition(":")
        if rest.startswith("  "):  # a section, "name:  help"
            assert rest.strip(), name
        else:  # a value, "name: type = default", the help text on the indented lines below
            assert i + 1 < len(options) and options[i + 1].startswith("      ") and options[i + 1].strip(), name


@pytest.mark.parametrize("name", ["smoke.yaml", "train-reference.yaml"])
def test_training_configs_load(name):
    cfg = load_config(TrainConfig, ROOT / "configs" / name)
    assert cfg.ttt.decay == 0.8 and cfg.eval.prompts is not None
    assert cfg.target.path in ("toy", "assets/reference/target")


def test_import_stays_light():
    code = ("import sys, eagle_tree, eagle_tree.training.loop, eagle_tree.training.feature_cache, "
            "eagle_tree.data.toy, eagle_tree.commands.train\n"
            "heavy = [m for m in ('wandb', 'datasets', 'accelerate') if m in sys.modules]\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_recipe_runs(tmp_path, monkeypatch, capsys):
    import runpy

    monkeypatch.setenv("WANDB_MODE", "disabled")
    recipe = runpy.run_path(str(ROOT / "train" / "train_head.py"), run_name="recipe")
    recipe["main"](smoke_args(tmp_path / "run", "schedule.max_steps=1", "checkpoint.every=0", "data.limit=16",
                              "eval.at_start=false", "eval.num_prompts=1", "eval.max_new_tokens=4"))
    printed = capsys.readouterr().out
    assert "step 1: acceptance length chain" in printed and "head in" in printed
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_stdlib_corpus_source_is_chunked_by_whole_lines(tmp_path, monkeypatch):
    """data.path 'stdlib:MANIFEST#SPLIT' (the reference config's data): the split's files, verified against
    the manifest, cut at line ends into chunks of about 3 * max_length characters that rebuild the files."""
    from eagle_tree.data import corpus
    from eagle_tree.training.resolve import resolve_data

    src = tmp_path / "lib"
    texts = {f"m{i}.py": "".join(f"x_{i}_{j} = {j}  # line {j}\n" for j in range(40 + 7 * i)) for i in range(6)}
    for name, text in texts.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    manifest = corpus.build_manifest(src, seed=0, fractions=(0.5, 0.25, 0.25))
    manifest.save(tmp_path / "manifest.json")
    monkeypatch.setattr(corpus, "stdlib_dir", lambda: src)
    spec = f"data.path=stdlib:{tmp_path}/manifest.json#train"
    cfg = load_config(TrainConfig, None, [f"output_dir={tmp_path / 'out'}", spec, "data.max_length=100"])
    data = resolve_data(cfg)
    rows = [json.loads(line)["text"] for line in Path(data.path).read_text().splitlines()]
    assert all(r.endswith("\n") and len(r) < 300 + 40 for r in rows)
    assert "".join(rows) == "".join(texts[p] for p in manifest.paths("train"))
    # in a list (e.g. beside regenerated data) the spec is resolved the same way, other entries kept
    other = tmp_path / "regen.jsonl"
    mixed = load_config(TrainConfig, None, [f"output_dir={tmp_path / 'out'}", f'data.path=["{spec[10:]}", "{other}"]',
                                            "data.max_length=100"])
    assert resolve_data(mixed).path == [data.path, str(other)]
    (src / manifest.paths("train")[0]).write_text("changed\n")  # a changed file is refused (corpus rule)
    with pytest.raises(corpus.CorpusMismatchError):
        resolve_data(load_config(TrainConfig, None, [f"output_dir={tmp_path / 'out2'}", spec]))


@pytest.mark.slow
def test_every_saved_head_is_a_wandb_artifact_with_acceptance(trained):
    _, summary, run = trained
    arts = {a["name"]: a for a in run.artifacts if a["type"] == "model"}
    assert {"head-step-75", "head-step-150", "head-final"} <= set(arts)
    meta = arts["head-final"]["metadata"]
    assert meta["acceptance_length"] == pytest.approx(summary["evals"][-1]["acceptance_length_tree"])
    assert meta["config"]["optim"]["lr"] == 3e-3 and meta["layout"]
