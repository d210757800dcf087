"""The public Python API exactly as docs/ARCHITECTURE.md writes it ("Public Python API"), and the promise
that ``import eagle_tree`` stays light."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import eagle_tree as et
from eagle_tree import Tree
from eagle_tree.data.tiny import tiny_causal_lm


def test_sampling_config_and_processed_probs():
    s = et.SamplingConfig(temperature=0.7, top_k=50, top_p=0.9)
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    probs = et.processed_probs(logits, s)
    assert probs.dtype == torch.float32 and probs.shape == (3, 100)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert int((probs[0] > 0).sum()) <= 50
    greedy = et.processed_probs(logits, et.SamplingConfig(temperature=0.0))  # temperature=0.0: greedy
    assert torch.equal(greedy, torch.nn.functional.one_hot(logits.argmax(-1), 100).float())


@pytest.mark.parametrize("proposal", ["greedy", "deterministic", "with_replacement", "without_replacement"])
def test_verify_tree(proposal):
    parents = [-1, -1, 0, 0, 1]  # parents[i] in {-1 (the root), 0..i-1}
    tokens = [2, 0, 1, 3, 2]  # tokens[i] the token of node i
    g = torch.Generator().manual_seed(1)
    target_probs = torch.softmax(torch.randn(len(tokens) + 1, 4, generator=g), -1)  # (n + 1, V)
    draft_probs = None
    if proposal in ("with_replacement", "without_replacement"):
        draft_probs = torch.full((len(tokens) + 1, 4), 0.25)
    generator = torch.Generator().manual_seed(0)
    res = et.verify_tree(Tree(parents, tokens), target_probs, draft_probs, proposal, generator)
    assert isinstance(res.accepted, list) and isinstance(res.next_token, int)
    node = -1
    for a in res.accepted:  # the accepted nodes form one root-to-node path
        assert parents[a] == node
        node = a
    assert 0 <= res.next_token < 4
    if proposal == "greedy":  # the target's argmax at the last accepted node, which no child of it holds
        choice = int(target_probs[node + 1].argmax())
        assert res.next_token == choice
        assert all(tokens[c] != choice for c in range(len(tokens)) if parents[c] == node)


def test_decoders_as_documented(tmp_path):
    target_model = tiny_causal_lm("llama", num_layers=4)  # any Hugging Face causal LM
    et.Eagle3DraftModel.from_target(target_model).save_pretrained(tmp_path / "head")
    draft = et.Eagle3DraftModel.from_pretrained(tmp_path / "head")  # also .from_target(target_model)
    s = et.SamplingConfig(temperature=0.7, top_k=50, top_p=0.9)
    input_ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    greedy = et.SamplingConfig(temperature=0.0)
    plain = et.SpeculativeDecoder(target_model).generate(input_ids, max_new_tokens=24, sampling=greedy)
    for tree in (et.TreeConfig(depth=6, top_k=8, total_tokens=48), et.TreeConfig.chain(length=5)):
        dec = et.SpeculativeDecoder(target_model, draft, tree=tree)
        out = dec.generate(input_ids, max_new_tokens=128, sampling=s, seed=0)
        assert out.sequences.dtype == torch.long and out.sequences.shape == (1, 6 + 128)  # (1, prompt + new)
        assert torch.equal(out.sequences[:, :6], input_ids)
        assert isinstance(out.acceptance_lengths, list) and all(isinstance(n, int) for n in out.acceptance_lengths)
        # one entry per round: tokens committed in that round; the first new token comes from the prefill
        assert all(1 <= n <= tree.depth + 1 for n in out.acceptance_lengths)
        assert sum(out.acceptance_lengths) == 128 - 1
        again = dec.generate(input_ids, max_new_tokens=24, sampling=s, seed=0)
        assert torch.equal(again.sequences, out.sequences[:, : 6 + 24])  # seeded
        assert torch.equal(dec.generate(input_ids, max_new_tokens=24, sampling=greedy).sequences, plain.sequences)


def test_public_names_resolve():
    for name in et.__all__:
        assert getattr(et, name) is not None
    assert set(et.__all__) <= set(dir(et))
    with pytest.raises(AttributeError):
        et.no_such_name  # noqa: B018


def test_core_import_stays_light():
    code = (
        "import json, sys\n"
        "import eagle_tree as et\n"
        "et.verify_tree; et.processed_probs; et.SamplingConfig\n"
        "print(json.dumps(sorted(m for m in ('wandb', 'datasets', 'accelerate', 'torch') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == ["torch"]  # torch is needed (and shows that the check sees imported modules)
