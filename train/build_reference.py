"""Build the reference target and assistant models on the Python standard-library corpus.

    python train/build_reference.py out=assets/reference
    python train/build_reference.py --help

Steps: split the stdlib sources by file (manifest.json), train a byte-level BPE on the train
split, train a Llama target and a small assistant LM with the same tokenizer, save both with
``save_pretrained`` (float16 weights, tokenizer files included), measure their held-out loss on
the test split, write greedy sample continuations and held-out prompts. Rerunning the same
command resumes from the checkpoints in ``work`` and keeps a model whose ``eval.json`` records
the same settings. Training time is turned into a fixed number of steps by timing a few steps
first (or set ``target_steps`` / ``assistant_steps``); the resolved step counts are recorded
(``build.json``, ``exact_command``) so the run can be repeated exactly.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_tree.data import corpus
from eagle_tree.reference import builder as ref
from eagle_tree.utils.atomic import write_text
from eagle_tree.utils.checks import check_ranges
from eagle_tree.utils.config import parse_cli


@dataclass
class BuildConfig:
    """Build the reference target and assistant models on the Python standard-library corpus."""

    out: str = "assets/reference"
    """output folder (shipped assets)"""
    work: str = str(Path(tempfile.gettempdir()) / "eagle_tree_reference")
    """folder for checkpoints and the step plan (not shipped)"""
    seed: int = 0
    """seed of the corpus split, the models and the data order"""
    threads: int = 1
    """torch CPU threads"""
    vocab_size: int = 1024
    """byte-level BPE vocabulary size"""
    seq_len: int = 512
    """tokens per training row"""
    batch_size: int = 4
    """rows per step"""
    lr: float = 3e-3
    """peak learning rate"""
    target_layers: int = 8
    """target decoder layers"""
    target_hidden: int = 256
    """target hidden size"""
    target_intermediate: int = 704
    """target MLP size"""
    embed_std: float = 1.0
    """std of the initial input embedding of both models (0 = library default, 0.02)"""
    minutes_target: float = 60.0
    """target training time, turned into a step count by timing a few steps"""
    target_steps: int | None = None
    """fixed target step count (overrides minutes_target)"""
    assistant_layers: int = 1
    """assistant decoder layers"""
    assistant_hidden: int = 256
    """assistant hidden size"""
    assistant_intermediate: int = 704
    """assistant MLP size"""
    minutes_assistant: float = 5.0
    """assistant training time"""
    assistant_steps: int | None = None
    """fixed assistant step count (overrides minutes_assistant)"""
    n_prompts: int = 64
    """held-out prompts written per split"""
    eval_every_min: float = 5.0
    """minutes between held-out evaluations during training"""

    def __post_init__(self) -> None:
        check_ranges(self, threads=1, vocab_size=2, seq_len=2, batch_size=1, target_layers=1, assistant_layers=1,
                 target_steps=1, assistant_steps=1, n_prompts=1, embed_std=0.0)


def plan_steps(name: str, model, rows, cfg: ref.TrainConfig, minutes: float, fixed: int | None,
               work: Path) -> int:
    """Fixed step count for a run: given, recorded from an earlier attempt, or timed now."""
    plan = work / f"{name}_plan.json"
    if fixed is not None:
        return fixed
    if plan.exists():
        return json.loads(plan.read_text())["steps"]
    step_s = ref.measure_step_time(model, rows, cfg)
    steps = max(20, int(minutes * 60 / step_s))
    write_text(plan, json.dumps({"steps": steps, "measured_step_s": step_s, "minutes": minutes}) + "\n")
    print(f"[{name}] {step_s:.3f} s/step -> {steps} steps for {minutes} min")
    return steps


def build_one(name: str, spec: ref.ModelSpec, minutes: float, fixed_steps: int | None, args, tok,
              rows: dict, test_files, work: Path, out: Path) -> dict:
    model = ref.build_llama(spec, tok, seed=args.seed)
    cfg = ref.TrainConfig(steps=1, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                          seed=args.seed, eval_every_s=args.eval_every_min * 60)
    cfg.steps = plan_steps(name, model, rows["train"], cfg, minutes, fixed_steps, work)
    cfg.warmup_steps = min(100, max(10, cfg.steps // 20))
    done = out / name / "eval.json"
    if done.exists():  # built by an earlier run of this recipe with the same settings: keep it
        record = json.loads(done.read_text())
        if record["train_config"] == asdict(cfg) and record["model_spec"] == asdict(spec):
            record["exact_command"] = _command({f"{name}_steps": cfg.steps})
            write_text(done, json.dumps(record, indent=1) + "\n")
            print(f"[{name}] already built (test loss {record['test_loss']}); delete {done} to rebuild")
            return record
    result = ref.train_lm(model, rows["train"], rows["tuning"], cfg, checkpoint=work / f"{name}.ckpt", desc=name)
    size = ref.save_model(model, tok, out / name, dtype=torch.float16)
    shipped, _ = ref.load_model(out / name)  # what users get: float16 weights read as float32
    t0 = time.perf_counter()
    test_loss = ref.evaluate_loss(shipped, rows["test"])
    tuning_loss = ref.evaluate_loss(shipped, rows["tuning"])
    eval_s = time.perf_counter() - t0
    sample_prompts = [text for _, text in test_files[:4]]
    samples = ref.greedy_samples(shipped, tok, [p[:400].rsplit("\n", 1)[0] + "\n" for p in sample_prompts])
    write_text(out / name / "samples.txt", "".join(
        f"===== prompt (test split) =====\n{prompt[:400].rsplit(chr(10), 1)[0]}\n"
        f"===== greedy continuation (64 tokens) =====\n{cont}\n\n"
        for prompt, cont in zip(sample_prompts, samples, strict=True)))
    record = {
        "model": name, "test_loss": round(test_loss, 4), "tuning_loss": round(tuning_loss, 4),
        "loss_unit": f"nats per token, mean over the split packed into {args.seq_len}-token rows",
        "test_tokens": sum(len(r) - 1 for r in rows["test"]), "eval_wall_s": round(eval_s, 1),
        "params": ref.n_params(shipped), "layers": spec.layers, "bytes_on_disk": size,
        "weights_dtype": "float16 (load with dtype=torch.float32)", "train": asdict(result),
        "model_spec": asdict(spec), "train_config": asdict(cfg), "torch_threads": args.threads,
        "python": sys.version, "torch": torch.__version__,
        "command": _command(),
        "exact_command": _command({f"{name}_steps": cfg.steps}),
    }
    write_text(out / name / "eval.json", json.dumps(record, indent=1) + "\n")
    print(f"[{name}] test loss {test_loss:.4f}  tuning loss {tuning_loss:.4f}  {result.tokens_per_s:.0f} tok/s "
          f"{result.wall_s / 60:.1f} min  {size / 1e6:.2f} MB")
    return record


def _command(pinned: dict[str, int] | None = None) -> str:
    """This run's command line, optionally with step counts pinned (replacing any given)."""
    argv = [a for a in sys.argv[1:] if a.partition("=")[0] not in (pinned or {})]
    argv += [f"{k}={v}" for k, v in (pinned or {}).items()]
    return "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *argv])


def main(argv=None) -> None:
    args = parse_cli(BuildConfig, sys.argv[1:] if argv is None else argv, prog="build_reference.py")
    torch.set_num_threads(args.threads)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        manifest = corpus.Manifest.load(manifest_path)
    else:
        manifest = corpus.build_manifest(seed=args.seed)
        manifest.save(manifest_path)
    files = {s: corpus.load_split(manifest, s) for s in corpus.SPLITS}
    print("corpus: " + ", ".join(f"{s} {len(files[s])} files" for s in corpus.SPLITS))

    tok_dir = work / f"tokenizer_{args.vocab_size}"
    if tok_dir.exists():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tok = ref.train_tokenizer([t for _, t in files["train"]], vocab_size=args.vocab_size)
        tok.save_pretrained(tok_dir)
    streams = {s: ref.encode_files(tok, [t for _, t in files[s]]) for s in corpus.SPLITS}
    print("tokens: " + ", ".join(f"{s} {len(streams[s])}" for s in corpus.SPLITS))
    rows = {"train": ref.pack(streams["train"], args.seq_len),
            "tuning": ref.pack(streams["tuning"], args.seq_len, keep_remainder=True),
            "test": ref.pack(streams["test"], args.seq_len, keep_remainder=True)}

    target_spec = ref.ModelSpec(layers=args.target_layers, hidden=args.target_hidden,
                                intermediate=args.target_intermediate, embed_std=args.embed_std or None)
    assistant_spec = ref.ModelSpec(layers=args.assistant_layers, hidden=args.assistant_hidden,
                                   intermediate=args.assistant_intermediate, embed_std=args.embed_std or None)
    records = [
        build_one("target", target_spec, args.minutes_target, args.target_steps, args, tok, rows,
                  files["test"], work, out),
        build_one("assistant", assistant_spec, args.minutes_assistant, args.assistant_steps, args, tok,
                  rows, files["test"], work, out),
    ]

    (out / "prompts").mkdir(exist_ok=True)
    for split in ("tuning", "test"):
        prompts = ref.extract_prompts(tok, files[split], n=args.n_prompts, seed=args.seed, prefix=f"{split}-")
        write_text(out / "prompts" / f"{split}.jsonl", "".join(json.dumps(row) + "\n" for row in prompts))
        print(f"prompts/{split}.jsonl: {len(prompts)} prompts")
    total = sum(ref.folder_bytes(out / r["model"]) for r in records)
    build = {"command": _command(),
             "exact_command": _command({f"{r['model']}_steps": r["train_config"]["steps"] for r in records}),
             "python": sys.version, "models_bytes": total,
             "test_loss": {r["model"]: r["test_loss"] for r in records}}
    write_text(out / "build.json", json.dumps(build, indent=1) + "\n")
    print(f"models on disk: {total / 1e6:.2f} MB (limit 25 MB)")
    print(f"exact rebuild: {build['exact_command']}")


if __name__ == "__main__":
    main()
