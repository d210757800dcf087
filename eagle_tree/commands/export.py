"""``eagle-tree export --to {eagle3,sglang,vllm} CHECKPOINT OUT``: a head in a serving engine's layout.

CHECKPOINT is a head folder in any layout eagle-tree reads (its own ``save_pretrained``, EAGLE-3,
SGLang or vLLM speculators). The export is validated (weights present with the shapes the config
implies, ``d2t`` / ``t2d`` agreeing, the engine's view of the feature layers equal to the head's, and
with ``--target`` the head against the target's config) and then written atomically. Exit status 2
and nothing written when a check fails.
"""

from __future__ import annotations

import argparse
import sys

NEXT_STEP = {
    "vllm": "vllm serve {target} --speculative-config "
            "'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": {k}}}'",
    "sglang": "python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path {out} --speculative-num-steps {k} "
              "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32",
    "eagle3": "EaModel.from_pretrained(base_model_path='{target}', ea_model_path='{out}') (EAGLE repository)",
}


def build_parser() -> argparse.ArgumentParser:
    from eagle_tree.models.layouts import LAYOUTS

    p = argparse.ArgumentParser(
        prog="eagle-tree export",
        description="Write a draft head in the layout a serving engine loads (EAGLE-3, SGLang or vLLM "
                    "speculators), validated first, atomically. See docs/INTEROP.md.",
    )
    p.add_argument("--to", required=True, choices=LAYOUTS, help="layout to write")
    p.add_argument("checkpoint", help="head folder to read (config.json + model.safetensors)")
    p.add_argument("out", help="folder to write; replaced atomically if it exists")
    p.add_argument("--target", help="target model folder or hub id: the head is checked against its config, "
                                    "which also resolves the default feature layers of heads that name none")
    p.add_argument("--verifier", help="vLLM: the verifier's name or path written into the config "
                                      "(default: --target)")
    p.add_argument("--speculative-tokens", type=int, default=3, help="vLLM: default draft tokens per step")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="cast the weights (default: keep)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from eagle_tree.models.layouts import export_head, read_head

    try:
        target_config, layers = None, None
        if args.target:
            from transformers import AutoConfig

            target_config = AutoConfig.from_pretrained(args.target)
            layers = target_config.get_text_config(decoder=True).num_hidden_layers
        head = read_head(args.checkpoint, target_num_layers=layers)
        out = export_head(head, args.out, args.to, target_config=target_config,
                          verifier=args.verifier or args.target, speculative_tokens=args.speculative_tokens,
                          dtype=getattr(torch, args.dtype) if args.dtype else None)
    except (ValueError, OSError) as exc:
        print(f"eagle-tree export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the {args.to} layout of {args.checkpoint} to {out}")
    print("next: " + NEXT_STEP[args.to].format(target=args.target or "TARGET", out=out, k=args.speculative_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
