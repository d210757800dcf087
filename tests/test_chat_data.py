"""Chat data made by the target (eagle_tree.reference.chat_data) and its loss masks, on the tiny GGUF chat model.

The tokenizer is the tiny file's (tests/tiny_gguf.py): ChatML with SmolLM2's default system prompt, so
the Magpie prefix, the golden loss spans and the split files are those of the SmolLM2 recipe.

A random tiny model almost never samples ``<|im_end|>`` (0.3 % a step), so a Magpie prompt would
never end. The fixture ``ending_questions`` gives the real model, under the real ``sample``, an EOS
logit raised by ``EOS_BIAS`` while a user turn is sampled (about 22 % a step: questions of a few
tokens), and none while it replies; everything else (seeds, batches, filters, files) is the code's.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace

import pytest
import torch

import eagle_tree.reference.chat_data as chat_data
from eagle_tree.cli import main as cli_main
from eagle_tree.reference.chat_data import (
    MARKER,
    SPLITS,
    ChatDataConfig,
    build_chat_data,
    fingerprint,
    load_target,
    reply_prompt,
    sample,
    split_of,
    turn_prefix,
    usable_prompt,
)
from eagle_tree.training.data import encode_conversation
from eagle_tree.utils.prompts import read_prompt_file
from tests.helpers import ROOT
from tests.tiny_gguf import SYSTEM_PROMPT, write_tiny_gguf

SYSTEM = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
USER_HEADER = "<|im_start|>user\n"
EOS_BIAS = 5.0
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "Why did the cloud stay home?"},
]
FILES = ["train.jsonl", "tuning.jsonl", "test.jsonl", "tuning_prompts.jsonl", "test_prompts.jsonl",
         "tuning_turns.jsonl", "test_turns.jsonl", "stats.json"]


@pytest.fixture(scope="module")
def ending_questions(model, tokenizer):
    """(model, tokenizer) whose sampled user turns end after a few tokens (the module docstring)."""
    state = {"user_turn": False}

    def raise_eos(module, args, logits):
        if state["user_turn"]:
            logits = logits.clone()
            logits[..., tokenizer.eos_token_id] += EOS_BIAS
            return logits
        return None

    real_sample = chat_data.sample

    def sample_turn(model, tokenizer, texts, *args, **kwargs):
        state["user_turn"] = all(t[t.rindex("<|im_start|>"):].startswith(USER_HEADER) for t in texts)  # openers too
        try:
            return real_sample(model, tokenizer, texts, *args, **kwargs)
        finally:
            state["user_turn"] = False

    handle = model.lm_head.register_forward_hook(raise_eos)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chat_data, "sample", sample_turn)
        yield model, tokenizer
    handle.remove()


def _cfg(tiny, out, **kw) -> ChatDataConfig:
    base = dict(target=str(tiny.path), output=str(out), conversations=6, batch_size=3, max_prompt_tokens=8,
                min_prompt_chars=1, max_reply_tokens=8, tuning_fraction=0.25, test_fraction=0.25, progress=False)
    return ChatDataConfig(**{**base, **kw})


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.partial.jsonl").read_text().splitlines()
            if not line.startswith(f'{{"{MARKER}"')]


def _outputs(out) -> dict[str, str]:
    """The split files, and stats.json without its timings."""
    files = {name: (out / name).read_text() for name in FILES[:-1]}
    stats = json.loads((out / "stats.json").read_text())
    stats.pop("seconds")
    stats["settings"].pop("output")
    return {**files, "stats.json": json.dumps(stats, sort_keys=True)}


# ----------------------------------------------------------------------------- templates, masks


def test_turn_prefix_renders_the_system_prompt_and_opens_a_user_turn(tokenizer):
    assert turn_prefix(tokenizer, []) == SYSTEM + USER_HEADER
    assert turn_prefix(tokenizer, CONVERSATION[:2]) == (
        SYSTEM + USER_HEADER + "What is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n" + USER_HEADER)
    assert reply_prompt(tokenizer, CONVERSATION[:1]) == (
        SYSTEM + USER_HEADER + "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(turn_prefix(tokenizer, []), add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids.count(2) == 1  # specials whole


def test_turn_prefix_refuses_a_template_that_rewrites_the_content(tokenizer):
    lowered = copy.deepcopy(tokenizer)
    lowered.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | lower")
    with pytest.raises(ValueError, match="verbatim"):
        turn_prefix(lowered, [])


def _masked_runs(example, tokenizer) -> list[str]:
    runs, cur = [], []
    for i, m in zip(example["input_ids"], example["loss_mask"], strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]


def test_golden_loss_spans_are_the_replies_and_their_end_of_turn(tokenizer):
    """training/data.py's rule: the loss covers what the template writes after the assistant header,
    i.e. the reply and its <|im_end|>; not the header, not the "\\n" between turns, not the system prompt."""
    ex = encode_conversation(CONVERSATION, tokenizer)
    assert tokenizer.decode(ex["input_ids"]) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert _masked_runs(ex, tokenizer) == ["The capital of France is Paris.<|im_end|>",
                                          "Why did the cloud stay home?<|im_end|>"]
    tokens = tokenizer.convert_ids_to_tokens(ex["input_ids"])
    masked = [t for t, m in zip(tokens, ex["loss_mask"], strict=True) if m]
    assert masked[:2] == ["The", "Ġcapital"] and masked.count("<|im_end|>") == 2
    assert tokens[-1] == "Ċ" and ex["loss_mask"][-1] == 0  # the newline after the last <|im_end|>
    first = ex["loss_mask"].index(1)
    assert tokenizer.decode(ex["input_ids"][:first]) == reply_prompt(tokenizer, CONVERSATION[:1])
    assert sum(ex["loss_mask"]) == len(tokenizer(
        "The capital of France is Paris.<|im_end|>Why did the cloud stay home?<|im_end|>")["input_ids"])


# ----------------------------------------------------------------------------- pure helpers


def test_split_of_is_a_stable_hash_with_the_given_fractions():
    prompts = [f"Question number {i}: how do I sort a list?" for i in range(4000)]
    splits = [split_of(p, 0.1, 0.05) for p in prompts]
    assert splits == [split_of(p, 0.1, 0.05) for p in prompts]
    assert split_of("How do  I sort A list?", 0.1, 0.05) == split_of("how do i sort a list?", 0.1, 0.05)
    share = {s: splits.count(s) / len(prompts) for s in SPLITS}
    assert abs(share["tuning"] - 0.1) < 0.02 and abs(share["test"] - 0.05) < 0.015
    assert {split_of(p, 0.0, 0.0) for p in prompts[:200]} == {"train"}
    # nested: a larger tuning share only moves rows out of train and test into tuning
    wider = [split_of(p, 0.2, 0.05) for p in prompts]
    assert all(w == "tuning" for s, w in zip(splits, wider, strict=True) if s == "tuning")


def test_usable_prompt_drops_unfinished_short_and_marked_turns(tiny):
    cfg = ChatDataConfig(min_prompt_chars=5)
    assert usable_prompt("How are you?", True, cfg)
    assert not usable_prompt("How are you?", False, cfg)  # did not reach the end-of-turn token
    assert not usable_prompt("  Hi  ", True, cfg)
    assert not usable_prompt("Hello <|im_start|>assistant", True, cfg)
    assert not usable_prompt("Fine.\nAssistant: sure", True, cfg)


def test_fingerprint_ignores_size_time_and_paths_only(tiny, tokenizer, tmp_path):
    cfg = _cfg(tiny, tmp_path)
    fp = fingerprint(cfg, tokenizer)
    assert fp == fingerprint(replace(cfg, conversations=99, output="elsewhere", max_minutes=1.0, threads=1,
                                     target_prepack=True, progress=True, target="other"), tokenizer)
    for change in (dict(seed=1), dict(batch_size=4), dict(max_reply_tokens=9), dict(reply_temperature=0.5)):
        assert fingerprint(replace(cfg, **change), tokenizer) != fp, change


def test_sample_cuts_at_the_end_of_turn_and_is_seeded(ending_questions):
    model, tokenizer = ending_questions
    texts = [turn_prefix(tokenizer, []), turn_prefix(tokenizer, CONVERSATION[:2])] * 6  # left padding
    out = chat_data.sample(model, tokenizer, texts, 3, 1.0, 0.95, seed=3)
    assert out == chat_data.sample(model, tokenizer, texts, 3, 1.0, 0.95, seed=3)
    assert out != chat_data.sample(model, tokenizer, texts, 3, 1.0, 0.95, seed=4)
    assert len(out) == 12 and {ended for _, ended in out} == {True, False}  # about half end within 3 tokens
    for ids, ended in out:
        assert tokenizer.eos_token_id not in ids and (ended or len(ids) == 3)
    reply = [reply_prompt(tokenizer, CONVERSATION[:1])]  # a reply: greedy, no bias, the seed plays no part
    greedy = chat_data.sample(model, tokenizer, reply, 8, 0.0, 1.0, seed=0)
    assert greedy == chat_data.sample(model, tokenizer, reply, 8, 0.0, 1.0, seed=1) == sample(
        model, tokenizer, reply, 8, 0.0, 1.0, seed=2)


# ----------------------------------------------------------------------------- build_chat_data


@pytest.fixture(scope="module")
def built_once(ending_questions, tiny, tmp_path_factory):
    model, tokenizer = ending_questions
    out = tmp_path_factory.mktemp("chat-data") / "run"
    cfg = _cfg(tiny, out)
    return cfg, build_chat_data(cfg, model, tokenizer)


@pytest.fixture
def built(built_once, tmp_path):
    """A copy of one run of the small settings: (config, output folder, summary)."""
    cfg, summary = built_once
    out = tmp_path / "run"
    shutil.copytree(cfg.output, out)
    return replace(cfg, output=str(out)), out, summary


def test_build_chat_data_writes_the_splits_and_stats(built, tokenizer):
    cfg, out, summary = built
    assert {p.name for p in out.iterdir()} == {"rows.partial.jsonl", ".eagle-tree-output.json", *FILES}
    rows = _rows(out)
    assert summary["conversations"] == len(rows) >= 6 and summary["batches"] >= 2
    assert json.loads((out / "stats.json").read_text()) == summary
    assert summary["settings"]["conversations"] == 6 and summary["generated_reply_tokens"] > 0
    assert summary["batches_target_prepack"] == 0  # the fixture's run is on F.linear
    assert "by_category" not in summary  # no openers: the summary and rows of runs made before openers existed
    by_split = {s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()] for s in SPLITS}
    assert summary["by_split"] == {s: len(r) for s, r in by_split.items()}
    assert sorted(map(json.dumps, sum(by_split.values(), []))) == sorted(map(json.dumps, rows))
    firsts = set()
    for r in rows:
        conv = r["conversations"]
        assert len(conv) in (2, 4) and [m["role"] for m in conv] == ["user", "assistant"] * (len(conv) // 2)
        assert all(isinstance(m["content"], str) and set(m) == {"role", "content"} for m in conv)
        assert set(r) == {"conversations", "reply_temperature", "batch", "split"}
        assert all(m["content"].strip() and not chat_data.ROLE_MARKERS.search(m["content"])
                   for m in conv if m["role"] == "user")
        assert r["split"] == split_of(conv[0]["content"], cfg.tuning_fraction, cfg.test_fraction)
        assert r["reply_temperature"] == (0.0 if r["batch"] % 2 == 0 else cfg.reply_temperature)
        firsts.add(chat_data.normalise(conv[0]["content"]))
        assert any(encode_conversation(conv, tokenizer)["loss_mask"]) or not any(
            m["content"] for m in conv if m["role"] == "assistant")
    assert len(firsts) == len(rows)  # no repeated first prompt
    assert summary["two_turn"] == sum(len(r["conversations"]) == 4 for r in rows)
    for s in ("tuning", "test"):
        lines = [json.loads(line) for line in (out / f"{s}_prompts.jsonl").read_text().splitlines()]
        assert [p["id"] for p in lines] == [f"{s}-{i:03d}" for i in range(len(by_split[s]))]
        for p, r in zip(lines, by_split[s], strict=True):
            assert p["messages"] == r["conversations"][:1]
            assert p["prompt"] == reply_prompt(tokenizer, p["messages"])
            assert p["prompt"].startswith(SYSTEM) and p["prompt"].endswith("<|im_start|>assistant\n")


def test_rerun_with_the_count_reached_adds_no_batch(built, ending_questions, monkeypatch):
    cfg, out, summary = built
    model, tokenizer = ending_questions
    before, partial = _outputs(out), (out / "rows.partial.jsonl").read_text()
    monkeypatch.setattr(chat_data, "build_batch", lambda *a, **k: pytest.fail("a batch was built"))
    assert build_chat_data(cfg, model, tokenizer)["conversations"] == summary["conversations"]
    assert (out / "rows.partial.jsonl").read_text() == partial and _outputs(out) == before


def test_interrupted_run_resumes_to_the_same_rows(built, ending_questions, tmp_path, monkeypatch):
    cfg, out, _ = built
    model, tokenizer = ending_questions
    lines = (out / "rows.partial.jsonl").read_text().splitlines(keepends=True)
    markers = [i for i, line in enumerate(lines) if line.startswith(f'{{"{MARKER}"')]
    # the first batch b >= 1 with a row to tear; batches before it are kept
    b = next(b for b in range(1, len(markers)) if markers[b] - markers[b - 1] >= 2)
    done, end = markers[b - 1] + 1, markers[b]
    cuts = {"torn line": "".join(lines[:done]) + lines[done][: len(lines[done]) // 2],
            "no marker": "".join(lines[:end])}
    real_batch, built_batches = chat_data.build_batch, []

    def counted(model, tokenizer, cfg, b, seen, openers=None):
        built_batches.append(b)
        return real_batch(model, tokenizer, cfg, b, seen, openers)

    monkeypatch.setattr(chat_data, "build_batch", counted)
    for name, text in cuts.items():
        again = tmp_path / name.replace(" ", "-")
        again.mkdir()
        (again / "rows.partial.jsonl").write_text(text)
        built_batches.clear()
        build_chat_data(replace(cfg, output=str(again)), model, tokenizer)
        assert built_batches == list(range(b, len(markers))), name  # finished batches kept, not rebuilt
        assert _rows(again) == _rows(out), name
        assert _outputs(again) == _outputs(out), name


def test_larger_count_extends_the_file(built, ending_questions):
    cfg, out, summary = built
    model, tokenizer = ending_questions
    rows = _rows(out)
    bigger = build_chat_data(replace(cfg, conversations=summary["conversations"] + 2), model, tokenizer)
    assert bigger["batches"] > summary["batches"] and _rows(out)[: len(rows)] == rows


def test_other_settings_refuse_the_partial_file(built, ending_questions):
    cfg, out, _ = built
    model, tokenizer = ending_questions
    partial = (out / "rows.partial.jsonl").read_text()
    for change in (dict(seed=1), dict(max_reply_tokens=9)):
        with pytest.raises(ValueError, match="was written with other settings") as info:
            build_chat_data(replace(cfg, **change), model, tokenizer)
        assert "use another output folder" in str(info.value)
    assert (out / "rows.partial.jsonl").read_text() == partial


# ----------------------------------------------------------------------------- the target


def test_load_target_reads_a_gguf_chat_model(tiny, tmp_path):
    model, tokenizer = load_target(_cfg(tiny, tmp_path))
    assert model.config.vocab_size == tiny.vocab_size and not model.training and model.dtype == torch.float32
    assert turn_prefix(tokenizer, []) == SYSTEM + USER_HEADER
    with pytest.raises(ValueError, match="target= is required"):
        load_target(_cfg(tiny, tmp_path, target=""))
    plain = write_tiny_gguf(tmp_path / "plain.gguf", chat_template=None)
    with pytest.raises(ValueError, match="no chat_template"):
        load_target(_cfg(tiny, tmp_path, target=str(plain.path)))


def test_target_prepack_packs_the_linears_and_resumes_the_same_file(built, ending_questions, tiny, tmp_path):
    import copy

    from eagle_tree.models.prepack import PackedLinear, prepack_available, prepack_linears

    if not prepack_available():
        pytest.skip("this torch build lacks oneDNN's packed linear")
    plain, _ = load_target(_cfg(tiny, tmp_path))
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    model, tokenizer = load_target(_cfg(tiny, tmp_path, target_prepack=True))
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.one_row for m in packed)
    if model.config.tie_word_embeddings:  # the packed lm_head keeps the embedding's parameter
        assert model.lm_head.weight is model.get_input_embeddings().weight
    cfg, out, summary = built
    ending, tokenizer = ending_questions  # its lm_head hook ends user turns: carried over to a packed copy
    model = copy.deepcopy(ending)
    prepack_linears(model)
    for hook in ending.lm_head._forward_hooks.values():
        model.lm_head.register_forward_hook(hook)
    bigger = build_chat_data(replace(cfg, conversations=summary["conversations"] + 2, target_prepack=True),
                             model, tokenizer)  # the same fingerprint: the file resumes on the other kernels
    assert bigger["batches"] > summary["batches"]
    assert bigger["batches_target_prepack"] == bigger["batches"] - summary["batches"]


def test_turn_prompts_hold_each_first_turn_then_its_second_in_golden_text(tokenizer):
    one_turn = {"conversations": CONVERSATION[:2]}
    lines = chat_data.turn_prompts(tokenizer, "tuning", [{"conversations": CONVERSATION}, one_turn])
    assert [(t["id"], t["turn"]) for t in lines] == [("tuning-000-turn1", 1), ("tuning-000-turn2", 2),
                                                     ("tuning-001-turn1", 1)]
    assert lines[0]["prompt"] == lines[2]["prompt"] == (
        f"{SYSTEM}{USER_HEADER}What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert lines[1]["messages"] == CONVERSATION[:3]
    assert lines[1]["prompt"] == (
        f"{SYSTEM}{USER_HEADER}What is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n"
        f"{USER_HEADER}Tell me a joke.<|im_end|>\n<|im_start|>assistant\n")
    assert "Why did the cloud" not in lines[1]["prompt"]  # the second reply is what is decoded, never given


def test_built_turn_files_follow_the_first_turn_files(built, tokenizer):
    _, out, _ = built
    seconds = 0
    for s in ("tuning", "test"):
        firsts = [json.loads(line) for line in (out / f"{s}_prompts.jsonl").read_text().splitlines()]
        turns = [json.loads(line) for line in (out / f"{s}_turns.jsonl").read_text().splitlines()]
        assert [t["prompt"] for t in turns if t["turn"] == 1] == [p["prompt"] for p in firsts]
        rows = [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()]
        assert sum(t["turn"] == 2 for t in turns) == sum(len(r["conversations"]) == 4 for r in rows)
        assert [p.text for p in read_prompt_file(out / f"{s}_turns.jsonl")] == [t["prompt"] for t in turns]
        seconds += sum(t["turn"] == 2 for t in turns)
    assert seconds > 0  # the fixture's data holds second turns, so the checks above saw some


def test_cli_chat_data_with_no_time_writes_empty_splits(tiny, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["chat-data", f"target={tiny.path}", f"output={out}", "max_minutes=0", "progress=false"]) == 0
    assert capsys.readouterr().out.startswith("[eagle-tree chat-data] 0 conversations")
    assert json.loads((out / "stats.json").read_text())["conversations"] == 0
    assert cli_main(["chat-data", f"output={out}"]) == 2  # no target


def test_a_model_that_never_ends_a_user_turn_is_refused_not_looped(tiny, model, tokenizer, tmp_path, monkeypatch):
    import eagle_tree.reference.chat_data as chat_data

    calls = []

    def never_ends(model, tokenizer, texts, max_new_tokens, *args):
        calls.append(len(texts))
        return [([5] * max_new_tokens, False) for _ in texts]

    monkeypatch.setattr(chat_data, "sample", never_ends)
    cfg = _cfg(tiny, tmp_path / "out", conversations=4)
    with pytest.raises(ValueError, match=r"3 batches in a row gave no usable conversation.*eos token 2"):
        chat_data.build_chat_data(cfg, model=model, tokenizer=tokenizer)
    assert len(calls) == chat_data.EMPTY_BATCHES  # one prompt sampling per batch, then the refusal


def test_a_folder_holding_files_chat_data_did_not_write_is_refused(tiny, model, tokenizer, tmp_path):
    from eagle_tree.reference.chat_data import build_chat_data
    from eagle_tree.utils.outputs import OutputPathError

    out = tmp_path / "mine"
    out.mkdir()
    (out / "train.jsonl").write_text('{"text": "my own data"}\n')
    with pytest.raises(OutputPathError, match="train.jsonl"):
        build_chat_data(_cfg(tiny, out, conversations=1), model=model, tokenizer=tokenizer)
    assert (out / "train.jsonl").read_text() == '{"text": "my own data"}\n'


# ----------------------------------------------------------------------------- written openers

OPENERS = """\
first:
  writing: ["Write a short poem about", "Draft an email to  "]
  math: ["Solve step by step:"]
followup: ["Now make it shorter", "Explain why"]
"""


def _openers_file(tmp_path, text=OPENERS, name="openers.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_read_openers_parses_categories_and_plain_lists(tmp_path):
    op = chat_data.read_openers(_openers_file(tmp_path))
    assert op.first == (("writing", "Write a short poem about"), ("writing", "Draft an email to"),
                        ("math", "Solve step by step:"))  # trailing spaces stripped: a token the model never sees
    assert op.followup == ("Now make it shorter", "Explain why")
    plain = chat_data.read_openers(_openers_file(tmp_path, '{"first": ["Tell me", "List"]}', "plain.json"))
    assert plain.first == (("", "Tell me"), ("", "List")) and plain.followup == ()
    moved = chat_data.read_openers(_openers_file(tmp_path, OPENERS, "elsewhere.yaml"))
    assert moved.digest == op.digest != plain.digest


@pytest.mark.parametrize("text, match", [
    ("followup: [a]", "expected a mapping with 'first'"),
    ("first: [a]\nsecond: [b]", r"expected a mapping.*\['first', 'second'\]"),
    ("- a\n- b", "expected a mapping.*got list"),
    ("first: []", "first must be a non-empty list"),
    ("first: {writing: [Write, 3]}", r"first.writing\[1\] must be a non-empty string, got 3"),
    ("first: ['  ']", r"first\[0\] must be a non-empty string"),
    ("first:\n  - Solve this riddle:", r"first\[0\] must be a non-empty string.*quote it"),
    ('first: [Write]\nfollowup: ["Sure.\\nassistant: ok"]', r"followup\[0\] holds a role marker"),
    ("first: [a\n  b: c", "not YAML or JSON"),
])
def test_read_openers_names_what_is_wrong(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        chat_data.read_openers(_openers_file(tmp_path, text))


def test_read_openers_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file.*'first' list"):
        chat_data.read_openers(tmp_path / "missing.yaml")


def test_fingerprint_holds_the_openers_content_not_their_path(tiny, tokenizer, tmp_path):
    cfg = _cfg(tiny, tmp_path)
    a = replace(cfg, openers=str(_openers_file(tmp_path)))
    b = replace(cfg, openers=str(_openers_file(tmp_path, OPENERS, "copy.yaml")))
    c = replace(cfg, openers=str(_openers_file(tmp_path, OPENERS.replace("Explain why", "Say why"), "c.yaml")))
    assert fingerprint(a, tokenizer) == fingerprint(b, tokenizer)
    assert len({fingerprint(cfg, tokenizer), fingerprint(a, tokenizer), fingerprint(c, tokenizer)}) == 3


def test_the_shipped_data_still_resumes_under_these_settings(tokenizer):
    """A run without openers keeps the fingerprint it had before openers existed: the SmolLM2 data's
    partial file (written then) is resumed, not refused, by its own recorded settings."""
    data = ROOT / "assets" / "smollm2" / "data"
    settings = json.loads((data / "stats.json").read_text())["settings"]
    cfg = ChatDataConfig(**settings)
    assert cfg.openers is None
    with open(data / "rows.partial.jsonl") as f:
        marker = next(json.loads(line) for line in f if line.startswith(f'{{"{MARKER}"'))
    assert fingerprint(cfg, tokenizer) == marker["fingerprint"]
    assert fingerprint(replace(cfg, seed=1), tokenizer) != marker["fingerprint"]  # the check can fail


def test_openers_start_the_user_turns_the_model_completes(ending_questions, tiny, tmp_path, monkeypatch):
    model, tokenizer = ending_questions
    path = _openers_file(tmp_path)
    op = chat_data.read_openers(path)
    seen_texts = []
    real_sample = chat_data.sample

    def recorded(model, tokenizer, texts, *args, **kwargs):
        seen_texts.append(list(texts))
        return real_sample(model, tokenizer, texts, *args, **kwargs)

    monkeypatch.setattr(chat_data, "sample", recorded)
    cfg = _cfg(tiny, tmp_path / "out", openers=str(path), conversations=8, batch_size=4, max_prompt_tokens=6)
    summary = build_chat_data(cfg, model, tokenizer)
    rows = _rows(tmp_path / "out")
    assert summary["conversations"] == len(rows) >= 8
    firsts = {text for _, text in op.first}
    category = dict((text, cat) for cat, text in op.first)
    # the model is conditioned on the opener: every user-turn prompt it sampled from ends with one
    user_prompts = [t for batch in seen_texts for t in batch if t[t.rindex("<|im_start|>"):].startswith(USER_HEADER)]
    assert user_prompts and all(any(t.endswith(USER_HEADER + o) for o in firsts) or
                                any(t.endswith(USER_HEADER + o) for o in op.followup) for t in user_prompts)
    two_turn = 0
    for r in rows:
        started = r["openers"]
        assert started["first"] in firsts and started["category"] == category[started["first"]]
        assert r["conversations"][0]["content"].startswith(started["first"])
        if len(r["conversations"]) == 4:
            two_turn += 1
            assert started["followup"] in op.followup
            assert r["conversations"][2]["content"].startswith(started["followup"])
        else:
            assert started["followup"] is None
    assert two_turn > 0
    assert summary["by_category"] == {c: sum(r["openers"]["category"] == c for r in rows) for c in ("writing", "math")
                                      if any(r["openers"]["category"] == c for r in rows)}
    assert sum(summary["by_category"].values()) == len(rows)
    # repeatable: the same settings write the same rows
    again = build_chat_data(replace(cfg, output=str(tmp_path / "again")), model, tokenizer)
    assert _rows(tmp_path / "again") == rows and again["by_category"] == summary["by_category"]
