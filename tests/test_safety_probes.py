"""The careful user's probe (docs/SAFETY.md): nothing executes from a file, nothing a user wrote is replaced,
numbers are checked as numbers, and every anticipated error is one line with exit status 2 naming the file
or key. Each case asserts the exit status, the name in the message, and that no file changed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import eagle_tree as et
from eagle_tree.commands.decode import main as decode_main
from eagle_tree.commands.export import main as export_main
from eagle_tree.commands.regenerate import main as regenerate_main
from eagle_tree.commands.train import main as train_main
from eagle_tree.data.tiny import char_tokenizer, tiny_causal_lm
from eagle_tree.training.checkpoint import STATE_NAME
from eagle_tree.training.rundir import LOCK_FILE
from tests.test_train_robustness import FAST, SMOKE, lock_is_free

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this creates ``marker``: what a booby-trapped file would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def snapshot(folder: Path) -> dict:
    """Every file's bytes, but the run lock's: an empty file a training may create to hold its flock."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def one_line(err: str, prog: str) -> bool:
    """The error is one line ``prog: ...`` (progress bars of the model loaders aside), no traceback."""
    return len([line for line in err.splitlines() if line.startswith(f"{prog}:")]) == 1 and "Traceback" not in err


def train_args(out: Path, *extra: str) -> list[str]:
    return ["--config", str(SMOKE), f"output_dir={out}", *FAST, *extra]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target (char tokenizer, 6 layers), an untrained head, a prompt file."""
    root = tmp_path_factory.mktemp("probe-models")
    tok = char_tokenizer()
    hf = tiny_causal_lm("llama", vocab_size=len(tok), num_layers=6)
    hf.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    et.Eagle3DraftModel.from_target(hf).save_pretrained(root / "head")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("probe-run") / "run"
    assert train_main(train_args(out)) == 0
    return out


def copy_run(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def decode_args(models: Path, *extra: str) -> list[str]:
    return [f"target={models / 'target'}", f"head={models / 'head'}", f"prompts={models / 'prompts.jsonl'}",
            "max_new_tokens=4", "wandb.mode=disabled", *extra]


def copy_head(models: Path, tmp_path: Path) -> Path:
    head = tmp_path / "head"
    shutil.copytree(models / "head", head)
    return head


# ------------------------------------------------------------------------------- nothing executes from a file
@pytest.mark.parametrize("where", ["latest", "explicit"])
def test_resume_never_runs_a_payload_in_the_training_state(trained, tmp_path, capsys, where):
    out = copy_run(trained, tmp_path)
    marker = tmp_path / "ran"
    state_file = out / "checkpoints" / "step-4" / STATE_NAME
    torch.save({"step": 4, "optimizer": Payload(marker)}, state_file)
    before = snapshot(out)
    resume = "latest" if where == "latest" else str(out / "checkpoints" / "step-4")
    assert train_main(train_args(out, f"resume={resume}", "schedule.max_steps=6")) == 2
    err = capsys.readouterr().err
    assert str(state_file) in err and "could run code" in err and one_line(err, "eagle-tree train")
    assert not marker.exists() and snapshot(out) == before


def test_resume_never_runs_a_payload_in_an_optimiser_shard(trained, tmp_path, capsys):
    """FSDP checkpoints keep the optimiser in per-rank shards; those are read the same safe way."""
    out = copy_run(trained, tmp_path)
    marker = tmp_path / "ran"
    ckpt = out / "checkpoints" / "step-4"
    state = torch.load(ckpt / STATE_NAME, weights_only=True)
    torch.save({**state, "optimizer": None}, ckpt / STATE_NAME)
    torch.save({"state": Payload(marker)}, ckpt / "optimizer-rank0.pt")
    before = snapshot(out)
    assert train_main(train_args(out, "resume=latest", "schedule.max_steps=6")) == 2
    err = capsys.readouterr().err
    assert str(ckpt / "optimizer-rank0.pt") in err and "could run code" in err
    assert not marker.exists() and snapshot(out) == before


def test_resume_never_runs_a_yaml_tag_in_the_checkpoint_config(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    marker = tmp_path / "ran"
    config = out / "checkpoints" / "step-4" / "config.yaml"
    config.write_text(f"seed: !!python/object/apply:builtins.open [{marker}, w]\n")
    before = snapshot(out)
    assert train_main(train_args(out, "resume=latest", "schedule.max_steps=6")) == 2
    assert str(config) in capsys.readouterr().err
    assert not marker.exists() and snapshot(out) == before


def test_a_truncated_training_state_is_one_line(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    state_file = out / "checkpoints" / "step-4" / STATE_NAME
    state_file.write_bytes(state_file.read_bytes()[:200])
    before = snapshot(out)
    assert train_main(train_args(out, "resume=latest", "schedule.max_steps=6")) == 2
    err = capsys.readouterr().err
    assert str(state_file) in err and "truncated" in err and snapshot(out) == before


def test_old_checkpoints_with_a_numpy_rng_state_keep_loading(trained, tmp_path):
    """Checkpoints written before the numpy state was stored as a list hold a numpy array: still read."""
    import numpy as np

    from eagle_tree.utils.statefile import read_state

    out = copy_run(trained, tmp_path)
    state_file = out / "checkpoints" / "step-4" / STATE_NAME
    state = torch.load(state_file, weights_only=True)
    state["rng"] = [{**r, "numpy": np.random.get_state()} for r in state["rng"]]
    torch.save(state, state_file)
    assert isinstance(read_state(state_file)["rng"][0]["numpy"][1], np.ndarray)
    assert train_main(train_args(out, "resume=latest", "schedule.max_steps=6")) == 0


@pytest.mark.parametrize("command", ["decode", "export", "init_from"])
def test_a_head_weights_pickle_never_runs(models, trained, tmp_path, capsys, command):
    """A head folder with pytorch_model.bin (the older weights file): read with weights_only, refused."""
    head = copy_head(models, tmp_path)
    (head / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({"fc.weight": Payload(marker)}, head / "pytorch_model.bin")
    before = snapshot(head)
    if command == "decode":
        rc = decode_main(decode_args(models, f"head={head}"))
    elif command == "export":
        rc = export_main(["--to", "vllm", str(head), str(tmp_path / "out")])
    else:
        rc = train_main(train_args(tmp_path / "fresh", f"model.init_from={head}"))
    assert rc == 2
    err = capsys.readouterr().err
    assert str(head / "pytorch_model.bin") in err and "could run code" in err
    assert not marker.exists() and snapshot(head) == before


def test_the_reference_builders_checkpoint_never_runs(tmp_path):
    from eagle_tree.reference.builder import TrainConfig as LMConfig
    from eagle_tree.reference.builder import train_lm
    from eagle_tree.utils.statefile import StateFileError

    marker = tmp_path / "ran"
    ckpt = tmp_path / "lm.pt"
    torch.save({"model": Payload(marker)}, ckpt)
    model = tiny_causal_lm("llama", vocab_size=32, num_layers=2)
    rows = [torch.arange(8)] * 4
    with pytest.raises(StateFileError, match="could run code"):
        train_lm(model, rows, rows, LMConfig(steps=1, batch_size=2), checkpoint=ckpt)
    assert not marker.exists()


def test_a_checkpoint_without_its_run_id_file_stays_in_its_run(trained, tmp_path):
    """The run id is also in the training state: resuming keeps the run, so pruning still removes its
    old checkpoints."""
    out = copy_run(trained, tmp_path)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    for step in (2, 4):
        (out / "checkpoints" / f"step-{step}" / "run_id").unlink()
    assert train_main(train_args(out, "resume=latest", "schedule.max_steps=6", "checkpoint.keep_last=1")) == 0
    assert json.loads((out / "run.json").read_text())["run_id"] == run_id
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-6"]


# ------------------------------------------------------------------------------- nothing a user wrote is replaced
@pytest.mark.parametrize("name, content", [
    ("config.yaml", "# my own notes\nlr: 3\n"),
    ("train_summary.json", '{"mine": true}\n'),
])
def test_a_fresh_train_never_replaces_the_users_files(tmp_path, capsys, name, content):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).write_text(content)
    before = snapshot(out)
    assert train_main(train_args(out)) == 2
    err = capsys.readouterr().err
    assert name in err and "overwrite=true" in err and snapshot(out) == before


def test_a_fresh_train_never_reads_a_head_it_replaces(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    before = snapshot(out)
    assert train_main(train_args(out, "overwrite=true", f"model.init_from={out / 'final'}")) == 2
    err = capsys.readouterr().err
    assert "model.init_from" in err and "replace what it reads" in err and snapshot(out) == before


@pytest.mark.parametrize("case", ["precious", "input"])
def test_regenerate_never_replaces_a_file_it_did_not_write(models, tmp_path, capsys, case):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x): return x"}) + "\n")
    precious = tmp_path / "precious.jsonl"
    precious.write_text('{"text": "written by hand"}\n')
    output = precious if case == "precious" else data
    before = snapshot(tmp_path)
    argv = [f"target={models / 'target'}", f"data={data}", f"output={output}", "max_new_tokens=2", "prefix_tokens=2"]
    assert regenerate_main(argv) == 2
    err = capsys.readouterr().err
    assert str(output) in err and snapshot(tmp_path) == before
    if case == "input":  # refused even with overwrite
        assert regenerate_main([*argv, "overwrite=true"]) == 2
        assert "one of the input files" in capsys.readouterr().err and snapshot(tmp_path) == before


def test_regenerate_may_replace_its_own_output(models, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x): return x"}) + "\n")
    argv = [f"target={models / 'target'}", f"data={data}", f"output={tmp_path / 'out.jsonl'}", "max_new_tokens=2",
            "prefix_tokens=2"]
    assert regenerate_main(argv) == 0
    assert regenerate_main(argv) == 0  # its own earlier output: recognised


# ------------------------------------------------------------------------------- numbers checked as numbers
def test_a_duplicate_yaml_key_is_refused_with_both_lines(tmp_path, capsys):
    config = tmp_path / "twice.yaml"
    config.write_text("schedule:\n  max_steps: 2\noptim:\n  lr: 5.0\nschedule:\n  max_steps: 1000\n")
    with pytest.raises(SystemExit) as info:
        train_main(["--config", str(config), f"output_dir={tmp_path / 'run'}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'schedule' is given twice, on lines 1 and 5" in err and str(config) in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, key", [
    ("optim.grad_clip=nan", "optim.grad_clip"),
    ("schedule.max_minutes=inf", "schedule.max_minutes"),
    ("optim.lr=.nan", "optim.lr"),
    ("schedule.epochs=-.inf", "schedule.epochs"),
    ("eval.every_minutes=.inf", "eval.every_minutes"),
])
def test_non_finite_numbers_are_refused_with_the_key(tmp_path, capsys, override, key):
    with pytest.raises(SystemExit) as info:
        train_main([f"output_dir={tmp_path / 'run'}", override])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert key in err and "finite" in err and not (tmp_path / "run").exists()


def test_check_range_refuses_nan_and_infinities():
    from eagle_tree.utils.checks import check_range
    from eagle_tree.utils.config import ConfigValueError

    for value in (float("nan"), float("inf")):
        with pytest.raises(ConfigValueError, match="finite"):
            check_range("x", value, 0.0, integer=False)
    check_range("x", 0.5, 0.0, integer=False)


@pytest.mark.parametrize("field, value, message", [
    ("rms_norm_eps", -1, "rms_norm_eps must be a finite number > 0"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number > 0"),
    ("hidden_size", "64", "expected an integer|must be an integer"),
    ("num_attention_heads", 2.5, "num_attention_heads must be an integer"),
    ("hidden_act", "swishy", "hidden_act 'swishy' is not an activation"),
])
def test_head_configs_are_validated_by_type_and_range(models, tmp_path, capsys, field, value, message):
    head = copy_head(models, tmp_path)
    config = json.loads((head / "config.json").read_text())
    config[field] = value
    (head / "config.json").write_text(json.dumps(config))
    before = snapshot(head)
    assert decode_main(decode_args(models, f"head={head}")) == 2
    err = capsys.readouterr().err
    assert str(head) in err and one_line(err, "eagle-tree decode")
    import re

    assert re.search(message, err), err
    assert snapshot(head) == before


def test_integer_head_weights_are_refused(models, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    head = copy_head(models, tmp_path)
    state = load_file(str(head / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"].round().to(torch.int32)
    save_file(state, str(head / "model.safetensors"))
    assert decode_main(decode_args(models, f"head={head}")) == 2
    err = capsys.readouterr().err
    assert "fc.weight" in err and "torch.int32" in err and str(head) in err


@pytest.mark.parametrize("temperature", [1e-46, 1e-45, 1e-40, 1e-38, 1e-30])
def test_tiny_temperatures_decode_without_crashing(models, temperature):
    """Below GREEDY_BELOW (float32's smallest normal) a temperature is greedy; above it the division does
    not underflow; either way the tokens are the greedy ones for this model (no near-ties)."""
    target = et.TargetModel.from_pretrained(str(models / "target"))
    head = et.Eagle3DraftModel.from_pretrained(str(models / "head"), target=target)
    dec = et.SpeculativeDecoder(target, head, tree=et.TreeConfig(depth=3, top_k=2, total_tokens=6))
    ids = torch.tensor([[5, 6, 7]])
    greedy = dec.generate(ids, 6, sampling=et.SamplingConfig(temperature=0.0), seed=0).sequences
    out = dec.generate(ids, 6, sampling=et.SamplingConfig(temperature=temperature), seed=0).sequences
    assert torch.equal(out, greedy)
    probs = et.processed_probs(torch.tensor([[0.0, 1.0, -3.0]]), et.SamplingConfig(temperature=temperature))
    assert torch.isfinite(probs).all() and probs[0, 1] == 1.0


def test_a_tiny_temperature_on_the_command_line(models, tmp_path, capsys):
    out = tmp_path / "tiny.json"
    assert decode_main(decode_args(models, "sampling.temperature=1e-46", f"output={out}")) == 0
    assert decode_main(decode_args(models, "sampling.temperature=0", f"output={tmp_path / 'greedy.json'}")) == 0
    tiny = json.loads(out.read_text())["prompts"]
    greedy = json.loads((tmp_path / "greedy.json").read_text())["prompts"]
    assert [p["continuation"] for p in tiny] == [p["continuation"] for p in greedy]


def test_a_row_without_mass_is_a_value_error_not_an_index_error():
    from eagle_tree.core.verify import sample_token

    with pytest.raises(ValueError, match="total mass nan"):
        sample_token(torch.full((4,), float("nan")), greedy=False, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------- one line, exit status 2
@pytest.mark.parametrize("value", ["prompt=", "prompt=~", "prompt=null", "prompt=   "])
def test_decode_refuses_a_blank_prompt(models, tmp_path, capsys, value):
    out = tmp_path / "out.json"
    try:
        rc = decode_main(decode_args(models, value, f"output={out}"))
    except SystemExit as exc:  # a blank string is refused by the schema, with the key
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "prompt" in err and not out.exists()


def test_head_loading_errors_in_decode_are_one_line(models, tmp_path, capsys):
    head = copy_head(models, tmp_path)
    (head / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert decode_main(decode_args(models, f"head={head}")) == 2
    err = capsys.readouterr().err
    assert str(head / "config.json") in err and one_line(err, "eagle-tree decode")


@pytest.mark.parametrize("content", ['{"format": "eagle-tree-decoding', "[1, 2]"])
def test_a_broken_decoding_json_is_one_line(models, tmp_path, capsys, content):
    head = copy_head(models, tmp_path)
    (head / "decoding.json").write_text(content)
    before = snapshot(head)
    assert decode_main(decode_args(models, f"head={head}", "mode=default")) == 2
    err = capsys.readouterr().err
    assert str(head / "decoding.json") in err and snapshot(head) == before


@pytest.mark.parametrize("content", [None, "{not json", '{"format": "other"}'])
def test_a_missing_or_broken_shapes_file_is_one_line(models, tmp_path, capsys, content):
    shapes = tmp_path / "shapes.json"
    if content is not None:
        shapes.write_text(content)
    assert decode_main(decode_args(models, "mode=auto", f"shapes={shapes}")) == 2
    assert str(shapes) in capsys.readouterr().err


def test_a_target_without_tokenizer_files_is_one_line(models, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(models / "target", target)
    for p in target.iterdir():
        if "token" in p.name or p.name == "special_tokens_map.json":
            p.unlink()
    before = snapshot(target)
    assert decode_main(decode_args(models, f"target={target}", "mode=plain")) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "tokenizer" in err and snapshot(target) == before


def test_export_to_a_dangling_symlink_is_refused(models, tmp_path, capsys):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere" / "x")
    assert export_main(["--to", "vllm", str(models / "head"), str(link)]) == 2
    err = capsys.readouterr().err
    assert str(link) in err and "does not exist" in err
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("content", ["{broken", '{"name": "another program"}', "[]"])
def test_a_broken_or_foreign_run_json_is_one_line(trained, tmp_path, capsys, content):
    out = copy_run(trained, tmp_path)
    (out / "run.json").write_text(content)
    before = snapshot(out)
    assert train_main(train_args(out, "resume=latest", "schedule.max_steps=6")) == 2
    err = capsys.readouterr().err
    assert str(out / "run.json") in err and snapshot(out) == before


def test_a_stale_feature_cache_is_one_line(trained, tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "meta.json").write_text(json.dumps({"format": 1, "fingerprint": {"dataset": "another"},
                                                 "num_examples": 1, "examples_per_shard": 1, "num_shards": 1,
                                                 "draft_ids": [0]}))
    before = snapshot(cache)
    out = tmp_path / "run"
    assert train_main(train_args(out, "features.source=cache", f"features.cache_dir={cache}")) == 2
    err = capsys.readouterr().err
    assert str(cache) in err and "features.cache_dir" in err and snapshot(cache) == before


# ------------------------------------------------------------------------------- data
def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, text, message", [
    ("numbers.jsonl", '{"text": "fine"}\n{"text": 12345}\n', r"row 2: the 'text' field holds an int"),
    ("columns.json", '{"text": ["a", "b"], "id": [1, 2]}', "holds one JSON object of columns"),
])
def test_bad_rows_name_the_file_and_row(tmp_path, capsys, name, text, message):
    import re

    data = write(tmp_path / name, text)
    out = tmp_path / "run"
    assert train_main(train_args(out, f"data.path={data}", "data.limit=null")) == 2
    err = capsys.readouterr().err
    assert name in err and re.search(message, err), err
    assert not (out / "checkpoints").exists()


def test_an_empty_data_path_is_refused_with_the_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_main(train_args(tmp_path / "run", "data.path=[]"))
    assert info.value.code == 2 and "data.path" in capsys.readouterr().err


def test_conversations_that_are_not_message_lists_name_the_row(tmp_path):
    from eagle_tree.data.rows import DataError
    from eagle_tree.training.data import load_examples
    from tests.test_data import make_tokenizer

    data = write(tmp_path / "conv.jsonl", json.dumps({"conversations": "hello there"}) + "\n")
    with pytest.raises(DataError, match=r"conv\.jsonl', row 1: the 'conversations' field holds a str"):
        load_examples(str(data), make_tokenizer())


def test_empty_assistant_turns_are_warned_about(tmp_path):
    from eagle_tree.training.data import load_examples
    from tests.test_data import make_tokenizer

    row = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    data = write(tmp_path / "empty.jsonl", (json.dumps(row) + "\n") * 3)
    with pytest.warns(UserWarning, match="only empty ones"):
        load_examples(str(data), make_tokenizer())


def test_a_foreign_tokenizer_is_warned_about(capsys):
    from eagle_tree.utils.prompts import encode_prompts

    tok = char_tokenizer()
    encode_prompts(tok, ["abc"], vocab_size=len(tok) * 4, max_positions=None, max_new_tokens=1)
    assert "most likely belongs to another model" in capsys.readouterr().err
    encode_prompts(tok, ["abc"], vocab_size=len(tok) + 3, max_positions=None, max_new_tokens=1)
    assert capsys.readouterr().err == ""  # a vocabulary padded a little is normal


# ------------------------------------------------------------------------------- interrupts
def test_ctrl_c_in_train_names_the_checkpoint_and_resume_latest(tmp_path, capsys, monkeypatch):
    from eagle_tree.training import loop

    real = loop._Run.train_step
    calls = []

    def step(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(loop._Run, "train_step", step)
    out = tmp_path / "run"
    assert train_main(train_args(out)) == 130
    err = capsys.readouterr().err
    assert one_line(err, "eagle-tree train") and "eagle-tree train: interrupted" in err
    assert str(out / "checkpoints" / "step-2") in err and "resume=latest" in err
    assert lock_is_free(out)


def test_sigterm_in_train_stops_with_one_line(tmp_path):
    out = tmp_path / "run"
    args = train_args(out, "schedule.max_steps=100000", "checkpoint.every=1", "checkpoint.keep_last=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eagle_tree.cli", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list((out / "checkpoints").glob("step-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = [line for line in err.splitlines() if line.startswith("eagle-tree train:")]
    assert len(last) == 1 and "resume=latest" in last[0] and "checkpoints/step-" in last[0]
    assert "Traceback" not in err and lock_is_free(out)


def test_an_unexpected_error_keeps_its_traceback():
    """The boundary converts only what it anticipates: a bug still surfaces with its traceback."""
    from eagle_tree.utils.checks import InputError, exit_on_input_error

    def broken(cfg):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        exit_on_input_error("eagle-tree probe", broken, None)

    def refused(cfg):
        raise InputError("x=1 is refused: set x=2")

    assert exit_on_input_error("eagle-tree probe", refused, None) == 2
