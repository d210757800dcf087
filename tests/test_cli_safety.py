"""The command line refuses what it cannot do safely: each bad input gets an error that names the
problem and the fix, before any work, and nothing a user owns is deleted."""

import json

import pytest

from eagle_tree.commands.demo import main as demo_main
from eagle_tree.commands.export import ExportConfig
from eagle_tree.commands.export import main as export_main
from eagle_tree.commands.flags import flags_to_overrides, parse_flags
from eagle_tree.utils.outputs import MARKER


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target (char tokenizer, 6 layers) and an untrained head on disk, and a prompt file."""
    from eagle_tree.data.tiny import char_tokenizer, tiny_causal_lm
    from eagle_tree.models.head import Eagle3DraftModel

    root = tmp_path_factory.mktemp("cli")
    tok = char_tokenizer()
    hf = tiny_causal_lm("llama", vocab_size=len(tok), num_layers=6)
    hf.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    Eagle3DraftModel.from_target(hf).save_pretrained(root / "head")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "import os"]))
    return root


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------- one config convention
def test_flags_and_key_values_give_the_same_config():
    flags = ["--to", "vllm", "heads/a", "out/b", "--speculative-tokens", "5", "--dtype=bfloat16", "--overwrite"]
    keys = ["to=vllm", "checkpoint=heads/a", "out=out/b", "speculative_tokens=5", "dtype=bfloat16", "overwrite=true"]
    assert flags_to_overrides(ExportConfig, flags, ("checkpoint", "out")) == keys
    a = parse_flags(ExportConfig, flags, "eagle-tree export", ("checkpoint", "out"))
    b = parse_flags(ExportConfig, keys, "eagle-tree export", ("checkpoint", "out"))
    assert a == b and a.overwrite and a.speculative_tokens == 5


@pytest.mark.parametrize("argv, message", [
    (["--to", "vllm", "a", "b", "c"], "unexpected argument 'c'"),
    (["--to", "vllm", "a"], "missing required config key(s): out"),
    (["--to", "vlm", "a", "b"], "expected one of 'eagle3', 'sglang', 'vllm'"),
    (["--tagret", "x", "--to", "vllm", "a", "b"], "did you mean 'target'"),
    (["--to", "vllm", "a", "b", "--target"], "option --target needs a value"),
])
def test_export_command_line_errors(argv, message, capsys):
    from eagle_tree.commands.export import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_reads_flags_and_refuses_zero_samples(capsys):
    assert demo_main(["--samples", "200", "--seed", "3"]) == 0
    assert "acceptance rate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        demo_main(["samples=0"])
    assert "samples must be an integer >= 1, got 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- export never deletes
def test_export_into_a_run_folder_is_refused_and_deletes_nothing(models, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-5").mkdir(parents=True)
    (run / "checkpoints" / "step-5" / "state.pt").write_bytes(b"checkpoint")
    (run / "summary.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    assert export_main(["--to", "vllm", str(models / "head"), str(run)]) == 2
    err = capsys.readouterr().err
    assert "is not empty and is not an earlier eagle-tree export --to vllm" in err and "--overwrite" in err
    assert snapshot(run) == before


def test_export_to_a_regular_file_is_refused_even_with_overwrite(models, tmp_path, capsys):
    target = tmp_path / "head.bin"
    target.write_bytes(b"not a folder")
    for extra in ([], ["--overwrite"]):
        assert export_main(["--to", "sglang", str(models / "head"), str(target), *extra]) == 2
        assert "is a file" in capsys.readouterr().err
    assert target.read_bytes() == b"not a folder"


def test_export_checks_the_output_before_reading_anything(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert export_main(["--to", "vllm", str(tmp_path / "no-such-head"), str(tmp_path / "out")]) == 2
    assert "is not empty" in capsys.readouterr().err  # the output is named, not the missing head


def test_export_replaces_only_an_earlier_export_of_the_same_layout(models, tmp_path, capsys):
    out = tmp_path / "vllm"
    assert export_main(["--to", "vllm", str(models / "head"), str(out)]) == 0
    assert json.loads((out / MARKER).read_text()) == {"kind": "eagle-tree export --to vllm"}
    assert export_main(["--to", "vllm", str(models / "head"), str(out), "--dtype", "bfloat16"]) == 0  # again: fine
    assert export_main(["--to", "sglang", str(models / "head"), str(out)]) == 2  # another layout
    assert "an output of eagle-tree export --to vllm" in capsys.readouterr().err
    (out / "README.md").write_text("my notes")
    assert export_main(["--to", "vllm", str(models / "head"), str(out)]) == 2
    assert "README.md" in capsys.readouterr().err and (out / "README.md").read_text() == "my notes"
    assert export_main(["--to", "sglang", str(models / "head"), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json", "model.safetensors"]
    (out / MARKER).unlink()  # an export written before exports were marked is still recognised
    assert export_main(["--to", "sglang", str(models / "head"), str(out)]) == 0
    assert export_main(["--to", "vllm", str(models / "head"), str(out)]) == 2


# ----------------------------------------------------------------------------------------- bad inputs, named
@pytest.fixture(scope="module")
def bad_inputs(models):
    """A head with a NaN weight, a small target (64 ids, 64 positions), and prompt files of every bad kind."""
    import torch

    from eagle_tree.data.tiny import char_tokenizer, tiny_causal_lm
    from eagle_tree.models.head import Eagle3DraftModel

    root = models
    head = Eagle3DraftModel.from_pretrained(root / "head")
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    head.save_pretrained(root / "nan-head")
    tok = char_tokenizer()
    small = tiny_causal_lm("llama", vocab_size=64, num_layers=4, max_position_embeddings=64)
    small.save_pretrained(root / "small")
    tok.save_pretrained(root / "small")
    (root / "empty.jsonl").write_text("\n\n")
    (root / "badline.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "broken\n')
    (root / "rows.json").write_text('{"prompt": "def g():"}\n{"prompt": "x = 1"}\n')
    (root / "notext.jsonl").write_text('{"text": "x"}\n')
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "file.txt").write_text("a regular file")
    (root / "foreign.json").write_text('{"mine": true}')
    return root


DECODE_REFUSALS = [  # (overrides, words of the message); {r} is the fixture folder
    (["limit=0"], "limit must be an integer >= 1 or null (all prompts), got 0"),
    (["mode=chain", "chain_length=0"], "chain_length must be an integer >= 1, got 0"),
    (["max_new_tokens=0"], "max_new_tokens must be an integer >= 1"),
    (["prompts={r}/empty.jsonl"], "empty.jsonl holds no prompts"),
    (["prompts={r}/badline.jsonl"], "badline.jsonl:2: not valid JSON"),
    (["prompts={r}/notext.jsonl"], "notext.jsonl:1: expected a 'prompt' field"),
    (["prompts={r}/latin1.txt"], "latin1.txt is not UTF-8 text"),
    (["prompts={r}/missing.jsonl"], "missing.jsonl' does not exist"),
    (["prompt=''"], "config key prompt is blank ('')"),
    (["target={r}/no/such/target"], "no/such/target: no such folder"),
    (["target={r}/file.txt"], "file.txt is a file; expected a model folder"),
    (["target={r}/head"], "is an EAGLE-3 draft head, not a target model: pass it as head="),
    (["head={r}/no-head"], "head={r}/no-head: no such folder"),
    (["head={r}/nan-head"], "has non-finite (NaN or infinite) weights in fc.weight"),
    (["target={r}/small", "mode=plain", "prompt=zzz"], "token id 92, outside the target's vocabulary of 64"),
    (["target={r}/small", "mode=plain", "prompt=" + "0" * 60, "max_new_tokens=8"],
     "has 60 tokens; with max_new_tokens=8 it needs 68 positions, but the target has 64"),
    (["target={r}/small", "mode=plain", "prompt=0", "max_new_tokens=64"], "leaves no room for a prompt"),
    (["output={r}"], "is a folder; eagle-tree decode writes a file there"),
    (["output={r}/file.txt/out.json"], "file.txt is a file, not a folder"),
    (["output={r}/foreign.json"], "foreign.json already exists and is not an earlier output of eagle-tree decode"),
]


@pytest.mark.parametrize("overrides, message", DECODE_REFUSALS, ids=[" ".join(c[0])[:40] for c in DECODE_REFUSALS])
def test_decode_refuses_with_a_message_before_decoding(bad_inputs, overrides, message, capsys):
    from eagle_tree.commands.decode import main

    r = bad_inputs
    args = [f"target={r / 'target'}", f"head={r / 'head'}", f"prompts={r / 'prompts.jsonl'}", "max_new_tokens=4",
            "wandb.mode=disabled", *(o.format(r=r) for o in overrides)]
    try:
        code = main(args)
    except SystemExit as exc:  # a config value out of range: the parser's usage error
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert message.format(r=r) in captured.err
    assert "--- prompt" not in captured.out  # nothing was decoded
    assert (r / "foreign.json").read_text() == '{"mine": true}'


def test_decode_reads_json_rows_and_cuts_long_prompts_only_when_asked(bad_inputs, tmp_path):
    from eagle_tree.commands.decode import main

    r = bad_inputs
    common = [f"target={r / 'target'}", f"head={r / 'head'}", "max_new_tokens=4", "wandb.mode=disabled"]
    out = tmp_path / "rows.json"
    assert main([*common, f"prompts={r / 'rows.json'}", f"output={out}"]) == 0
    assert [p["prompt"] for p in json.loads(out.read_text())["prompts"]] == ["def g():", "x = 1"]
    assert main([*common, f"prompts={r / 'rows.json'}", f"output={out}", "limit=1"]) == 0  # its own output: fine
    assert len(json.loads(out.read_text())["prompts"]) == 1
    long = "0123456789" * 6
    small = [f"target={r / 'small'}", "mode=plain", f"prompt={long}", "max_new_tokens=8", "wandb.mode=disabled"]
    assert main([*small, "truncate_prompts=left", f"output={tmp_path / 'cut.json'}"]) == 0
    summary = json.loads((tmp_path / "cut.json").read_text())["summary"]
    assert summary["tokens"] == 8  # 56 prompt tokens kept + 8 new = the target's 64 positions


def test_decode_output_overwrite(bad_inputs, tmp_path, capsys):
    from eagle_tree.commands.decode import main

    r = bad_inputs
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    args = [f"target={r / 'target'}", "mode=plain", "prompt=x", "max_new_tokens=2", "wandb.mode=disabled",
            f"output={mine}"]
    assert main(args) == 2 and "overwrite=true" in capsys.readouterr().err
    assert main([*args, "overwrite=true"]) == 0
    assert set(json.loads(mine.read_text())) == {"summary", "prompts"}


@pytest.mark.parametrize("command", ["decode", "bench"])
def test_help_shows_the_real_sampling_defaults(command, capsys):
    import importlib

    module = importlib.import_module(f"eagle_tree.commands.{command}")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    text = capsys.readouterr().out
    assert "sampling.temperature: float = 0.0" in text and "truncate_prompts: off|left = 'off'" in text
    schema = module.DecodeConfig if command == "decode" else module.BenchConfig
    assert schema().sampling.temperature == 0.0 and schema().sampling.greedy


def test_help_shows_nested_defaults_of_the_factory(capsys):
    from eagle_tree.commands.quickstart import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "tree.depth: int = 5" in capsys.readouterr().out  # QuickstartConfig.tree = TreeConfig(depth=5, ...)


# ----------------------------------------------------------------------------------------- export and bench
def test_export_refuses_a_nan_head_and_a_head_as_target(bad_inputs, tmp_path, capsys):
    r = bad_inputs
    assert export_main(["--to", "vllm", str(r / "no-head"), str(tmp_path / "out")]) == 2
    assert "no-head holds no config.json; is this an EAGLE-3 head folder?" in capsys.readouterr().err
    assert export_main(["--to", "vllm", str(r / "head"), str(tmp_path / "out"), "--target", "./no/target"]) == 2
    assert "--target=./no/target: no such folder" in capsys.readouterr().err
    assert export_main(["--to", "vllm", str(r / "nan-head"), str(tmp_path / "out")]) == 2
    assert "non-finite (NaN or infinite) weights in fc.weight" in capsys.readouterr().err
    assert export_main(["--to", "vllm", str(r / "head"), str(tmp_path / "out"), "--target", str(r / "head")]) == 2
    assert "is an EAGLE-3 draft head, not a target model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override, message", [
    ("repeats=0", "repeats must be an integer >= 1, got 0"),
    ("test_limit=0", "test_limit must be an integer >= 1 or null (all prompts), got 0"),
    ("chain_lengths=[2, 0]", "chain_lengths[1] must be an integer >= 1, got 0"),
    ("warmup=-1", "warmup must be an integer >= 0"),
])
def test_bench_config_ranges(override, message, capsys):
    from eagle_tree.commands.bench import main

    with pytest.raises(SystemExit) as exc:
        main([override])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bench_never_replaces_files_it_did_not_write(bad_inputs, tmp_path, capsys):
    from eagle_tree.commands.bench import main

    out = tmp_path / "results"
    out.mkdir()
    (out / "bench.md").write_text("my own notes")
    assert main([f"output_dir={out}", "wandb.mode=disabled"]) == 2
    assert "already holds bench.md, not written by eagle-tree bench" in capsys.readouterr().err
    assert (out / "bench.md").read_text() == "my own notes"
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "data.txt").write_text("keep")
    assert main([f"output_dir={tmp_path / 'b'}", f"tiny_assets={assets}", "wandb.mode=disabled"]) == 2
    assert "is not empty and is not an earlier tiny_assets build" in capsys.readouterr().err
    assert (assets / "data.txt").read_text() == "keep"
    assert main([f"output_dir={out / 'file'}", f"test_prompts={bad_inputs / 'badline.jsonl'}"]) == 2
    assert "badline.jsonl:2: not valid JSON" in capsys.readouterr().err


def test_quickstart_refuses_a_foreign_output_folder_before_training(models, tmp_path, capsys):
    from eagle_tree.commands.quickstart import main

    out = tmp_path / "qs"
    out.mkdir()
    (out / "summary.json").write_text("[]")
    assert main([f"output_dir={out}", f"target={models / 'target'}", f"prompts={models / 'prompts.jsonl'}"]) == 2
    assert "already holds summary.json" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
    assert main([f"output_dir={tmp_path / 'new'}", f"target={tmp_path / 'none'}"]) == 2
    assert "no target at" in capsys.readouterr().err and not (tmp_path / "new").exists()
    missing = tmp_path / "p.jsonl"
    assert main([f"output_dir={tmp_path / 'new'}", f"target={models / 'target'}", f"prompts={missing}"]) == 2
    assert "p.jsonl' does not exist" in capsys.readouterr().err and not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------------------- the helpers
def test_check_finite_weights_names_the_tensors():
    import torch

    from eagle_tree.utils.checks import InputError, check_finite_weights

    module = torch.nn.Linear(3, 2)
    check_finite_weights(module, "a finite module")  # negative control: nothing to refuse
    check_finite_weights({"steps": torch.tensor([3])}, "integer tensors are not weights")
    module.register_buffer("scale", torch.tensor([float("inf")]))
    with pytest.raises(InputError, match="a module has non-finite .* in scale"):
        check_finite_weights(module, "a module")
    with pytest.raises(InputError, match="in w"):
        check_finite_weights({"w": torch.tensor([float("nan")]), "b": torch.zeros(1)}, "a state")


def test_prompt_file_forms(tmp_path):
    from eagle_tree.utils.prompts import PromptError, read_prompt_file, read_prompts

    (tmp_path / "list.json").write_text('["a", {"prompt": "b"}]')
    assert read_prompts(tmp_path / "list.json") == ["a", "b"]
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert [(p.text, p.where.rsplit(":", 1)[1]) for p in read_prompt_file(tmp_path / "p.txt")] == [("one", "1"),
                                                                                                   ("two", "3")]
    (tmp_path / "obj.json").write_text('{"prompt": "a", "x": [1,\n2]}')
    with pytest.raises(PromptError, match="expected a JSON list"):
        read_prompts(tmp_path / "obj.json")
    (tmp_path / "n.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(PromptError, match=r"n.jsonl:1: the 'prompt' field must be a string"):
        read_prompts(tmp_path / "n.jsonl")
    with pytest.raises(PromptError, match="is a folder"):
        read_prompts(tmp_path)


def test_documented_command_lines_parse(monkeypatch):
    """Every `eagle-tree decode / bench / export / demo / quickstart` line in README.md and docs/ parses."""
    import shlex
    from pathlib import Path

    from eagle_tree.commands.bench import BenchConfig
    from eagle_tree.commands.bench_serving import ServingBenchConfig
    from eagle_tree.commands.decode import DecodeConfig
    from eagle_tree.commands.demo import DemoConfig
    from eagle_tree.commands.quickstart import QuickstartConfig

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # --config paths are relative to the repository
    schemas = {"decode": (DecodeConfig, ()), "bench": (BenchConfig, ()), "demo": (DemoConfig, ()),
               "export": (ExportConfig, ("checkpoint", "out")), "quickstart": (QuickstartConfig, ())}
    seen = set()
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text().replace("\\\n", " ")  # shell line continuations
        for line in text.splitlines():
            words = shlex.split(line.split("  #")[0].strip()) if line.startswith("eagle-tree ") else []
            if len(words) < 2 or words[1] not in schemas:
                continue
            argv = [w.replace("...", "x") for w in words[2:]]
            schema = schemas[words[1]]
            if words[1] == "bench" and argv[:1] == ["serving"]:  # the serving sweep: its own config
                schema, argv = (ServingBenchConfig, ()), argv[1:]
                seen.add("bench serving")
            parse_flags(schema[0], argv, f"eagle-tree {words[1]}", schema[1])
            seen.add(words[1])
    assert {"decode", "bench", "bench serving", "export", "quickstart", "demo"} <= seen
