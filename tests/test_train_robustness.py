"""Training never deletes or mixes what a user owns, and every bad input gets an error naming the key, the
file (and line) and the fix: config ranges, data files, target paths, one run per output folder, resume
checks, the lock, divergence to NaN and a full disk during a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle_tree.data.rows import DataError, load_raw
from eagle_tree.data.toy import default_cache_dir
from eagle_tree.training import checkpoint as ckpt_mod
from eagle_tree.training.checkpoint import CheckpointWriteError, latest_checkpoint, prune_checkpoints
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.data import load_examples
from eagle_tree.training.loop import TrainingDiverged, TTTLoss, train
from eagle_tree.training.rundir import RUN_FILE, RunFolderError, RunLock
from eagle_tree.utils.atomic import temp_prefix
from eagle_tree.utils.checks import InputError, check_finite_weights
from eagle_tree.utils.config import format_help, load_config, parse_cli

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TOY_CACHE = str(default_cache_dir())
FAST = [f"target.toy_cache_dir={TOY_CACHE}", "schedule.max_steps=4", "schedule.warmup_steps=1", "optim.batch_size=4",
        "data.limit=16", "ttt.steps=2", "checkpoint.every=2", "checkpoint.keep_last=null", "eval.prompts=null",
        "eval.at_start=false", "wandb.mode=disabled", "progress=false", "threads=1"]


def run(out: Path, *extra: str):
    return train(load_config(TrainConfig, SMOKE, [f"output_dir={out}", *FAST, *extra]))


# ------------------------------------------------------------------------------------------ config ranges


@pytest.mark.parametrize("override, key", [
    ("schedule.max_steps=0", "schedule.max_steps"),
    ("schedule.max_steps=-5", "schedule.max_steps"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps"),
    ("schedule.epochs=0", "schedule.epochs"),
    ("schedule.min_lr_ratio=2", "schedule.min_lr_ratio"),
    ("optim.grad_accum=0", "optim.grad_accum"),
    ("optim.batch_size=0", "optim.batch_size"),
    ("optim.lr=-1e-3", "optim.lr"),
    ("optim.grad_clip=-1", "optim.grad_clip"),
    ("optim.betas=[0.9, 1.5]", "optim.betas"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
    ("checkpoint.every=-2", "checkpoint.every"),
    ("ttt.steps=0", "ttt.steps"),
    ("ttt.decay=0", "ttt.decay"),
    ("eval.num_prompts=0", "eval.num_prompts"),
    ("eval.chain_length=0", "eval.chain_length"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens"),
    ("data.max_length=0", "data.max_length"),
    ("data.draft_vocab_size=0", "data.draft_vocab_size"),
    ("data.limit=0", "data.limit"),
    ("features.examples_per_shard=0", "features.examples_per_shard"),
    ("log_every=0", "log_every"),
    ("threads=0", "threads"),
])
def test_out_of_range_values_are_refused_with_the_key(override, key, capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(TrainConfig, [override], prog="eagle-tree train")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"config key {key} must " in err, err


def test_overwrite_with_resume_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_cli(TrainConfig, ["overwrite=true", "resume=latest"])
    assert "config key overwrite cannot be combined with resume" in capsys.readouterr().err


def test_help_prints_the_real_defaults():
    text = format_help(TrainConfig, "eagle-tree train")
    assert "  data.path: str | list[str] = 'toy'" in text  # the factory's value; an empty YAML trains on the toy
    assert "(required)" not in text
    assert "  overwrite: bool = False" in text


# ------------------------------------------------------------------------------------------ data


def tokenizer():
    from eagle_tree.data.toy import ToyConfig, toy_tokenizer

    return toy_tokenizer(ToyConfig())


@pytest.mark.parametrize("name, content, match", [
    ("empty.jsonl", b"", r"empty\.jsonl is empty"),
    ("blank.jsonl", b"\n\n", r"blank\.jsonl is empty"),
    ("bad.jsonl", b'{"text": "a b"}\n{"text": "c d"\n', r"bad\.jsonl:2: not valid JSON"),
    ("list.jsonl", b'{"text": "a"}\n[1, 2]\n', r"list\.jsonl:2: a JSON list"),
    ("latin.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"latin\.jsonl:2: not UTF-8"),
    ("latin.txt", b"ok\ncaf\xe9\n", r"latin\.txt:2: not UTF-8"),
])
def test_unreadable_data_names_the_file_and_line(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_raw(str(path))


def test_json_rows_in_a_json_file_are_read(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert len(load_raw(str(path))) == 2


def test_rows_without_the_text_field_are_counted(tmp_path):
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(row) + "\n" for row in [{"text": "a b"}] * 19 + [{"other": "y"}]))
    with pytest.warns(UserWarning, match=r"1 of 20 rows .* have no 'text' field; they are skipped"):
        assert len(load_examples(str(few), tokenizer(), max_length=16)) == 19
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps(row) + "\n" for row in [{"text": "a b"}] * 5 + [{"other": "y"}] * 5))
    with pytest.raises(DataError, match=r"5 of 10 rows .*\(50%\) have no 'text' field.*max_missing_fraction"):
        load_examples(str(many), tokenizer(), max_length=16)


def test_target_paths_are_checked_before_loading(tmp_path):
    with pytest.raises(InputError, match="target.path=.*absent: no such folder"):
        run(tmp_path / "out", f"target.path={tmp_path / 'absent'}")
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8}))
    with pytest.raises(InputError, match="is an EAGLE-3 draft head, not a target model"):
        run(tmp_path / "out", f"target.path={head}")


# ------------------------------------------------------------------------------------------ run folders


def test_one_run_per_output_folder(tmp_path, capsys):
    out = tmp_path / "run"
    first = run(out)
    ident = json.loads((out / RUN_FILE).read_text())
    assert set(ident) >= {"run_id", "config_hash", "seed", "started"}
    assert lock_is_free(out)  # released on exit
    assert (out / "checkpoints" / "step-4" / "run_id").read_text().strip() == ident["run_id"]

    with pytest.raises(RunFolderError, match="holds the checkpoints or final head of run .*resume=latest.*overwrite"):
        run(out, "optim.lr=1e-3")
    assert lock_is_free(out)

    # resume: every changed key listed, refused when it cannot take effect
    with pytest.raises(RunFolderError) as info:
        run(out, "resume=latest", "optim.lr=1e-3", "data.draft_vocab_size=40", "schedule.max_steps=2")
    text = str(info.value)
    assert "optim.lr: 0.003 -> 0.001 cannot take effect" in text
    assert "data.draft_vocab_size: 48 -> 40 cannot take effect" in text
    assert "schedule.max_steps=2 is below the checkpoint's step 4" in text
    capsys.readouterr()
    resumed = run(out, "resume=latest", "schedule.max_steps=6", "schedule.kind=linear")
    printed = capsys.readouterr().out
    assert "schedule.kind: 'cosine' -> 'linear' takes effect from step 4" in printed
    assert "schedule.max_steps: 4 -> 6 takes effect" in printed
    assert resumed.steps == 6
    assert json.loads((out / RUN_FILE).read_text())["run_id"] == ident["run_id"]  # the same run, continued

    other = tmp_path / "other"
    run(other)  # another run's folder
    with pytest.raises(RunFolderError, match="continues a checkpoint of another folder"):
        run(other, f"resume={out / 'checkpoints' / 'step-4'}")

    (out / "notes.txt").write_text("the user's own file")
    fresh = run(out, "overwrite=true", "seed=3")
    assert json.loads((out / RUN_FILE).read_text())["run_id"] != ident["run_id"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]  # the old step-6 gone
    assert (out / "notes.txt").read_text() == "the user's own file"  # overwrite deletes only what a run writes
    assert fresh.steps == 4 and first.steps == 4

    identity = json.loads((out / RUN_FILE).read_text())
    (out / RUN_FILE).write_text(json.dumps({**identity, "run_id": "another"}))
    with pytest.raises(RunFolderError, match="the folder mixes two runs"):
        run(out, "resume=latest", "seed=3")


def test_length_grouping_reaches_the_loop(tmp_path, monkeypatch):
    from eagle_tree.training import loop as loop_mod
    from eagle_tree.training.data import epoch_batches, example_lengths

    streams = []

    class Recording(loop_mod.DataStream):
        def __init__(self, examples, *args, **kwargs):
            super().__init__(examples, *args, **kwargs)
            self.seen = []
            streams.append(self)

        def next(self):
            batch = super().next()
            self.seen.append(batch.indices)
            return batch

    monkeypatch.setattr(loop_mod, "DataStream", Recording)
    run(tmp_path / "grouped", "data.length_grouping=2", "schedule.max_steps=2")
    (stream,) = streams
    lengths = example_lengths(stream.examples)
    grouped = epoch_batches(len(lengths), 4, seed=0, epoch=0, lengths=lengths, length_grouping=2)
    assert stream.seen == grouped[:2]
    assert stream.seen != epoch_batches(len(lengths), 4, seed=0, epoch=0)[:2]  # control: not the random order


def test_a_checkpoint_from_before_length_grouping_resumes(tmp_path, capsys):
    import yaml

    out = tmp_path / "run"
    run(out)
    for config in (out / "checkpoints").glob("step-*/config.yaml"):  # as written before the key existed
        saved = yaml.safe_load(config.read_text())
        assert saved["data"].pop("length_grouping") == 0
        config.write_text(yaml.safe_dump(saved))
    with pytest.raises(RunFolderError, match=r"data.length_grouping: 0 -> 2 cannot take effect"):
        run(out, "resume=latest", "schedule.max_steps=6", "data.length_grouping=2")
    capsys.readouterr()
    resumed = run(out, "resume=latest", "schedule.max_steps=6")
    assert resumed.steps == 6
    assert "length_grouping" not in capsys.readouterr().out  # no change reported


def test_a_max_steps_override_that_would_be_ignored_is_refused(capsys):
    from eagle_tree.commands.train import ignored_step_override, main

    argv = ["--config", str(SMOKE), "schedule.max_minutes=45", "schedule.max_steps=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "schedule.max_steps=1 would have no effect: schedule.max_minutes=45.0 sets the step count" in err
    assert "add schedule.max_minutes=null" in err
    epochs = ["schedule.epochs=2", "schedule.max_steps=3"]
    assert "schedule.epochs=2.0 sets the step count" in ignored_step_override(
        load_config(TrainConfig, SMOKE, epochs), epochs)
    # controls: the step count is max_steps's, or max_steps is not on the command line
    fixed = ["schedule.max_minutes=null", "schedule.max_steps=1"]
    assert ignored_step_override(load_config(TrainConfig, SMOKE, fixed), fixed) is None
    budget = ["schedule.max_minutes=45"]
    assert ignored_step_override(load_config(TrainConfig, SMOKE, budget), budget) is None


def test_pruning_only_considers_this_run(tmp_path):
    root = tmp_path / "checkpoints"
    for step, run_id in [(10, "old"), (20, "old"), (2, "new"), (4, "new"), (6, "new")]:
        d = root / f"step-{step}"
        d.mkdir(parents=True)
        (d / ckpt_mod.STATE_NAME).write_bytes(b"x")
        (d / ckpt_mod.RUN_ID_NAME).write_text(run_id)
    gone = prune_checkpoints(tmp_path, 2, "new")
    assert [p.name for p in gone] == ["step-2"]
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-20", "step-4", "step-6"]


def lock_is_free(folder: Path) -> bool:
    try:
        RunLock(folder).acquire().release()
    except RunFolderError:
        return False
    return True


def test_lock_stops_a_second_writer_and_is_released_when_its_holder_dies(tmp_path):
    code = ("import sys, time; from pathlib import Path; from eagle_tree.training.rundir import RunLock\n"
            "lock = RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match="another training is writing to"):
            run(tmp_path)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the flock
        holder.wait()
    assert lock_is_free(tmp_path)
    run(tmp_path)  # the holder is gone: nothing to take over
    assert lock_is_free(tmp_path)  # released at the end
    held = RunLock(tmp_path).acquire()  # a live holder stops another process
    code = ("import sys; from pathlib import Path; from eagle_tree.training.rundir import RunLock, RunFolderError\n"
            "try:\n    RunLock(Path(sys.argv[1])).acquire()\nexcept RunFolderError:\n    sys.exit(3)\n")
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)]).returncode == 3
    held.release()
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)]).returncode == 0


def test_partial_names_are_unique_per_process(tmp_path):
    assert str(os.getpid()) in temp_prefix(tmp_path / "step-4")
    code = "import sys; from pathlib import Path; from eagle_tree.utils.atomic import temp_prefix; " \
           "print(temp_prefix(Path(sys.argv[1])))"
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "step-4")], capture_output=True, text=True)
    assert other.stdout.strip() != temp_prefix(tmp_path / "step-4")


# ------------------------------------------------------------------------------------------ faults


def test_divergence_stops_at_the_step_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    calls = {"n": 0}
    forward = TTTLoss.forward

    def poisoned(self, *args):
        loss, out = forward(self, *args)
        calls["n"] += 1
        return (loss * float("nan"), out) if calls["n"] >= 3 else (loss, out)  # step 3 (one micro-batch a step)

    monkeypatch.setattr(TTTLoss, "forward", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged, match=r"training diverged at step 3: the loss is not finite.*step-2"):
        run(out)
    assert latest_checkpoint(out).name == "step-2"
    assert not (out / "final").exists()
    assert lock_is_free(out)
    from eagle_tree.models.head import Eagle3DraftModel

    check_finite_weights(Eagle3DraftModel.from_pretrained(out / "checkpoints" / "step-2"), "step-2")  # a good one


def test_full_disk_during_a_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "disk"
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "step-4" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 512 vs 320")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 4 to .*step-4.*MiB free in .*resume=latest"):
        run(out)
    assert latest_checkpoint(out).name == "step-2"  # the earlier checkpoint is intact
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # nothing half-written
