"""The int8 draft lm_head (eagle_tree.models.quantize): close to the float32 logits, invisible to training
and saving, and exact: greedy decoding with it equals plain greedy, and sampled decoding follows the
target's law (chi-square, the exactness suite's test), with controls showing the int8 path really ran."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from eagle_tree import SamplingConfig
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.models.quantize import Int8Linear, int8_available, quantize_lm_head
from tests.test_decoder_exactness import (
    ALPHA,
    N_SEEDS,
    PROMPT,
    T1,
    _chi2_pvalue,
    _draw,
    _exact_laws,
    _sampling_head,
    _sampling_target,
)
from tests.test_prepack import _models, _reference


def _head(reduced: bool):
    """A copy of the exactness suite's cached head, so quantizing it leaves the suite's own untouched."""
    return copy.deepcopy(_sampling_head(reduced))


pytestmark = pytest.mark.skipif(not int8_available(), reason="this torch build has no quantized linear kernels")


def test_int8_rows_are_close_to_float32_and_gradients_use_float32():
    torch.manual_seed(0)
    linear = nn.Linear(96, 300, bias=False)
    q = Int8Linear(linear)
    x = torch.randn(2, 5, 96)
    with torch.no_grad():
        exact, approx = linear(x), q(x)
    assert approx.shape == exact.shape
    err = (approx - exact).abs().max().item()
    assert 0 < err < 0.05 * exact.abs().max().item()  # not the same kernel, but close
    x.requires_grad_(True)
    out = q(x)  # training: the float32 weight, differentiable
    assert torch.equal(out, linear(x)) and out.grad_fn is not None
    with pytest.raises(ValueError, match="bias-free"):
        Int8Linear(nn.Linear(4, 4))


def test_quantize_keeps_the_state_dict_and_refuses_other_dtypes():
    head = _head(False)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    assert quantize_lm_head(head) and isinstance(head.lm_head, Int8Linear)
    after = head.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    quantize_lm_head(head)  # again: requantized from the same weight, still one Int8Linear
    assert isinstance(head.lm_head, Int8Linear) and isinstance(head.lm_head.weight, nn.Parameter)
    other = nn.Module()
    other.lm_head = nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_int8=false"):
        quantize_lm_head(other)


def test_the_int8_path_changes_the_draft_logits():
    """Control: the decoding tests below would be vacuous if the int8 copy were never used."""
    head = _head(False)
    h = torch.randn(1, 3, head.lm_head.in_features)
    with torch.no_grad():
        exact = head.lm_head(h)
        quantize_lm_head(head)
        approx = head.lm_head(h)
    assert not torch.equal(exact, approx)
    torch.testing.assert_close(approx, exact, rtol=0.1, atol=0.05)


@pytest.mark.parametrize("tree", [TreeConfig.chain(length=4), TreeConfig(depth=4, top_k=3, total_tokens=12)],
                         ids=["chain", "tree"])
def test_greedy_with_an_int8_head_equals_plain_greedy(tree):
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.models.target import TargetModel

    n = 24
    target = TargetModel(copy.deepcopy(_models()[0]))
    head = Eagle3DraftModel.from_target(target, seed=0)
    quantize_lm_head(head)
    out = SpeculativeDecoder(target, head, tree=tree).generate(torch.tensor([PROMPT]), max_new_tokens=n,
                                                              sampling=SamplingConfig(temperature=0.0))
    assert out.sequences[0].tolist() == _reference(n)[: len(PROMPT) + n]


@pytest.mark.slow
def test_sampled_tree_with_an_int8_head_follows_the_target_law():
    head = _head(True)
    quantize_lm_head(head)
    dec = SpeculativeDecoder(_sampling_target(), head, tree=TreeConfig(depth=2, top_k=3, total_tokens=12,
                                                                       sampled=True))
    c12, c23, accepted = _draw(dec, T1, depth2=True)
    joint12, joint23 = _exact_laws(T1)
    assert _chi2_pvalue(c12, joint12) > ALPHA and _chi2_pvalue(c23, joint23) > ALPHA
    assert 0.05 * N_SEEDS < sum(a >= 1 for a in accepted) < 0.95 * N_SEEDS  # drafts accepted and rejected


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from eagle_tree.data.tiny import build_tiny_assets

    return build_tiny_assets(tmp_path_factory.mktemp("int8") / "assets")


def test_load_decoder_quantizes_only_when_asked(assets):
    from eagle_tree.decoding.loading import load_decoder

    plain, _ = load_decoder(str(assets["target"]), str(assets["head"]), "chain", "float32", TreeConfig.chain(3))
    assert type(plain.draft.lm_head) is nn.Linear  # the default: the float32 lm_head
    quantized, _ = load_decoder(str(assets["target"]), str(assets["head"]), "chain", "float32",
                                TreeConfig.chain(3), head_int8=True)
    assert isinstance(quantized.draft.lm_head, Int8Linear)


def test_bench_with_head_int8_matches_plain_and_records_it(assets, tmp_path):
    import contextlib
    import io
    import json

    from eagle_tree.commands.bench import main

    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["--config", "configs/bench-smoke.yaml", f"tiny_assets={assets['target'].parent}",
                   f"output_dir={out}", "test_limit=2", "tuning_limit=2", "max_new_tokens=12", "head_int8=true",
                   "methods=[plain, chain]", "chain_lengths=[3]", "trees=[]", "plots=false"])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["head_int8"] is True
    rows = {r["method"]: r for r in report["methods"]}
    assert "chain-3" in rows and all(r["outputs_match_plain"] for r in rows.values())


def test_int8_rows_script_times_both_and_checks_the_top_token(assets, capsys):
    from tests.helpers import load_script
    module = load_script("decode/int8_rows.py")
    rows = module.main(["--head", str(assets["head"]), "--rows", "1", "3", "--calls", "2", "--repeats", "2"])
    assert [r["rows"] for r in rows] == [1, 3]
    assert all(r["float32_ms"] > 0 and r["int8_ms"] > 0 and 0 <= r["same_top"] <= 1 for r in rows)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |")]
    assert len(printed) == 1
