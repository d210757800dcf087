"""Training-time test: training's unrolled steps equal the decoder's drafting depths."""

import pytest
import torch

import eagle_tree as et
from eagle_tree.data.tiny import FAMILIES, tiny_causal_lm
from eagle_tree.decoding.drafting import Drafter
from eagle_tree.models.target import TargetModel
from eagle_tree.training.ttt import simulated_acceptance_length, ttt_forward
from tests.helpers import follow


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    torch.manual_seed(0)
    target = TargetModel(tiny_causal_lm(request.param, num_layers=6))
    draft = et.Eagle3DraftModel.from_target(target, draft_vocab=list(range(0, 128, 2)))
    x = torch.randint(0, 128, (2, 18), generator=torch.Generator().manual_seed(1))
    out = target.forward(x[:1], target.new_cache())
    out2 = target.forward(x[1:], target.new_cache())
    feats = torch.cat([out.features, out2.features])
    logits = torch.cat([out.logits, out2.logits])
    return target, draft, x, feats, logits


@pytest.mark.parametrize("c", [0, 4, 11])
def test_training_step_s_equals_drafting_depth_s(setup, c):
    _, draft, x, feats, logits = setup
    steps = 4
    res = ttt_forward(draft, feats, x, torch.ones_like(x), logits, steps=steps)
    for row in range(2):
        drafter = Drafter(draft, et.TreeConfig.chain(steps))
        drafter.catch_up(feats[row : row + 1, : c + 1], x[row : row + 1, 1 : c + 2])
        along = follow(drafter, x[row, c + 2 : c + 1 + steps].tolist())
        for s in range(steps):
            torch.testing.assert_close(along[s], res.logits[s][row, c].float(), atol=2e-5, rtol=1e-4)


def test_pin_detects_a_position_shift(setup):
    """Negative control: the comparison is sensitive; a wrong token fed at depth 1 breaks it."""
    _, draft, x, feats, logits = setup
    res = ttt_forward(draft, feats, x, torch.ones_like(x), logits, steps=3)
    drafter = Drafter(draft, et.TreeConfig.chain(3))
    drafter.catch_up(feats[:1, :5], x[:1, 1:6])
    # the head fed the wrong token at depth 2 must disagree with training's step 1
    wrong = follow(drafter, [int(x[0, 6]) + 1])
    assert not torch.allclose(wrong[1], res.logits[1][0, 4].float(), atol=1e-4)


def test_right_padding_does_not_change_real_rows(setup):
    _, draft, x, feats, logits = setup
    full = ttt_forward(draft, feats[:1, :12], x[:1, :12], torch.ones_like(x[:1, :12]), logits[:1, :12], steps=3)
    padded = ttt_forward(
        draft, feats[:1], x[:1], torch.ones_like(x[:1]), logits[:1], steps=3, lengths=torch.tensor([12])
    )
    for s in range(3):
        n = 12 - 2 - s
        torch.testing.assert_close(full.logits[s][0, :n], padded.logits[s][0, :n], atol=2e-5, rtol=1e-4)
    assert full.step_counts == padded.step_counts
    assert full.step_losses == pytest.approx(padded.step_losses, rel=1e-4)


def test_loss_mask_selects_the_positions(setup):
    _, draft, x, feats, logits = setup
    mask = torch.zeros_like(x)
    res = ttt_forward(draft, feats, x, mask, logits, steps=2)
    assert res.step_counts == [0, 0] and float(res.loss.detach()) == 0.0
    mask[:, 10] = 1
    res = ttt_forward(draft, feats, x, mask, logits, steps=2)
    assert 0 < res.step_counts[0] <= 2 and res.step_losses[0] > 0


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([0.6, 0.6, 0.6]) == pytest.approx(2.176)
    assert simulated_acceptance_length([1.0] * 5) == 6.0


def test_overlap_is_the_sampled_acceptance_of_each_step(setup):
    """``overlap=True``: per step, the mean over loss positions of sum_v min(p(v), q(v)), p the target's
    whole-vocabulary distribution on the draft columns (not renormalised) and q the head's. Recomputed
    here from the step logits; the loss and the agreement do not change with it. Negative control: p
    renormalised over the draft vocabulary gives another figure (the draft vocabulary here is half of it)."""
    _, draft, x, feats, logits = setup
    mask = torch.ones_like(x)
    mask[:, :6] = 0
    plain = ttt_forward(draft, feats, x, mask, logits, steps=3)
    res = ttt_forward(draft, feats, x, mask, logits, steps=3, overlap=True)
    assert res.step_accuracy == plain.step_accuracy and res.loss.item() == plain.loss.item()
    assert plain.step_overlap == [] and len(res.step_overlap) == 3
    b, t = x.shape
    p_full = torch.softmax(logits.float(), -1)[..., draft.draft_to_target]
    p_norm = torch.softmax(logits.float()[..., draft.draft_to_target], -1)
    for s in range(3):
        q = torch.softmax(res.logits[s].float(), -1)
        got, renorm, n = 0.0, 0.0, 0
        for row in range(b):
            for j in range(t):
                if j + 2 + s < t and mask[row, j + 2 + s]:
                    got += float(torch.minimum(p_full[row, j + 1 + s], q[row, j]).sum())
                    renorm += float(torch.minimum(p_norm[row, j + 1 + s], q[row, j]).sum())
                    n += 1
        assert res.overlap_counts[s] == n > 0
        assert res.step_overlap[s] == pytest.approx(got / n, rel=1e-5)
        assert 0.0 < res.step_overlap[s] < 1.0
        assert renorm / n > got / n + 1e-3  # the control: renormalising inflates it
