"""Data: chat-template loss masks (exact golden spans), file loading, length rule, batches, draft vocabulary.

Tokenizers are built locally: ``char`` is a byte-level BPE without merges (one token per ASCII
character, so golden positions can be counted by hand) and ``bpe`` is a byte-level BPE trained on a
few strings (multi-character tokens). Both add BOS to plain text and know the chat special tokens.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from eagle_tree.data.rows import normalize_messages
from eagle_tree.models.head_config import vocab_maps
from eagle_tree.training.data import (
    DataConfig,
    _mask_from_spans,
    batches,
    build_draft_vocab,
    draft_vocab_from_counts,
    encode_conversation,
    encode_text,
    epoch_batches,
    epoch_order,
    example_lengths,
    fit_length,
    load_examples,
    num_batches,
    padding_fraction,
    token_frequencies,
)
from eagle_tree.training.stream import DataStream
from eagle_tree.utils.config import ConfigValueError

SPECIALS = ["<pad>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# ChatML whose {% generation %} markers cover the content only (not <|im_end|>): they must win
CHATML_MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# renders the last message differently, so prefixes are not prefixes of the whole
CHATML_LAST = CHATML.replace("'<|im_end|>'", "('[last]' if loop.last else '') + '<|im_end|>'")

SHAREGPT = [
    {"from": "system", "value": "You are terse."},
    {"from": "human", "value": "Hi there"},
    {"from": "gpt", "value": "Hello! How can I help?"},
    {"from": "human", "value": "Tell me a joke"},
    {"from": "gpt", "value": "No."},
]
ROLE_CONTENT = [{"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]), "content": m["value"]}
                for m in SHAREGPT]
REPLIES = ["Hello! How can I help?", "No."]

# golden masked spans and the rendered text before the first one, per template
GOLDEN = {
    "chatml": {
        "spans": [r + "<|im_end|>" for r in REPLIES],  # the "\n" after <|im_end|> is not in the loss
        "before": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                  "<|im_start|>assistant\n",
        "after_last": "\n",
        "end": "<|im_end|>",
        # char tokenizer: system 1+6+1+14+1+1=24, user 1+4+1+8+1+1=16, header 1+9+1=11 -> reply at 51;
        # 22 characters then <|im_end|> at 73; 74 "\n", user 75..96, header 97..107, "No." 108..110, 111
        "positions": [(51, 73), (108, 111)],
        "length": 113,
    },
    "llama3": {
        "spans": [r + "<|eot_id|>" for r in REPLIES],
        "before": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "after_last": "",
        "end": "<|eot_id|>",
        # BOS 1, system 1+6+1+2+14+1=25, user 1+4+1+2+8+1=17, header 1+9+1+2=13 -> reply at 56;
        # <|eot_id|> at 78; user 79..101, header 102..114, "No." 115..117, <|eot_id|> 118
        "positions": [(56, 78), (115, 118)],
        "length": 119,
    },
}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}

CORPUS = [
    "Hello! How can I help?", "Tell me a joke", "You are terse.", "Hi there", "No.",
    "the quick brown fox jumps over the lazy dog", "system user assistant",
] * 4


@functools.cache
def _backend(kind: str) -> str:
    """A tokenizers JSON string: 'char' (no merges) or 'bpe' (trained on CORPUS)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "char":
        vocab = {t: i for i, t in enumerate(SPECIALS + sorted(alphabet))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    else:
        tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if kind == "bpe":
        trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                      show_progress=False)
        tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", SPECIALS.index("<|begin_of_text|>"))]
    )
    return tok.to_str()


def make_tokenizer(kind: str = "char", template: str | None = CHATML) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_backend(kind)), bos_token="<|begin_of_text|>", pad_token="<pad>",
        chat_template=template,
    )


def masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(first, last) positions, inclusive, of each run of 1s."""
    runs, first = [], None
    for j, v in enumerate([*mask, 0]):
        if v and first is None:
            first = j
        elif not v and first is not None:
            runs.append((first, j - 1))
            first = None
    return runs


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# loss masks


@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize("name", ["chatml", "llama3"])
@pytest.mark.parametrize("messages", [SHAREGPT, ROLE_CONTENT], ids=["from-value", "role-content"])
def test_assistant_spans_golden(kind, name, messages):
    tok = make_tokenizer(kind, TEMPLATES[name])
    golden = GOLDEN[name]
    norm = normalize_messages(messages)
    assert norm == normalize_messages(ROLE_CONTENT)
    ex = encode_conversation(norm, tok)
    ids, mask = ex["input_ids"], ex["loss_mask"]
    assert ids == tok.apply_chat_template(norm, tokenize=True, return_dict=True)["input_ids"]  # the template's own ids
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    runs = masked_runs(mask)
    assert [decode(tok, ids[a : b + 1]) for a, b in runs] == golden["spans"]
    first, last = runs[0][0], runs[-1][1]
    assert decode(tok, ids[:first]) == golden["before"]
    assert decode(tok, ids[last + 1 :]) == golden["after_last"]
    assert decode(tok, ids[last : last + 1]) == golden["end"]  # the end-of-turn token is the last one masked
    if kind == "char":
        assert runs == golden["positions"] and len(ids) == golden["length"]


def test_generation_markers_are_used_when_present():
    tok = make_tokenizer("char", CHATML_MARKED)
    ex = encode_conversation(normalize_messages(SHAREGPT), tok)
    assert [decode(tok, ex["input_ids"][a : b + 1]) for a, b in masked_runs(ex["loss_mask"])] == REPLIES


def test_inconsistent_template_is_refused():
    tok = make_tokenizer("char", CHATML_LAST)
    with pytest.raises(ValueError, match=r"messages\[:3\].*generation"):
        encode_conversation(normalize_messages(SHAREGPT), tok)


def test_token_straddling_a_span_boundary_is_in_the_loss():
    # offsets of 5 tokens; spans [3, 6) and [9, 10); token (2, 4) overlaps the first, (0, 0) is an added token
    offsets = [(0, 0), (0, 2), (2, 4), (4, 6), (6, 9), (9, 12)]
    assert _mask_from_spans(offsets, [(3, 6), (9, 10)]) == [0, 0, 1, 1, 0, 1]


def test_normalize_messages():
    msgs = [{"from": "gpt", "value": "orphan reply"}, {"from": "human", "value": "q"}, {"role": "assistant"},
            {"from": "gpt", "value": "a", "role": None, "content": None}]
    assert normalize_messages(msgs) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}, {"role": "assistant", "content": "a"}
    ]
    with pytest.raises(ValueError, match=r"fields \['text'\]; expected 'from' and 'value'"):
        normalize_messages([{"text": "x"}])
    with pytest.raises(ValueError, match="unknown message role 'narrator'"):
        normalize_messages([{"role": "narrator", "content": "x"}])


def test_plain_text_is_masked_in_full_except_bos():
    tok = make_tokenizer("bpe")
    ex = encode_text("the quick brown fox", tok)
    assert ex["input_ids"][0] == tok.bos_token_id and ex["loss_mask"][0] == 0
    assert all(ex["loss_mask"][1:]) and decode(tok, ex["input_ids"][1:]) == "the quick brown fox"


# ---------------------------------------------------------------------------------------------
# loading


def test_jsonl_conversations_both_conventions(tmp_path):
    tok = make_tokenizer("char", LLAMA3)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": SHAREGPT, "id": 1}, {"conversations": ROLE_CONTENT}])
    ds = load_examples(str(path), tok, cache_dir=str(tmp_path / "cache"))
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) == 2
    expected = encode_conversation(normalize_messages(ROLE_CONTENT), tok)
    assert ds[0] == expected and ds[1] == expected
    assert masked_runs(ds[0]["loss_mask"]) == GOLDEN["llama3"]["positions"]
    # a `messages` column, via a glob
    write_jsonl(tmp_path / "more.jsonl", [{"messages": ROLE_CONTENT}])
    ds = load_examples(str(tmp_path / "more*.jsonl"), tok, cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 1 and ds[0] == expected


def test_text_files_and_directory(tmp_path):
    tok = make_tokenizer("char")
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("ab\ncd\n")
    (tmp_path / "d" / "sub" / "b.txt").write_text("xyz")
    (tmp_path / "d" / ".hidden.txt").write_text("nope")
    docs = load_examples(str(tmp_path / "d"), tok, cache_dir=str(tmp_path / "cache"))
    assert [decode(tok, r["input_ids"][1:]) for r in docs] == ["ab\ncd\n", "xyz"]
    assert all(r["loss_mask"] == [0] + [1] * (len(r["input_ids"]) - 1) for r in docs)
    lines = load_examples(str(tmp_path / "d" / "a.txt"), tok, text_sample_by="line", cache_dir=str(tmp_path / "cache"))
    assert [decode(tok, r["input_ids"][1:]) for r in lines] == ["ab", "cd"]


def test_parquet_and_json_files(tmp_path):
    import datasets

    tok = make_tokenizer("char")
    rows = [{"body": "hello", "n": 1}, {"body": "", "n": 2}, {"body": "world!", "n": 3}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    (tmp_path / "t.json").write_text(json.dumps(rows))  # a JSON array, not JSON lines
    for name in ("t.parquet", "t.json"):
        ds = load_examples([str(tmp_path / name)], tok, text_field="body", cache_dir=str(tmp_path / "cache"))
        # the empty text has no loss token and is dropped
        assert [decode(tok, r["input_ids"]) for r in ds] == ["<|begin_of_text|>hello", "<|begin_of_text|>world!"]
    ds = load_examples(str(tmp_path / "t.parquet"), tok, text_field="body", limit=1, cache_dir=str(tmp_path / "c"))
    assert len(ds) == 1


def test_files_with_different_extra_columns_are_read_together(tmp_path):
    """Corpus text beside regenerated rows that carry metadata: the shared columns are kept, in order."""
    tok = make_tokenizer("char")
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "ab"}, {"text": "cd"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "xyz", "source_index": 0, "temperature": 1.0}])
    ds = load_examples([str(a), str(b)], tok, cache_dir=str(tmp_path / "cache"))
    assert [decode(tok, r["input_ids"][1:]) for r in ds] == ["ab", "cd", "xyz"]
    c = write_jsonl(tmp_path / "c.jsonl", [{"body": "q"}])
    with pytest.raises(ValueError, match="share no column"):
        load_examples([str(a), str(c)], tok, cache_dir=str(tmp_path / "cache"))


def test_missing_fields_error_names_them(tmp_path):
    tok = make_tokenizer("char")
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "a"}])
    with pytest.raises(ValueError, match=r"has fields \['prompt', 'answer'\]; expected a conversation field "
                                         r"\['conversations', 'messages'\].*text field \['text'\]"):
        load_examples(str(path), tok, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"no field 'body'.*fields found: \['prompt', 'answer'\]"):
        load_examples(str(path), tok, text_field="body", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError):
        load_examples(str(tmp_path / "missing.jsonl"), tok)


def test_truncate_and_drop(tmp_path):
    import datasets

    tok = make_tokenizer("char", CHATML)  # golden: replies at 51..73 and 108..111, length 113
    source = datasets.Dataset.from_list([{"conversations": SHAREGPT}])
    full = load_examples(source, tok)[0]
    assert len(full["input_ids"]) == 113
    cut = load_examples(source, tok, max_length=60)[0]
    assert cut["input_ids"] == full["input_ids"][:60] and masked_runs(cut["loss_mask"]) == [(51, 59)]
    assert len(load_examples(source, tok, max_length=51)) == 0  # cut before the first reply: no loss token
    assert len(load_examples(source, tok, max_length=112, too_long="drop")) == 0
    assert load_examples(source, tok, max_length=113, too_long="drop")[0] == full
    assert fit_length({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, 2) == {"input_ids": [1, 2], "loss_mask": [0, 1]}
    assert fit_length({"input_ids": [1, 2], "loss_mask": [0, 0]}, 5) is None
    with pytest.raises(ValueError, match="too_long"):
        load_examples(source, tok, too_long="wrap")


def test_data_config_loads(tmp_path):
    from eagle_tree.utils.config import load_config

    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "abc"}, {"text": "abcdefgh"}])
    cfg = load_config(DataConfig, None, [f"path={path}", "max_length=4", "too_long=drop",
                                         f"cache_dir={tmp_path / 'cache'}"])
    ds = cfg.load(make_tokenizer("char"))
    assert [len(r["input_ids"]) for r in ds] == [4]
    with pytest.raises(ValueError, match="too_long"):
        DataConfig(path="x", too_long="wrap")


# ---------------------------------------------------------------------------------------------
# batches


def _toy_examples(n: int = 11) -> list[dict]:
    return [{"input_ids": list(range(100 + i, 100 + i + 1 + i % 4)), "loss_mask": [i % 2] + [1] * (i % 4)}
            for i in range(n)]


def _as_tuple(batch):
    return (batch.input_ids.tolist(), batch.loss_mask.tolist(), batch.lengths.tolist(), batch.indices, batch.index)


def test_batches_deterministic_padded_and_complete():
    examples = _toy_examples()
    run = [_as_tuple(b) for b in batches(examples, 3, seed=7, epoch=2, pad_id=-1)]
    assert run == [_as_tuple(b) for b in batches(examples, 3, seed=7, epoch=2, pad_id=-1)]
    assert [b[3] for b in run] != [b[3] for b in map(_as_tuple, batches(examples, 3, seed=7, epoch=3))]
    assert [b[4] for b in run] == [0, 1, 2, 3] and [len(b[3]) for b in run] == [3, 3, 3, 2]
    assert sorted(i for b in run for i in b[3]) == list(range(11))
    assert [i for b in run for i in b[3]] == epoch_order(11, 7, 2).tolist()
    for ids, mask, lengths, indices, _ in run:
        for row, i in enumerate(indices):
            n = len(examples[i]["input_ids"])
            assert lengths[row] == n
            assert ids[row] == examples[i]["input_ids"] + [-1] * (len(ids[row]) - n)
            assert mask[row] == examples[i]["loss_mask"] + [0] * (len(ids[row]) - n)
    b = next(batches(examples, 3, seed=7, epoch=2))
    assert b.attention_mask.tolist() == [[1] * n + [0] * (b.input_ids.shape[1] - n) for n in b.lengths.tolist()]
    assert len(list(batches(examples, 3, seed=7, epoch=2, drop_last=True))) == 3


@pytest.mark.parametrize("start", [0, 1, 3, 4])
def test_batches_skip_to_position(start):
    import datasets

    examples = _toy_examples()
    full = [_as_tuple(b) for b in batches(examples, 3, seed=1, epoch=0)]
    assert [_as_tuple(b) for b in batches(examples, 3, seed=1, epoch=0, start=start)] == full[start:]
    ds = datasets.Dataset.from_list(examples)  # a Dataset gives the same batches as the list
    assert [_as_tuple(b) for b in batches(ds, 3, seed=1, epoch=0, start=start)] == full[start:]


def _varied_examples(n: int = 50) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"input_ids": list(range(int(k))), "loss_mask": [1] * int(k)} for k in rng.integers(1, 60, size=n)]


@pytest.mark.parametrize("grouping", [1, 3, 100])
def test_length_grouped_batches_hold_every_example_once_and_cut_padding(grouping):
    examples = _varied_examples()
    lengths = example_lengths(examples)
    assert lengths.tolist() == [len(e["input_ids"]) for e in examples]
    plain = epoch_batches(50, 4, seed=2, epoch=1)
    grouped = epoch_batches(50, 4, seed=2, epoch=1, lengths=lengths, length_grouping=grouping)
    assert grouped == epoch_batches(50, 4, seed=2, epoch=1, lengths=lengths, length_grouping=grouping)
    assert sorted(i for b in grouped for i in b) == list(range(50))  # each example once
    assert len(grouped) == len(plain) == num_batches(50, 4)
    assert sorted(len(b) for b in grouped) == sorted(len(b) for b in plain)  # one partial batch of 2
    order = epoch_order(50, 2, 1)
    pool = grouping * 4
    for b in grouped:  # each batch lies in one pool, its examples longest first
        pools = {int(np.flatnonzero(order == i)[0]) // pool for i in b}
        assert len(pools) == 1
        assert list(lengths[b]) == sorted(lengths[b], reverse=True)
    if grouping == 1:  # pools of one batch: the random batches, each sorted, in a shuffled order
        assert sorted(map(sorted, grouped)) == sorted(map(sorted, plain))
        assert padding_fraction(grouped, lengths) == pytest.approx(padding_fraction(plain, lengths))
    else:
        assert padding_fraction(grouped, lengths) < 0.6 * padding_fraction(plain, lengths)
    other_epoch = epoch_batches(50, 4, seed=2, epoch=2, lengths=lengths, length_grouping=grouping)
    assert other_epoch != grouped
    dropped = epoch_batches(50, 4, seed=2, epoch=1, lengths=lengths, length_grouping=grouping, drop_last=True)
    assert len(dropped) == 12 and all(len(b) == 4 for b in dropped)


def test_length_grouping_zero_is_the_random_order_and_lengths_are_required():
    assert epoch_batches(11, 3, seed=7, epoch=2) == [b.indices for b in batches(_toy_examples(), 3, seed=7, epoch=2)]
    with pytest.raises(ValueError, match="needs the 11 examples' lengths"):
        epoch_batches(11, 3, seed=7, epoch=2, length_grouping=2)
    with pytest.raises(ValueError, match="length_grouping must be >= 0"):
        epoch_batches(11, 3, seed=7, epoch=2, length_grouping=-1)
    with pytest.raises(ConfigValueError, match="length_grouping"):
        DataConfig(path="x", length_grouping=-1)


@pytest.mark.parametrize("start", [0, 2, 12])
def test_length_grouped_batches_skip_to_position(start):
    import datasets

    examples = _varied_examples()
    full = [_as_tuple(b) for b in batches(examples, 4, seed=1, epoch=0, length_grouping=4)]
    assert [b[3] for b in full] == epoch_batches(50, 4, seed=1, epoch=0, lengths=example_lengths(examples),
                                                 length_grouping=4)
    assert [_as_tuple(b) for b in batches(examples, 4, seed=1, epoch=0, start=start, length_grouping=4)] == full[start:]
    ds = datasets.Dataset.from_list(examples)
    assert [_as_tuple(b) for b in batches(ds, 4, seed=1, epoch=0, start=start, length_grouping=4)] == full[start:]


def test_length_grouped_stream_resumes():
    examples = _varied_examples(30)
    lengths = example_lengths(examples)
    expected = [b for e in range(3) for b in epoch_batches(30, 4, seed=5, epoch=e, lengths=lengths, length_grouping=2)]
    stream = DataStream(examples, 4, seed=5, pad_id=0, length_grouping=2)
    assert [b.indices for b in stream.take(10)] == expected[:10]
    resumed = DataStream(examples, 4, seed=5, pad_id=0, length_grouping=2, **stream.position())
    assert [b.indices for b in resumed.take(5)] == expected[10:15]
    # control: a stream without grouping goes elsewhere
    assert [b.indices for b in DataStream(examples, 4, seed=5, pad_id=0).take(10)] != expected[:10]


# ---------------------------------------------------------------------------------------------
# draft vocabulary


# loss-masked counts: 5 x3, 2 x2, 7 x2, 9 x1; token 1 occurs 4 times but never under the loss mask
VOCAB_EXAMPLES = [
    {"input_ids": [1, 5, 2, 7], "loss_mask": [0, 1, 1, 1]},
    {"input_ids": [1, 1, 5, 5, 9], "loss_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [1, 2, 7], "loss_mask": [0, 1, 1]},
]


def test_token_frequencies():
    import datasets

    expected = [0, 0, 2, 0, 0, 3, 0, 2, 0, 1, 0, 0]
    assert token_frequencies(VOCAB_EXAMPLES, 12).tolist() == expected
    ds = datasets.Dataset.from_list(VOCAB_EXAMPLES)
    assert token_frequencies(ds, 12, chunk_tokens=2).tolist() == expected
    with pytest.raises(ValueError, match="outside"):
        token_frequencies(VOCAB_EXAMPLES, 8)


@pytest.mark.parametrize(
    "size, expected",
    [
        (1, [5]),
        (2, [2, 5]),  # 2 and 7 tie at 2: the smaller id wins
        (3, [2, 5, 7]),
        (4, [2, 5, 7, 9]),
        (5, [0, 2, 5, 7, 9]),  # only 4 ids seen: fill with the smallest unseen ids in order
        (6, [0, 1, 2, 5, 7, 9]),
        (12, list(range(12))),
        (50, list(range(12))),
    ],
)
def test_build_draft_vocab(size, expected):
    ids = build_draft_vocab(VOCAB_EXAMPLES, 12, size)
    assert ids.dtype == torch.long and ids.tolist() == expected
    d2t, t2d = vocab_maps(ids, 12)
    assert (torch.arange(len(ids)) + d2t).tolist() == expected and t2d.nonzero().flatten().tolist() == expected


def test_draft_vocab_from_counts_ties():
    counts = torch.tensor([4, 1, 4, 0, 1, 4])
    assert draft_vocab_from_counts(counts, 2).tolist() == [0, 2]
    assert draft_vocab_from_counts(counts, 4).tolist() == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        draft_vocab_from_counts(counts, 0)
