"""Where a round's time goes on one target: the costs the draft shape trades against each other.

For a target and a head, :func:`round_split` measures, on the target's device:

- one target step (a one-token forward on a cache of ``context`` tokens) and the verify forward of
  k tokens (the root and a chain of k - 1 nodes under the tree mask) for k = 1 .. 64, each also as a
  multiple of the step;
- one head forward (one head step of one token below the root after ``Drafter.catch_up`` on the context);
- whole decoding calls (``SpeculativeDecoder.generate``, EOS ignored) of plain decoding, chain-4 and
  tree d6 k8 n48: draft / verify / other milliseconds per round, the other share, tokens per round,
  time per output token, and the peak memory of a call (``PeakMemory``: CUDA's allocator on a GPU);
- Hugging Face ``generate`` on the same prompts beside plain decoding in eagle-tree's loop.

Round costs do not depend on the weights' values, so :func:`random_target` builds randomly
initialised Llamas of real models' shapes (``SHAPES``) directly on the device; a head from
``Eagle3DraftModel.from_target`` then rejects almost every draft, which makes every round commit one
token and gives the cost of a round at each shape. Medians of repeated timings; on CUDA every timing
ends with a synchronisation.
"""

from __future__ import annotations

import statistics

import torch

from eagle_tree.bench.hf import hf_generate
from eagle_tree.bench.timing import interleave, repeat_seconds
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.core.tree import Tree
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import Drafter, TreeConfig
from eagle_tree.decoding.metrics import summarize
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel

GREEDY = SamplingConfig(temperature=0.0)
HF = "hf_generate"
VERIFY_TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
DECODE_SHAPES = {"plain": None, "chain-4": TreeConfig.chain(4),
                 "tree-d6k8n48": TreeConfig(depth=6, top_k=8, total_tokens=48)}
HEAD_DRAFT_VOCAB = 32000  # the draft vocabulary of published EAGLE-3 heads for Llama-3.1-8B

# LlamaConfig fields of real models' shapes; the "-small" entries keep the ratios and the rope
# settings at a size a CPU runs in seconds (the rehearsal of the check)
SHAPES = {
    "smollm2-135m-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                               max_position_embeddings=8192, rms_norm_eps=1e-5,
                               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama-3.1-8b-shape": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                               max_position_embeddings=131072, rms_norm_eps=1e-5,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192}),
}
SHAPES["smollm2-135m-shape-small"] = {**SHAPES["smollm2-135m-shape"], "vocab_size": 512, "hidden_size": 72,
                                      "intermediate_size": 192, "num_hidden_layers": 4, "head_dim": 8}
SHAPES["llama-3.1-8b-shape-small"] = {**SHAPES["llama-3.1-8b-shape"], "vocab_size": 1024, "hidden_size": 64,
                                      "intermediate_size": 224, "num_hidden_layers": 4, "num_attention_heads": 8,
                                      "num_key_value_heads": 2, "head_dim": 8}


def median_ms(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``reps`` calls after ``warmup`` untimed ones."""
    return 1e3 * statistics.median(repeat_seconds(fn, reps, warmup, device))


def random_target(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> TargetModel:
    """A randomly initialised Llama of ``SHAPES[shape]``, created on ``device`` in ``dtype`` (sdpa)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        with torch.device(device):  # initialised where it runs: an 8B model is not built on the host first
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if next(model.parameters()).device.type != device.type:
        model.to(device)
    return TargetModel(model.eval())


def random_head(target: TargetModel, seed: int = 0) -> Eagle3DraftModel:
    """``Eagle3DraftModel.from_target`` with the first ``HEAD_DRAFT_VOCAB`` token ids (all of a smaller
    vocabulary), in the target's dtype, on its device."""
    vocab = min(HEAD_DRAFT_VOCAB, target.vocab_size)
    head = Eagle3DraftModel.from_target(target, draft_vocab=torch.arange(vocab), seed=seed)
    return head.to(target.device).eval()


def n_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@torch.no_grad()
def verify_costs(target: TargetModel, context: torch.Tensor, reps: int, ks=VERIFY_TOKENS) -> dict:
    """The step (k = 1) and the verify forward of k tokens on a cache of ``context`` (1, P), in ms."""
    device = target.device
    cache = target.new_cache(context.shape[1] + max(ks) + 1)
    target.prefill(context.to(device), cache)
    past, root = cache.lengths[0], int(context[0, -1])
    rows = []
    for k in ks:
        tree = Tree(list(range(-1, k - 2)), [root] * (k - 1))  # the root and a chain of k - 1 nodes

        def once(tree=tree):
            target.verify([root], [tree], cache)
            cache.compact([past], [[]])  # back to the context

        rows.append({"k": k, "ms": median_ms(once, device, reps)})
    step = rows[0]["ms"]
    for row in rows:
        row["x_step"] = row["ms"] / step
    return {"context_tokens": int(context.shape[1]), "step_ms": step, "verify": rows}


@torch.no_grad()
def head_forward_ms(target: TargetModel, head: Eagle3DraftModel, context: torch.Tensor, reps: int) -> float:
    """One head forward of one token after a catch-up on ``context`` (``Drafter.catch_up``), in ms."""
    device = target.device
    cache = target.new_cache(context.shape[1] + 1)
    out = target.prefill(context.to(device), cache)
    head.bind_target(target)
    drafter = Drafter(head, TreeConfig.chain(1))
    drafter.reset()
    nxt = torch.cat([context[:, 1:], context[:, -1:]], 1).to(device)  # (1, P): the token after each position
    drafter.catch_up(out.features, nxt)
    committed = drafter.cache.length
    ids, pos = torch.tensor([[int(context[0, -1])]], device=device), torch.tensor([[committed]], device=device)
    visible = torch.ones(1, 1, 1, committed + 1, dtype=torch.bool, device=device)

    def once():  # one step below the root, then the draft cache back to the committed pairs
        head.step(drafter.last_hidden, ids, pos, drafter.cache, visible)
        drafter.cache.crop(committed)

    return median_ms(once, device, reps)


def decode_split(target: TargetModel, head: Eagle3DraftModel, prompts: list[torch.Tensor], new_tokens: int,
                 shapes: dict = DECODE_SHAPES) -> dict:
    """Per shape: the round split of ``generate`` calls (one per prompt, shapes interleaved, after one
    warm-up call each), and Hugging Face ``generate`` beside plain decoding."""
    device = target.device
    decoders = {name: SpeculativeDecoder(target, None if tree is None else head, tree=tree)
                for name, tree in shapes.items()}
    methods = {name: (lambda i, dec=dec: dec.generate(prompts[i], max_new_tokens=new_tokens, sampling=GREEDY, seed=i))
               for name, dec in decoders.items()}
    methods[HF] = lambda i: hf_generate(target.model, prompts[i], new_tokens, GREEDY, seed=i, eos_token_id=None,
                                        pad_token_id=0)
    for dec in decoders.values():  # warm-up: a 4-token call each, untimed
        dec.generate(prompts[0], max_new_tokens=4, sampling=GREEDY)
    hf_generate(target.model, prompts[0], 4, GREEDY, eos_token_id=None, pad_token_id=0)
    runs = interleave(methods, len(prompts), device=device, memory=True)
    outputs = {name: [t.value for t in runs[name]] for name in decoders}
    peaks = {name: max((t.peak_bytes for t in calls), default=0) for name, calls in runs.items()}
    hf_s = sum(t.value.total_s for t in runs[HF])
    hf_tokens = sum(t.value.new_tokens for t in runs[HF])
    hf_peak = peaks.pop(HF)
    rows = {}
    for name, outs in outputs.items():
        tree = shapes[name]
        s = summarize(name, 0.0, outs, depth=(tree or TreeConfig.chain(1)).depth)
        draft, verify, other = 1e3 * s.draft_s_per_round, 1e3 * s.verify_s_per_round, 1e3 * s.other_s_per_round
        round_ms = draft + verify + other
        rows[name] = {
            "tokens_per_round": s.acceptance_length, "draft_ms": draft, "verify_ms": verify, "other_ms": other,
            "round_ms": round_ms, "other_share": other / round_ms if round_ms > 0 else 0.0,
            "head_forwards_per_round": 0 if tree is None else tree.depth,
            "ms_per_token": 1e3 * s.time_per_output_token_s, "peak_mb": peaks[name] / 2**20,
        }
    plain_ms = rows["plain"]["ms_per_token"]
    hf_ms = 1e3 * hf_s / max(hf_tokens, 1)
    return {"new_tokens": new_tokens, "prompts": len(prompts), "methods": rows,
            "hf_generate": {"ms_per_token": hf_ms, "peak_mb": hf_peak / 2**20,
                            "plain_loop_over_generate": plain_ms / hf_ms}}


def round_split(target: TargetModel, head: Eagle3DraftModel, prompts: list[torch.Tensor], new_tokens: int,
                reps: int) -> dict:
    """Every measurement of the module docstring for one target and head; the first prompt is the
    context of the step, verify and head-forward timings."""
    costs = verify_costs(target, prompts[0], reps)
    head_ms = head_forward_ms(target, head, prompts[0], reps)
    split = decode_split(target, head, prompts, new_tokens)
    return {
        "target": {"layers": target.num_layers, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
                   "dtype": str(target.dtype).removeprefix("torch."), "weights_mb": n_bytes(target.model) / 2**20},
        "head": {"draft_vocab_size": head.config.draft_vocab_size, "weights_mb": n_bytes(head) / 2**20},
        **costs,
        "head_forward_ms": head_ms, "head_forward_x_step": head_ms / costs["step_ms"],
        **split,
    }
