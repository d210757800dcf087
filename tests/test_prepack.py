"""Prepacked linear layers (eagle_tree.models.prepack): the one-row path is untouched, several rows
agree to float32 rounding, and speculative greedy decoding on a prepacked target still equals plain
greedy decoding, with a negative control showing the check runs through the packed path."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from eagle_tree import SamplingConfig
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.prepack import PackedLinear, prepack_available, prepack_linears
from eagle_tree.models.target import TargetModel
from tests.test_decoder_exactness import PROMPT, VOCAB, ScriptedDrafter

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN packed linear")
GREEDY = SamplingConfig(temperature=0.0)
SHAPES = {"chain": (TreeConfig.chain(length=4), 1), "tree": (TreeConfig(depth=4, top_k=3, total_tokens=12), 3)}


@functools.cache
def _models() -> tuple[nn.Module, nn.Module]:
    plain = tiny_causal_lm("llama", vocab_size=VOCAB, initializer_range=0.2, seed=0).eval()
    packed = copy.deepcopy(plain)
    assert prepack_linears(packed) == sum(type(m) is nn.Linear for m in plain.modules()) > 0
    return plain, packed


def _reference(n: int) -> list[int]:
    out = SpeculativeDecoder(TargetModel(_models()[0])).generate(torch.tensor([PROMPT]), max_new_tokens=n)
    return out.sequences[0].tolist()


def test_one_row_is_the_linear_itself_and_more_rows_agree_to_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear)
    with torch.no_grad():
        one = torch.randn(1, 1, 64)
        assert torch.equal(packed(one), linear(one))  # the plain decoding step: the same kernel
        rows = torch.randn(1, 7, 64)
        torch.testing.assert_close(packed(rows), linear(rows), rtol=1e-5, atol=1e-5)
    rows.requires_grad_(True)
    out = packed(rows)  # with gradients on: the ordinary linear, differentiable
    assert torch.equal(out, linear(rows)) and out.grad_fn is not None


def test_prepack_keeps_parameters_ties_and_state_dict():
    plain, packed = _models()
    assert plain.state_dict().keys() == packed.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), packed.state_dict().values(),
                                                 strict=True))
    if plain.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.get_input_embeddings().weight
    assert isinstance(packed.lm_head, PackedLinear)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_on_a_prepacked_target_equals_plain_greedy(shape):
    tree, width = SHAPES[shape]
    n, plan = 24, [2, 0, 4, 1, 3]
    target = TargetModel(_models()[1])
    reference = _reference(n)
    out = SpeculativeDecoder(target, Eagle3DraftModel.from_target(target, seed=0), tree=tree).generate(
        torch.tensor([PROMPT]), max_new_tokens=n, sampling=GREEDY)
    assert out.sequences[0].tolist() == reference[: len(PROMPT) + n]
    drafter = ScriptedDrafter(_reference(n + 8), tree.depth, width, plan)
    out = SpeculativeDecoder(target, drafter=drafter).generate(torch.tensor([PROMPT]), max_new_tokens=n,
                                                                 sampling=GREEDY)
    assert out.sequences[0].tolist() == reference[: len(PROMPT) + n]
    assert max(out.acceptance_lengths) == 5  # whole paths accepted: the verify logits were used


def test_negative_control_a_wrong_packed_weight_breaks_greedy_equality():
    broken = copy.deepcopy(_models()[0])
    prepack_linears(broken)
    for module in broken.modules():
        if isinstance(module, PackedLinear):  # verification's rows now see other weights; one row does not
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach() * -1.0, None)
    n = 24
    drafter = ScriptedDrafter(_reference(n + 8), 4, 1, [2, 0, 4, 1, 3])
    out = SpeculativeDecoder(TargetModel(broken), drafter=drafter).generate(
        torch.tensor([PROMPT]), max_new_tokens=n, sampling=GREEDY)
    assert out.sequences[0].tolist() != _reference(n)


def test_verify_rows_script_prints_both_kernels_and_checks_their_tokens(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "decode" / "verify_rows.py"
    spec = importlib.util.spec_from_file_location("verify_rows", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--sizes", "1", "3", "--repeats", "1", "--past", "16", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 1 and rows[0].endswith("| yes |")
    with pytest.raises(SystemExit):
        module.main(["--sizes", "2", "3"])  # no one-token step to compare with
