"""Which kernels pay on this host for the jobs around a head: chat-data generation, feature extraction
and training steps (docs/MEASURING.md, "The rest of the pipeline on the same host").

    python train/host_kernels.py --target $(eagle-tree reference smollm2 | tail -1) --head assets/smollm2/head
    python train/host_kernels.py --threads 2 --repeats 5 --batch 16

Interleaved calls (the one timing harness), medians of ``--repeats``:

- ``generate``: Hugging Face ``generate`` of ``--new-tokens`` greedy tokens for a left-padded batch of
  ``--batch`` chat prompts (what ``eagle-tree chat-data`` runs), on the target with ``F.linear`` weights
  and on a copy with oneDNN-packed ones (``target_prepack: true`` there);
- ``prefill``: one forward of ``--prefill`` tokens with the fused features (what feature extraction runs,
  ``target.prepack=true``), the same two copies;
- ``train step``: one training-time-test step of the head (forward and backward, ``--train-batch`` rows of
  ``--prefill`` tokens, 3 draft steps) in float32 and under bfloat16 autocast (``optim.mixed_precision=bf16``).

Prints per job the two medians, their ratio, and a check: the same greedy tokens, the same argmax of the
last logits, the relative difference of the two losses.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from eagle_tree.bench.timing import interleave

PROMPTS = ["Write a short poem about the sea.", "Explain photosynthesis in simple terms.",
           "How do I sort a list in Python?", "What are three tips for better sleep?"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="a chat model folder (its tokenizer has a chat template)")
    p.add_argument("--head", default=None, help="a head folder for the training step (omit: no training row)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="rows of the generate call")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill", type=int, default=500, help="tokens of the prefill and of each training row")
    p.add_argument("--train-batch", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from eagle_tree.models.gguf import load_tokenizer
    from eagle_tree.models.target import TargetModel
    from eagle_tree.reference.chat_data import reply_prompt, sample

    tokenizer = load_tokenizer(args.target)
    plain = TargetModel.from_pretrained(args.target)
    packed = TargetModel.from_pretrained(args.target, prepack=True)  # as target_prepack / target.prepack load it
    texts = [reply_prompt(tokenizer, [{"role": "user", "content": q}]) for q in PROMPTS]
    texts = (texts * (args.batch // len(texts) + 1))[: args.batch]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, plain.vocab_size, (1, args.prefill), generator=g)

    def gen(model):
        return lambda _b: sample(model.model, tokenizer, texts, args.new_tokens, 0.0, 1.0, 0)

    def prefill(model):
        return lambda _b: torch.no_grad()(model.forward)(ids, model.new_cache()).logits[0, -1].argmax().item()

    calls = {"generate F.linear": gen(plain), "generate packed": gen(packed),
             "prefill F.linear": prefill(plain), "prefill packed": prefill(packed)}
    if args.head:
        calls.update(train_calls(args, plain))
    for fn in calls.values():  # warm-up, untimed
        fn(0)
    runs = interleave(calls, args.repeats)
    med = {name: statistics.median(t.seconds for t in runs[name]) for name in calls}
    last = {name: runs[name][-1].value for name in calls}

    print(f"target {args.target}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"medians of {args.repeats}, interleaved")
    print("| job | baseline, s | other kernels, s | speed-up | check |")
    print("|---|---|---|---|---|")
    same = [a[0] for a in last["generate F.linear"]] == [b[0] for b in last["generate packed"]]
    print(f"| generate, {args.batch} x {args.new_tokens} tokens: F.linear / packed | {med['generate F.linear']:.2f} "
          f"| {med['generate packed']:.2f} | {med['generate F.linear'] / med['generate packed']:.2f}x | "
          f"greedy tokens {'equal' if same else 'DIFFER'} |")
    same = last["prefill F.linear"] == last["prefill packed"]
    print(f"| prefill, {args.prefill} tokens: F.linear / packed | {med['prefill F.linear']:.2f} | "
          f"{med['prefill packed']:.2f} | {med['prefill F.linear'] / med['prefill packed']:.2f}x | "
          f"last argmax {'equal' if same else 'DIFFERS'} |")
    if args.head:
        a, b = last["train step float32"], last["train step bf16"]
        print(f"| train step, {args.train_batch} x {args.prefill} tokens: float32 / bf16 autocast | "
              f"{med['train step float32']:.2f} | {med['train step bf16']:.2f} | "
              f"{med['train step float32'] / med['train step bf16']:.2f}x | loss {a:.4f} / {b:.4f} "
              f"({abs(a - b) / abs(a):.1e} relative) |")


def train_calls(args, target) -> dict:
    """A training step of the head on the target's real features of random tokens, float32 and bf16."""
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.training.feature_cache import example_targets
    from eagle_tree.training.loop import TTTLoss

    for param in target.model.parameters():
        param.requires_grad_(False)
    draft = Eagle3DraftModel.from_pretrained(args.head, target=target, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, target.vocab_size, (args.train_batch, args.prefill), generator=g)
    rows = [example_targets(target, row) for row in ids]
    features = torch.stack([f for f, _ in rows])
    logits = torch.stack([z for _, z in rows])
    mask = torch.ones_like(ids)
    lengths = torch.full((args.train_batch,), args.prefill)
    loss_fn = TTTLoss(draft, 3, 0.8)

    def step(bf16: bool):
        def call(_b):
            draft.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _ = loss_fn(features, ids, mask, logits, lengths)
            loss.backward()
            return loss.item()
        return call

    return {"train step float32": step(False), "train step bf16": step(True)}


if __name__ == "__main__":
    main()
