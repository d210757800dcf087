"""The output-law check on a tiny target, on any device: does speculative sampling draw the first
tokens from the target's own law?

The target is the one of the model-level sampling suite (tests/test_decoder_exactness.py,
"Sampling"): one real Llama layer over a 16-token vocabulary plus three layers that add exactly zero,
so the head gets three distinct feature layers without changing a logit. ``exact_laws`` gives the
target's law of the first two new tokens (x1, x2) and of (x2, x3) from cache-free forwards;
``draw_counts`` decodes ``n`` seeds with a decoder and counts what came out; ``chi2_pvalue`` is Pearson's
test of the counts against the law (cells with expected count < 5 pooled), computed with
``torch.special.gammaincc`` so that no statistics package is needed.
"""

from __future__ import annotations

import math

import torch

from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.data.tiny import tiny_causal_lm

LAW_VOCAB = 16
LAW_PROMPT = (3, 7, 1)
LAW_ALPHA = 1e-5  # a case fails when its p-value is below this


def law_target():
    """The tiny target of the sampling suite (float32, CPU, eval mode), as a TargetModel with feature
    layers (1, 2, 3): layer 0, embedding, norm and lm_head of a one-layer Llama, three zero layers."""
    from eagle_tree.models.target import TargetModel

    kw = dict(vocab_size=LAW_VOCAB, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64,
              initializer_range=0.3, seed=3)
    one, lm = tiny_causal_lm("llama", num_layers=1, **kw), tiny_causal_lm("llama", num_layers=4, **kw)
    state = {**lm.state_dict(), **one.state_dict()}
    for i in (1, 2, 3):
        for key in (f"model.layers.{i}.self_attn.o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
            state[key] = torch.zeros_like(state[key])
    lm.load_state_dict(state)
    return TargetModel(lm, feature_layers=(1, 2, 3))


@torch.no_grad()
def exact_laws(target, sampling: SamplingConfig, prompt=LAW_PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's law of (x1, x2) and of (x2, x3) after ``prompt``: (V, V) float64 tables on the CPU,
    from cache-free batched forwards on the target's device and ``processed_probs``."""
    v, model, device = LAW_VOCAB, target.model, target.device
    p = torch.tensor(prompt, device=device)
    x = torch.arange(v, device=device)
    one = torch.cat([p.expand(v, -1), x[:, None]], 1)  # (V, P + 1)
    two = torch.cat([p.expand(v * v, -1), x.repeat_interleave(v)[:, None], x.repeat(v)[:, None]], 1)  # (V*V, P+2)
    l0 = model(p[None], use_cache=False).logits[0, -1]
    l1 = model(one, use_cache=False).logits[:, -1]
    l2 = model(two, use_cache=False).logits[:, -1].view(v, v, v)
    p0, p1, p2 = (processed_probs(lg.float(), sampling).double().cpu() for lg in (l0, l1, l2))
    joint12 = p0[:, None] * p1
    joint23 = torch.einsum("a,ab,abc->bc", p0, p1, p2)
    return joint12, joint23


def draw_counts(decoder, sampling: SamplingConfig, n: int, depth2: bool, prompt=LAW_PROMPT):
    """Counts (V, V) of (x1, x2) and of (x2, x3) (zeros unless ``depth2``) over seeds 0..n-1, and the
    draft tokens accepted in the first round of each run."""
    v = LAW_VOCAB
    c12, c23 = torch.zeros(v, v), torch.zeros(v, v)
    accepted = []
    ids = torch.tensor([prompt])
    for seed in range(n):
        out = decoder.generate(ids, max_new_tokens=3 if depth2 else 2, sampling=sampling, seed=seed)
        new = out.sequences[0, len(prompt):].tolist()
        c12[new[0], new[1]] += 1
        if depth2:
            c23[new[1], new[2]] += 1
        accepted.append(out.rounds[0].accepted)
    return c12, c23, accepted


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed ``counts`` against cell ``probs``; cells with expected
    count < 5 are pooled into one; an observation in a zero-probability cell gives 0."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    df = len(obs) - 1
    if df < 1:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return p if math.isfinite(p) else 0.0
