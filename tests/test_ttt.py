"""Training-time test: training's unrolled steps equal the decoder's drafting depths."""

import pytest
import torch

import eagle_tree as et
from eagle_tree.data.tiny import FAMILIES, tiny_causal_lm
from eagle_tree.decoding.drafting import Drafter
from eagle_tree.models.target import TargetModel
from eagle_tree.training.ttt import kl_rows, simulated_acceptance_length, ttt_forward
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
    res = ttt_forward(draft, feats, x, torch.ones_like(x), logits, steps=steps, keep_logits=True)
    for row in range(2):
        drafter = Drafter(draft, et.TreeConfig.chain(steps))
        drafter.catch_up(feats[row : row + 1, : c + 1], x[row : row + 1, 1 : c + 2])
        along = follow(drafter, x[row, c + 2 : c + 1 + steps].tolist())
        for s in range(steps):
            torch.testing.assert_close(along[s], res.logits[s][row, c].float(), atol=2e-5, rtol=1e-4)


def test_pin_detects_a_position_shift(setup):
    """Negative control: the comparison is sensitive; a wrong token fed at depth 1 breaks it."""
    _, draft, x, feats, logits = setup
    res = ttt_forward(draft, feats, x, torch.ones_like(x), logits, steps=3, keep_logits=True)
    drafter = Drafter(draft, et.TreeConfig.chain(3))
    drafter.catch_up(feats[:1, :5], x[:1, 1:6])
    # the head fed the wrong token at depth 2 must disagree with training's step 1
    wrong = follow(drafter, [int(x[0, 6]) + 1])
    assert not torch.allclose(wrong[1], res.logits[1][0, 4].float(), atol=1e-4)


def test_right_padding_does_not_change_real_rows(setup):
    _, draft, x, feats, logits = setup
    full = ttt_forward(draft, feats[:1, :12], x[:1, :12], torch.ones_like(x[:1, :12]), logits[:1, :12], steps=3,
                       keep_logits=True)
    padded = ttt_forward(
        draft, feats[:1], x[:1], torch.ones_like(x[:1]), logits[:1], steps=3, lengths=torch.tensor([12]),
        keep_logits=True,
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
    res = ttt_forward(draft, feats, x, mask, logits, steps=3, overlap=True, keep_logits=True)
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


def written_loss(draft, x, mask, logits, step_logits, lengths, decay, renormalise=True, skip_outside=True):
    """The loss as the module docstring writes it, position by position: step s at j counts when
    j + 2 + s < length, the mask is set at j + 2 + s and the target's top token at j + 1 + s lies in the
    draft vocabulary; KL(p || softmax(head logits)), p the target's distribution at j + 1 + s on the
    draft columns (renormalised); the mean over counted positions, weighted decay ** s."""
    total = 0.0
    for s, lg in enumerate(step_logits):
        kls = []
        for row in range(x.shape[0]):
            for j in range(x.shape[1]):
                if not (j + 2 + s < int(lengths[row]) and mask[row, j + 2 + s]):
                    continue
                z = logits[row, j + 1 + s].float()
                if skip_outside and int(draft.t2d[z.argmax()]) == 0:
                    continue
                p = torch.softmax(z, -1)[draft.draft_to_target]
                p = p / p.sum() if renormalise else p
                logq = torch.log_softmax(lg[row, j].float(), -1)
                kls.append((p * (p.clamp_min(1e-30).log() - logq)).sum())
        total = total + decay**s * (torch.stack(kls).mean() if kls else torch.zeros(()))
    return total


def test_loss_and_gradients_equal_the_written_kl(setup):
    """The loss computed at the counted positions only (entropy once, logsumexp form) equals the KL
    written position by position over the full logits, in value and in every gradient, with padding,
    a partial mask and target top tokens outside the draft vocabulary. Negative controls: leaving the
    renormalisation out, or counting positions whose top token is outside, gives another value."""
    _, draft, x, feats, logits = setup
    mask = torch.ones_like(x)
    mask[:, :5] = 0
    mask[1, 9] = 0
    lengths = torch.tensor([18, 14])
    assert not bool(draft.t2d[logits.argmax(-1)].bool().all())  # some top tokens lie outside the vocab

    def grads(loss):
        draft.zero_grad(set_to_none=True)
        loss.backward()
        return {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}

    fast = ttt_forward(draft, feats, x, mask, logits, steps=3, decay=0.7, lengths=lengths)
    g_fast = grads(fast.loss)
    full = ttt_forward(draft, feats, x, mask, logits, steps=3, decay=0.7, lengths=lengths, keep_logits=True)
    ref = written_loss(draft, x, mask, logits, full.logits, lengths, 0.7)
    torch.testing.assert_close(fast.loss.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
    g_ref = grads(ref)
    assert set(g_fast) == set(g_ref) and "lm_head.weight" in g_fast and "fc.weight" in g_fast
    for k in g_ref:
        torch.testing.assert_close(g_fast[k], g_ref[k], atol=1e-6, rtol=1e-4)
    with torch.no_grad():
        for kwargs in ({"renormalise": False}, {"skip_outside": False}):
            other = written_loss(draft, x, mask, logits, full.logits, lengths, 0.7, **kwargs)
            assert abs(float(other) - float(ref)) > 1e-4  # ten times the tolerance above


def test_kl_rows_keeps_float32_precision_at_a_real_draft_vocabulary():
    """At SmolLM2's draft vocabulary (8,192) and a batch's worth of rows, the KL in float32 stays within
    1e-5 of the float64 one. Negative control: the same sum as one flat dot over every value (the
    cheaper form) is off by far more, so this test can tell the two apart."""
    g = torch.Generator().manual_seed(0)
    z_target = torch.randn(1500, 8192, generator=g) * 4
    logits = torch.randn(1500, 8192, generator=g) * 4 + 20  # offset logits, as a trained head's are
    p = torch.softmax(z_target, -1)
    neg_entropy = torch.special.xlogy(p, p).sum(-1)
    got = kl_rows(p, neg_entropy, logits).sum() / 1500
    p64, z64 = p.double(), logits.double()
    exact = (torch.special.xlogy(p64, p64).sum(-1) - (p64 * torch.log_softmax(z64, -1)).sum(-1)).mean()
    assert abs(float(got) - float(exact)) < 1e-5 * float(exact)
    flat = (neg_entropy.sum() - torch.dot(p.flatten(), logits.flatten()) + torch.logsumexp(logits, -1).sum()) / 1500
    assert abs(float(flat) - float(exact)) > 10 * abs(float(got) - float(exact))
