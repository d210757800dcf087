"""Prepacked linear layers (eagle_tree.models.prepack): every row count (or, with ``one_row=False``, every
count but one) runs through the packed copy and agrees with ``F.linear`` to float32 rounding, and
speculative greedy decoding on a prepacked target still equals plain greedy decoding, with a negative
control showing the check runs through the packed path."""

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
def _models(one_row: bool = True) -> tuple[nn.Module, nn.Module]:
    plain = tiny_causal_lm("llama", vocab_size=VOCAB, initializer_range=0.2, seed=0).eval()
    packed = copy.deepcopy(plain)
    assert prepack_linears(packed, one_row=one_row) == sum(type(m) is nn.Linear for m in plain.modules()) > 0
    return plain, packed


def _reference(n: int) -> list[int]:
    out = SpeculativeDecoder(TargetModel(_models()[0])).generate(torch.tensor([PROMPT]), max_new_tokens=n)
    return out.sequences[0].tolist()


def test_one_row_is_the_linear_itself_only_when_asked_and_more_rows_agree_to_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed, rows_only = PackedLinear(linear), PackedLinear(linear, one_row=False)
    with torch.no_grad():
        one = torch.randn(1, 1, 64)
        assert torch.equal(rows_only(one), linear(one))  # one_row=False: the matrix-vector kernel itself
        torch.testing.assert_close(packed(one), linear(one), rtol=1e-5, atol=1e-5)
        rows = torch.randn(1, 7, 64)
        for module in (packed, rows_only):
            torch.testing.assert_close(module(rows), linear(rows), rtol=1e-5, atol=1e-5)
        # which kernel serves which input: a packed copy of -W shows through exactly where it is used
        for module in (packed, rows_only):
            module._packed = torch.ops.mkldnn._reorder_linear_weight(-linear.weight.detach(), None)
        torch.testing.assert_close(packed(one), -linear(one) + 2 * linear.bias, rtol=1e-5, atol=1e-5)
        assert torch.equal(rows_only(one), linear(one))
        torch.testing.assert_close(rows_only(rows), -linear(rows) + 2 * linear.bias, rtol=1e-5, atol=1e-5)
    rows.requires_grad_(True)
    out = packed(rows)  # with gradients on: the ordinary linear, differentiable
    assert torch.equal(out, linear(rows)) and out.grad_fn is not None


def test_a_packed_model_deep_copies_with_its_own_packed_weights():
    _, packed = _models()
    copied = copy.deepcopy(packed)  # oneDNN's packed tensor alone cannot be deep-copied (no storage)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, packed(ids).logits)
        layer = next(m for m in copied.modules() if isinstance(m, PackedLinear))
        assert layer.weight is not next(m for m in packed.modules() if isinstance(m, PackedLinear)).weight
        layer.weight.mul_(-1.0)  # negative control: the copy's own weights, repacked, change its output only
        layer._packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        assert not torch.equal(copied(ids).logits, packed(ids).logits)
        assert torch.equal(packed(ids).logits, copy.deepcopy(packed)(ids).logits)


def test_prepack_keeps_parameters_ties_and_state_dict():
    plain, packed = _models()
    # the packed copies are kernel state, not model state: no new buffers (so no new fingerprint entries)
    assert dict(plain.named_buffers()).keys() == dict(packed.named_buffers()).keys()
    assert all(isinstance(m._packed, torch.Tensor) for m in packed.modules() if isinstance(m, PackedLinear))
    assert plain.state_dict().keys() == packed.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), packed.state_dict().values(),
                                                 strict=True))
    if plain.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.get_input_embeddings().weight
    assert isinstance(packed.lm_head, PackedLinear)


@pytest.mark.parametrize("one_row", [True, False], ids=["every-row-count", "several-rows"])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_on_a_prepacked_target_equals_plain_greedy(shape, one_row):
    tree, width = SHAPES[shape]
    n, plan = 24, [2, 0, 4, 1, 3]
    target = TargetModel(_models(one_row)[1])
    reference = _reference(n)
    out = SpeculativeDecoder(target, Eagle3DraftModel.from_target(target, seed=0), tree=tree).generate(
        torch.tensor([PROMPT]), max_new_tokens=n, sampling=GREEDY)
    assert out.sequences[0].tolist() == reference[: len(PROMPT) + n]
    drafter = ScriptedDrafter(_reference(n + 8), tree.depth, width, plan)
    out = SpeculativeDecoder(target, drafter=drafter).generate(torch.tensor([PROMPT]), max_new_tokens=n,
                                                                 sampling=GREEDY)
    assert out.sequences[0].tolist() == reference[: len(PROMPT) + n]
    assert max(out.acceptance_lengths) == 5  # whole paths accepted: the verify logits were used


@pytest.mark.parametrize("one_row", [True, False], ids=["every-row-count", "several-rows"])
def test_negative_control_a_wrong_packed_weight_breaks_greedy_equality(one_row):
    broken = copy.deepcopy(_models()[0])
    prepack_linears(broken, one_row=one_row)
    for module in broken.modules():
        if isinstance(module, PackedLinear):  # the rows served by the packed copy now see other weights
            module._packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach() * -1.0, None)
    n = 24
    drafter = ScriptedDrafter(_reference(n + 8), 4, 1, [2, 0, 4, 1, 3])
    out = SpeculativeDecoder(TargetModel(broken), drafter=drafter).generate(
        torch.tensor([PROMPT]), max_new_tokens=n, sampling=GREEDY)
    assert out.sequences[0].tolist() != _reference(n)


def test_verify_rows_script_prints_both_kernels_and_checks_their_tokens(capsys):
    from tests.helpers import load_script
    module = load_script("decode/verify_rows.py")
    module.main(["--sizes", "1", "3", "--repeats", "1", "--past", "16", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 1 and rows[0].endswith("| yes |")
    with pytest.raises(SystemExit):
        module.main(["--sizes", "2", "3"])  # no one-token step to compare with


# ---- target_prepack: auto (time both kernels at load, keep the faster) ----

LABELS = {"1 linear", "1 packed", "5 linear", "5 packed"}


def _costs(one_packed: float, one_linear: float, five_packed: float, five_linear: float):
    """A measure that returns these seconds and records the labels it was asked to time."""
    seen = []

    def measure(fns):
        seen.append(set(fns))
        for fn in fns.values():  # the callables run: a broken pass would raise here
            fn()
        return {"1 packed": one_packed, "1 linear": one_linear, "5 packed": five_packed, "5 linear": five_linear}
    return measure, seen


@pytest.mark.parametrize(("costs", "flags"), [
    ((1.0, 2.0, 3.0, 4.0), (True, True)),     # packed faster at both row counts: every row count packed
    ((2.0, 1.0, 3.0, 4.0), (False, True)),    # faster at five rows only: one-row steps keep F.linear
    ((1.0, 2.0, 4.0, 3.0), (True, False)),    # faster at one row only
], ids=["both", "several-rows", "one-row"])
def test_auto_packs_exactly_the_row_counts_where_the_packed_copy_timed_faster(costs, flags):
    from eagle_tree.models.prepack import choose_prepack, packed_kernels

    model = copy.deepcopy(_models()[0])
    measure, seen = _costs(*costs)
    choice = choose_prepack(model, measure=measure)
    assert seen == [LABELS]  # one interleaved measurement of both kernels at both row counts
    assert (choice.one_row, choice.many_rows) == flags and choice.reason.startswith("auto")
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all((m.one_row, m.many_rows) == flags for m in layers)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert packed_kernels(model) == choice.kernels() != False  # noqa: E712 - False is a possible value
    assert choice.ms == {(1, "packed"): 1e3 * costs[0], (1, "linear"): 1e3 * costs[1],
                         (5, "packed"): 1e3 * costs[2], (5, "linear"): 1e3 * costs[3]}
    assert "F.linear" in choice.describe() and "packed" in choice.describe()


def test_auto_unpacks_where_the_packed_copy_is_slower_and_the_model_is_the_same_model():
    from eagle_tree.models.prepack import choose_prepack, packed_kernels

    plain = _models()[0]
    model = copy.deepcopy(plain)
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    measure, _ = _costs(2.0, 1.0, 4.0, 3.0)  # packed slower at both: the Intel AMX host's case
    choice = choose_prepack(model, measure=measure)
    assert not choice.packs and choice.kernels() is False and packed_kernels(model) is False
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert sum(type(m) is nn.Linear for m in model.modules()) == sum(type(m) is nn.Linear for m in plain.modules())
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights  # the same parameters
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)  # F.linear itself: bit-equal
    # negative control: the same check on a model left packed for several rows sees other rounding or kernels
    packed = copy.deepcopy(plain)
    choose_prepack(packed, measure=_costs(2.0, 1.0, 3.0, 4.0)[0])
    assert packed_kernels(packed) == "several-rows"
    for module in packed.modules():
        if isinstance(module, PackedLinear):
            module._packed = torch.ops.mkldnn._reorder_linear_weight(-module.weight.detach(), None)
    with torch.no_grad():
        assert not torch.equal(packed(ids).logits, plain(ids).logits)


def test_auto_with_the_real_clock_times_both_kernels_and_greedy_decoding_stays_exact():
    from eagle_tree.models.prepack import choose_prepack

    model = copy.deepcopy(_models()[0])
    choice = choose_prepack(model, repeats=1)
    assert set(choice.ms) == {(1, "linear"), (1, "packed"), (5, "linear"), (5, "packed")}
    assert all(v > 0 for v in choice.ms.values())
    n = 24
    target = TargetModel(model)
    drafter = ScriptedDrafter(_reference(n + 8), 4, 1, [2, 0, 4, 1, 3])
    out = SpeculativeDecoder(target, drafter=drafter).generate(torch.tensor([PROMPT]), max_new_tokens=n,
                                                               sampling=GREEDY)
    assert out.sequences[0].tolist() == _reference(n)[: len(PROMPT) + n]


def test_apply_prepack_takes_true_false_or_auto_and_names_the_choices_otherwise():
    from eagle_tree.models.prepack import apply_prepack

    model = copy.deepcopy(_models()[0])
    assert apply_prepack(model, False) is None and not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="true, false or \"auto\""):
        apply_prepack(model, "yes")
    choice = apply_prepack(model, True, one_row=False)
    assert (choice.one_row, choice.many_rows, choice.reason) == (False, True, "asked")
    assert all(not m.one_row for m in model.modules() if isinstance(m, PackedLinear))


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from eagle_tree.data.tiny import build_tiny_assets

    return build_tiny_assets(tmp_path_factory.mktemp("prepack") / "assets")


@pytest.mark.parametrize(("costs", "kernels"), [((2.0, 1.0, 3.0, 4.0), "several-rows"),
                                                 ((2.0, 1.0, 4.0, 3.0), False)], ids=["several-rows", "none"])
def test_load_decoder_auto_gives_the_head_the_targets_kernels(tiny_assets, monkeypatch, costs, kernels):
    from eagle_tree.decoding.loading import load_decoder
    from eagle_tree.models import prepack

    monkeypatch.setattr(prepack, "interleaved_medians", lambda fns, repeats=5: _costs(*costs)[0](fns))
    decoder, _ = load_decoder(str(tiny_assets["target"]), str(tiny_assets["head"]), "chain", "float32",
                              TreeConfig.chain(3), prepack="auto")
    assert decoder.target.prepack_choice.kernels() == kernels
    assert prepack.packed_kernels(decoder.target.model) == kernels
    assert prepack.packed_kernels(decoder.draft) == kernels  # the head follows the target's choice


def test_the_configs_take_auto_and_refuse_other_words_naming_the_choices():
    from eagle_tree.commands.decode import DecodeConfig
    from eagle_tree.utils.config import ConfigError, load_config

    assert load_config(DecodeConfig, overrides=["target_prepack=auto"]).target_prepack == "auto"
    assert load_config(DecodeConfig, overrides=["target_prepack=true"]).target_prepack is True
    with pytest.raises(ConfigError, match="auto"):
        load_config(DecodeConfig, overrides=["target_prepack=sometimes"])
