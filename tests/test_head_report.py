"""decode/head_report.py: the head-only report on a prompt file and on MT-bench's first turns (tiny GGUF chat model)."""

from __future__ import annotations

import json

import pytest

from eagle_tree.utils.checks import InputError
from tests.helpers import ROOT, load_script
from tests.tiny_gguf import write_tiny_gguf

QUESTIONS = [(81, "writing", "Write a joke.", "Shorter."), (82, "math", "What is 2 + 2?", "And 3 + 3?"),
             (83, "coding", "Sort a list in Python.", "In reverse?")]


def _module():
    return load_script("decode/head_report.py")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from eagle_tree.models.gguf import convert_gguf, load_tokenizer
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.models.target import TargetModel

    root = tmp_path_factory.mktemp("head_report")
    folder = convert_gguf(write_tiny_gguf(root / "tiny.gguf").path, root / "target")
    Eagle3DraftModel.from_target(TargetModel.from_pretrained(str(folder)), seed=0).save_pretrained(root / "head")
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [a, b]}) + "\n"
                                 for i, c, a, b in QUESTIONS))
    return {"folder": folder, "head": root / "head", "questions": questions, "tokenizer": load_tokenizer(str(folder))}


def test_mtbench_prompts_are_first_turns_rendered_as_the_bench_renders_them(chat):
    from eagle_tree.bench.mtbench import render

    mod = _module()
    cfg = mod.HeadReportConfig(target=str(chat["folder"]), mtbench=True, mtbench_questions=str(chat["questions"]),
                               num_prompts=2)
    texts, name, categories = mod.prompt_texts(cfg, chat["tokenizer"])
    assert categories == ["writing", "math"]
    assert texts == [render(chat["tokenizer"], [{"role": "user", "content": q}])
                     for q in ("Write a joke.", "What is 2 + 2?")]
    assert "<|im_start|>user\nWrite a joke.<|im_end|>" in texts[0] and "Shorter." not in texts[0]
    assert name.startswith("MT-bench turn 1 (") and "question.jsonl" in name
    # without mtbench=true the prompt file is read, not MT-bench
    prompts = chat["questions"].parent / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    plain = mod.HeadReportConfig(prompts=str(prompts), mtbench_questions=str(chat["questions"]))
    assert mod.prompt_texts(plain, chat["tokenizer"]) == (["hello there"], str(prompts), None)


def test_report_runs_on_mtbench(chat, capsys):
    mod = _module()
    assert mod.main([f"target={chat['folder']}", f"head={chat['head']}", "mtbench=true",
                     f"mtbench_questions={chat['questions']}", "num_prompts=3", "max_new_tokens=4",
                     "copy_num_prompts=1", "copy_max_new_tokens=4", "threads=1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_prompts"] == 3 and report["prompts"].startswith("MT-bench turn 1")
    assert len(report["agreement_per_step"]) == 4 and report["acceptance_length_chain"] >= 1.0
    assert {c: v["num_prompts"] for c, v in report["by_category"].items()} == {"writing": 1, "math": 1, "coding": 1}


def test_categories_pool_to_one_run_over_all_prompts():
    """The overall figures pooled from per-category runs equal one evaluation over every prompt; an
    unweighted mean of the parts (the negative control) does not. The shipped reference target and head:
    a trained head, so the parts differ in rounds and agreement."""
    from transformers import AutoTokenizer

    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.models.target import TargetModel
    from eagle_tree.training.config import EvalSection
    from eagle_tree.training.evaluate import evaluate_acceptance

    mod = _module()
    target = TargetModel.from_pretrained(str(ROOT / "assets" / "reference" / "target"))
    head = Eagle3DraftModel.from_pretrained(str(ROOT / "assets" / "reference" / "head"), target=target)
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "reference" / "target"))
    prompts = [tok(t, return_tensors="pt")["input_ids"][0] for t in
               ("def add(a, b):\n    return", "import os\nimport sys\n\n\nclass ", "for i in range(10):\n   ")]
    ev = EvalSection(max_new_tokens=24, chain_length=4, tree_depth=3, tree_top_k=2, tree_total_tokens=6)
    parts = [evaluate_acceptance(target, head, [prompts[0]], ev, agreement_steps=2),
             evaluate_acceptance(target, head, prompts[1:], ev, agreement_steps=2)]
    whole = evaluate_acceptance(target, head, prompts, ev, agreement_steps=2)
    got = mod.pooled(parts)
    for mode in ("chain", "tree"):
        assert got[f"acceptance_length_{mode}"] == pytest.approx(whole[f"acceptance_length_{mode}"], abs=1e-12)
    assert got["agreement"] == pytest.approx(whole["agreement"], abs=1e-12)
    assert got["overlap"] == pytest.approx(whole["overlap"], abs=1e-12)
    assert whole["overlap_counts"] == [sum(c) for c in zip(*(p["overlap_counts"] for p in parts), strict=True)]
    assert len(whole["overlap"]) == 2 and all(0.0 < a < 1.0 for a in whole["overlap"])
    assert whole["agreement_counts"] == [sum(c) for c in zip(*(p["agreement_counts"] for p in parts), strict=True)]
    # negative control: the unweighted mean of the parts is another figure
    assert parts[0]["rounds_chain"] != parts[1]["rounds_chain"]
    mean = sum(p["acceptance_length_chain"] for p in parts) / len(parts)
    assert mean != pytest.approx(whole["acceptance_length_chain"], abs=1e-6)


def test_missing_questions_file_is_named(chat, tmp_path):
    mod = _module()
    cfg = mod.HeadReportConfig(mtbench=True, mtbench_questions=str(tmp_path / "none.jsonl"))
    with pytest.raises(InputError, match="none.jsonl: no such file"):
        mod.prompt_texts(cfg, chat["tokenizer"])


def test_every_decode_stops_at_the_chat_models_eos(chat, monkeypatch, capsys):
    """The prompts' decodes and the copying set's both stop at the tokenizer's end-of-turn token (a
    split of the evaluation once dropped it from the copying set's call): each evaluate_acceptance call
    the report makes is given the eos id."""
    mod = _module()
    calls = []
    real = mod.evaluate_acceptance

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "evaluate_acceptance", recorded)
    assert mod.main([f"target={chat['folder']}", f"head={chat['head']}", "mtbench=true",
                     f"mtbench_questions={chat['questions']}", "num_prompts=2", "max_new_tokens=3",
                     "copy_num_prompts=1", "copy_max_new_tokens=3", "threads=1"]) == 0
    capsys.readouterr()
    eos = chat["tokenizer"].eos_token_id
    assert eos == 2  # <|im_end|> of the tiny ChatML file
    assert len(calls) == 3 and sum(bool(c.get("copy_ids")) for c in calls) == 1  # two categories, one copy set
    assert [c.get("eos_token_id") for c in calls] == [eos] * 3
