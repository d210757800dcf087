"""``eagle-tree decode``: decode a prompt file with a draft head (tree, chain) or plainly.

Prints each continuation and the acceptance summary; logs the per-round acceptance lengths, their
histogram and the summary to W&B (offline when no API key is set; ``wandb.mode=disabled`` to skip).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.models.prepack import PrepackSetting
from eagle_tree.utils.checks import check_range
from eagle_tree.utils.config import ConfigValueError, config_to_dict, parse_cli, save_config
from eagle_tree.utils.tracking import WandbConfig


@dataclass(frozen=True)
class CommandSampling(SamplingConfig):
    """SamplingConfig with the commands' default, greedy decoding (temperature 0.0)."""

    temperature: float = 0.0


@dataclass
class GenerationOptions:
    """What every decoding command sets alike: output budget, long prompts, sampling, seeds, EOS, precision."""

    max_new_tokens: int = 64
    """Output budget per prompt (the same for every method)."""
    truncate_prompts: Literal["off", "left"] = "off"
    """A prompt that leaves less than max_new_tokens of the target's positions is refused (off) or cut to
    its last tokens (left)."""
    sampling: CommandSampling = field(default_factory=CommandSampling)
    """temperature (0 = greedy), top_k (0 = off), top_p (1.0 = off); the same for every method."""
    seed: int = 0
    """Seed of prompt i is seed + i (in every method and repeat)."""
    stop_at_eos: bool = True
    """Stop a continuation at the tokenizer's EOS token (length differences from plain decoding are reported)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of every model (target, head, assistant)."""
    target_prepack: PrepackSetting = False
    """CPU, float32: give the target's linear layers a oneDNN-packed weight for every forward
    (verification, prefill), at twice the weights' memory; "auto": time both kernels at load and keep
    the faster for one-row and for several-row inputs (eagle_tree.models.prepack)."""
    head_int8: bool = False
    """CPU: the head drafts with a per-row int8 copy of its lm_head, about a tenth of the float32 matrix's
    time; the draft changes a little, the output's distribution not at all (eagle_tree.models.quantize)."""


@dataclass
class DecodeConfig(GenerationOptions):
    """Decode prompts with speculative decoding and report acceptance."""

    target: str = "assets/reference/target"
    """Target model: a local folder or a hub id (AutoModelForCausalLM + AutoTokenizer)."""
    head: str | None = "assets/reference/head"
    """EAGLE-3 draft head folder; null for plain decoding."""
    mode: Literal["tree", "chain", "plain", "auto", "default"] = "tree"
    """tree: dynamic tree (the `tree` section); chain: `chain_length` tokens; plain: no draft; auto: the
    shape `eagle-tree bench` selected (lowest time per output token on its tuning prompts), read from `shapes`
    (plain decoding where it selected `none`); default: the head's own default decoder, the shapes of its
    folder's decoding.json (one for greedy decoding, one for sampling, context branches included; an entry
    `none` decodes plainly)."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """Dynamic-tree shape: depth, top_k, total_tokens, sampled (Gumbel-top-k children)."""
    chain_length: int = 5
    """Draft tokens per round in chain mode."""
    shapes: str = "results/bench/shapes.json"
    """mode=auto: the tuning result written by `eagle-tree bench` (its shapes.json)."""
    prompts: str = "assets/reference/prompts/test.jsonl"
    """Prompt file: .jsonl with a `prompt` field per line, or .txt with one prompt per line."""
    prompt: str | None = None
    """A single prompt text; overrides `prompts` when set."""
    limit: int | None = None
    """Decode only the first N prompts (null: all)."""
    output: str | None = None
    """Write per-prompt continuations and the summary to this JSON file (and the config beside it, as
    NAME.config.yaml); checked before decoding: a folder or an unwritable place is refused, and an
    existing file is replaced only if an earlier decode wrote it."""
    overwrite: bool = False
    """Replace `output` even when it is not an earlier decode's output."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging."""

    def __post_init__(self) -> None:
        if self.prompt is not None and not self.prompt.strip():
            raise ConfigValueError("prompt", f"is blank ({self.prompt!r}): give the prompt text, or leave the key "
                                   "out to decode the prompts file")
        check_range("limit", self.limit, 1, allow_none=True, meaning="all prompts")
        check_range("chain_length", self.chain_length, 1)
        check_range("max_new_tokens", self.max_new_tokens, 1)


def _is_decode_output(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and set(data) == {"summary", "prompts"}


def check_output(cfg: DecodeConfig) -> None:
    """Refuse an `output` (and its NAME.config.yaml) that decode must not or cannot write, before decoding."""
    from eagle_tree.utils.outputs import check_output_file

    if cfg.output is None:
        return
    output = Path(cfg.output)
    ours = output.is_file() and _is_decode_output(output)
    check_output_file(output, "eagle-tree decode", overwrite=cfg.overwrite, recognise=_is_decode_output)
    check_output_file(output.with_suffix(".config.yaml"), "eagle-tree decode", overwrite=cfg.overwrite,
                      recognise=lambda _: ours)


def load_models(cfg: DecodeConfig):
    """(SpeculativeDecoder, tokenizer) for the config (``eagle_tree.decoding.loading.load_decoder``)."""
    from eagle_tree.decoding.loading import load_decoder

    tree = TreeConfig.chain(cfg.chain_length, sampled=cfg.tree.sampled) if cfg.mode == "chain" else cfg.tree
    return load_decoder(cfg.target, cfg.head, cfg.mode, cfg.dtype, tree, cfg.shapes, prepack=cfg.target_prepack,
                        head_int8=cfg.head_int8)


def main(argv: list[str]) -> int:
    from eagle_tree.utils.checks import exit_on_input_error

    for arg in argv:  # YAML reads `prompt=` and `prompt=~` as null, which would mean "the prompts file"
        key, eq, value = arg.partition("=")
        if eq and key.strip() == "prompt" and value.strip() in ("", "~", "null", "Null", "NULL"):
            print(f"eagle-tree decode: {arg!r} gives no prompt text: write prompt='your text', or leave the key "
                  f"out to decode the prompts file", file=sys.stderr)
            return 2
    return exit_on_input_error("eagle-tree decode", run, parse_cli(DecodeConfig, argv, prog="eagle-tree decode"))


def run(cfg: DecodeConfig) -> int:
    """Check the output path and read the prompts, load the models, check the prompts against the
    target, then decode."""
    from eagle_tree.decoding.metrics import summarize
    from eagle_tree.utils.prompts import Prompt, encode_for_target, read_prompt_file
    from eagle_tree.utils.tracking import RunLogger

    check_output(cfg)
    prompts = [Prompt(cfg.prompt, "prompt=")] if cfg.prompt is not None else read_prompt_file(cfg.prompts)
    prompts = prompts[: cfg.limit]
    decoder, tokenizer = load_models(cfg)
    prompt_ids = encode_for_target(prompts, decoder.target, tokenizer, cfg.max_new_tokens, cfg.truncate_prompts)
    eos = tokenizer.eos_token_id if cfg.stop_at_eos else None
    outputs, records = [], []
    with RunLogger(cfg.wandb, run_config=config_to_dict(cfg), job_type="decode") as logger:
        step = 0
        for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
            out = decoder.generate(ids, cfg.max_new_tokens, sampling=cfg.sampling, seed=cfg.seed + i, eos_token_id=eos)
            outputs.append(out)
            continuation = tokenizer.decode(out.sequences[0, out.prompt_length :])
            print(f"--- prompt {i}: {out.new_tokens} tokens, {out.mean_acceptance_length:.2f} per round")
            print(continuation)
            records.append({"prompt": prompt.text, "continuation": continuation,
                            "acceptance_lengths": out.acceptance_lengths})
            for length in out.acceptance_lengths:
                logger.log({"decode/acceptance_length": length}, step=step)
                step += 1
        # mode=default picks its shape per kind of decoding; None, or no head and no context: plain decoding
        shape = None if cfg.mode == "plain" else decoder.shape_for(cfg.sampling)
        depth = 0 if shape is None or (decoder.draft is None and shape.context is None) else shape.depth
        summary = summarize(cfg.mode, cfg.sampling.temperature, outputs, depth=depth)
        lengths = [n for o in outputs for n in o.acceptance_lengths]
        if lengths:
            logger.log_histogram("decode/acceptance_length_hist", lengths, step=step)
        if depth:
            logger.log_line("decode/survival", list(range(1, depth + 1)), summary.survival,
                            title="Pr(accepted >= i)", x_name="i", y_name="survival", step=step)
        logger.summary({f"decode/{k}": v for k, v in summary.to_dict().items() if isinstance(v, int | float)})
    print("\n" + format_summary(summary))
    if cfg.output:
        from eagle_tree.utils.atomic import write_text

        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        write_text(cfg.output, json.dumps({"summary": summary.to_dict(), "prompts": records}, indent=2))
        save_config(cfg, Path(cfg.output).with_suffix(".config.yaml"))
    return 0


def format_summary(s) -> str:
    lines = [
        f"method {s.method}, temperature {s.temperature}: {s.prompts} prompts, {s.tokens} tokens, {s.rounds} rounds",
        f"  acceptance length (tokens per round): {s.acceptance_length:.3f}",
        f"  time per output token: {1000 * s.time_per_output_token_s:.2f} ms "
        f"(after the first: {1000 * s.decode_time_per_token_s:.2f} ms)",
        f"  per round: draft {1000 * s.draft_s_per_round:.2f} ms, verify {1000 * s.verify_s_per_round:.2f} ms, "
        f"other {1000 * s.other_s_per_round:.2f} ms",
    ]
    if s.survival:
        lines.append("  survival Pr(A >= i): " + " ".join(f"{v:.2f}" for v in s.survival))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
