"""The feature cache reproduces the online path exactly, resumes a partial build and refuses a stale one."""

from __future__ import annotations

import pytest
import torch

import eagle_tree as et
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.models.target import TargetModel
from eagle_tree.training.data import batches
from eagle_tree.training.feature_cache import (
    FeatureCache,
    StaleCacheError,
    compress_logits,
    example_targets,
    expand_logits,
)
from eagle_tree.training.loop import TTTLoss
from eagle_tree.training.stream import batch_targets, pad_targets
from eagle_tree.training.ttt import DraftTargets, ttt_forward
from eagle_tree.utils.checks import InputError

VOCAB = 128
DRAFT_IDS = torch.arange(0, VOCAB, 2)  # half the vocabulary: many target top tokens fall outside it


def make_examples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        mask = [0] + [int(v) for v in (torch.rand(length - 1, generator=g) < 0.8).tolist()]
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


@pytest.fixture(scope="module")
def setup():
    target = TargetModel(tiny_causal_lm("llama", vocab_size=VOCAB, num_layers=6, seed=3))
    draft = et.Eagle3DraftModel.from_target(target, draft_vocab=DRAFT_IDS, seed=1)
    return target, draft, make_examples(10, seed=0)


def test_expand_compress_keeps_what_the_loss_reads(setup):
    target, draft, examples = setup
    _, z = example_targets(target, torch.tensor(examples[0]["input_ids"]))
    d, top = compress_logits(z, DRAFT_IDS, draft.t2d)
    assert not bool(top.all()) and bool(top.any())  # both branches of the rule are exercised
    full = expand_logits(d, top, DRAFT_IDS, VOCAB)
    torch.testing.assert_close(full[:, DRAFT_IDS], z[:, DRAFT_IDS], rtol=0, atol=0)
    assert torch.equal(draft.t2d[full.argmax(-1)], draft.t2d[z.argmax(-1)])


def test_cached_loss_equals_online_loss_exactly(setup, tmp_path):
    target, draft, examples = setup
    cache = FeatureCache.build(tmp_path / "cache", target, examples, DRAFT_IDS, examples_per_shard=3)
    assert len(cache) == len(examples) and cache.meta["num_shards"] == 4
    module = TTTLoss(draft, steps=4, decay=0.8)
    n_checked = 0
    for batch in batches(examples, batch_size=4, seed=0, epoch=0):
        f_on, z_on = batch_targets(batch, target=target, draft=draft)
        f_ca, z_ca = batch_targets(batch, cache=cache)
        assert torch.equal(f_on, f_ca)  # features stored in the target dtype, bit for bit
        args = (batch.input_ids, batch.loss_mask)
        loss_on, out_on = module(f_on, *args, z_on, batch.lengths)
        loss_ca, out_ca = module(f_ca, *args, z_ca, batch.lengths)
        assert loss_on.item() == loss_ca.item()
        assert out_on.step_losses == out_ca.step_losses and out_on.step_accuracy == out_ca.step_accuracy
        assert out_on.step_counts == out_ca.step_counts and sum(out_on.step_counts) > 0
        n_checked += 1
    assert n_checked == 3


def test_a_lossy_store_would_be_caught(setup):
    """Negative control: rounding the stored logits to bfloat16 changes the loss, so equality above means something."""
    target, draft, examples = setup
    ids = torch.tensor([examples[1]["input_ids"]])
    f, z = example_targets(target, ids[0])
    mask = torch.tensor([examples[1]["loss_mask"]])
    exact = ttt_forward(draft, f[None], ids, mask, z[None], steps=3).loss.item()
    rounded = ttt_forward(draft, f[None], ids, mask, z[None].bfloat16().float(), steps=3).loss.item()
    assert exact != rounded


def test_interrupted_build_resumes(setup, tmp_path):
    target, _, examples = setup
    folder = tmp_path / "cache"
    FeatureCache.build(folder, target, examples, DRAFT_IDS, examples_per_shard=4)
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*")}
    reference = FeatureCache(folder).get(9)
    (folder / "shard-00002.safetensors").unlink()  # as if killed before the last shard
    with pytest.raises(RuntimeError, match="incomplete"):
        FeatureCache.open(folder)
    cache = FeatureCache.build(folder, target, examples, DRAFT_IDS, examples_per_shard=4)
    after = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*")}
    assert after["shard-00000.safetensors"] == before["shard-00000.safetensors"]  # not rewritten
    assert after["shard-00001.safetensors"] == before["shard-00001.safetensors"]
    for got, want in zip(cache.get(9), reference, strict=True):
        assert torch.equal(got, want)
    assert not list(folder.glob(".*tmp"))  # no temporary files left


def test_stale_cache_is_refused(setup, tmp_path):
    target, _, examples = setup
    folder = tmp_path / "cache"
    cache = FeatureCache.build(folder, target, examples, DRAFT_IDS, examples_per_shard=5)
    good = FeatureCache.fingerprint(target, examples, DRAFT_IDS)
    FeatureCache.open(folder, good)  # the matching fingerprint opens
    assert cache.meta["fingerprint"] == good

    other_data = examples[:-1] + [make_examples(1, seed=99)[0]]
    with pytest.raises(StaleCacheError, match="dataset"):
        FeatureCache.build(folder, target, other_data, DRAFT_IDS, examples_per_shard=5)
    other_target = TargetModel(tiny_causal_lm("llama", vocab_size=VOCAB, num_layers=6, seed=4))
    with pytest.raises(StaleCacheError, match="target"):
        FeatureCache.build(folder, other_target, examples, DRAFT_IDS, examples_per_shard=5)
    with pytest.raises(StaleCacheError, match="draft_vocab"):
        FeatureCache.open(folder, FeatureCache.fingerprint(target, examples, DRAFT_IDS[:-1]))


def test_fingerprint_sees_a_small_weight_change(setup):
    from eagle_tree.training.feature_cache import target_fingerprint

    target, _, _ = setup
    before = target_fingerprint(target)
    layer = target.model.model.layers[3].mlp.down_proj.weight
    original = layer[5, 7].item()
    with torch.no_grad():
        layer[5, 7] += 1e-3
        after = target_fingerprint(target)
        layer[5, 7] = original
    assert before != after


def test_several_vocabularies_share_one_forward_and_equal_caches_built_alone(setup, tmp_path, monkeypatch):
    import eagle_tree.training.feature_cache as fc

    target, _, examples = setup
    small, large = DRAFT_IDS[:16], torch.arange(VOCAB - 40, VOCAB)
    alone = [FeatureCache.build(tmp_path / f"alone-{i}", target, examples, ids, examples_per_shard=4)
             for i, ids in enumerate((small, large))]
    calls = []
    real = fc.example_targets
    monkeypatch.setattr(fc, "example_targets", lambda t, ids: calls.append(1) or real(t, ids))
    (tmp_path / "many-1").mkdir()
    FeatureCache.build(tmp_path / "many-1", target, examples[:4], large, examples_per_shard=4)  # wrong data
    with pytest.raises(StaleCacheError, match="dataset"):
        FeatureCache.build_many([(tmp_path / "many-0", small), (tmp_path / "many-1", large)], target, examples,
                                examples_per_shard=4)
    calls.clear()
    for shard in (tmp_path / "many-1").iterdir():
        shard.unlink()
    many = FeatureCache.build_many([(tmp_path / "many-0", small), (tmp_path / "many-1", large)], target, examples,
                                   examples_per_shard=4)
    assert len(calls) == len(examples)  # one forward per example for both caches, not one per cache
    for got, want in zip(many, alone, strict=True):
        assert torch.equal(got.draft_ids, want.draft_ids) and got.meta == want.meta
        for i in range(len(examples)):
            for a, b in zip(got.get(i), want.get(i), strict=True):
                assert torch.equal(a, b)
    assert not torch.equal(many[0].get(0)[1][:, :4], many[1].get(0)[1][:, :4])  # each kept its own columns
    calls.clear()
    FeatureCache.build_many([(tmp_path / "many-0", small), (tmp_path / "many-1", large)], target, examples,
                            examples_per_shard=4)
    assert calls == []  # complete caches: nothing recomputed


def _counting(monkeypatch):
    import eagle_tree.training.feature_cache as fc

    calls = []
    real = fc.example_targets
    monkeypatch.setattr(fc, "example_targets", lambda t, ids: calls.append(1) or real(t, ids))
    return calls


def test_a_grown_dataset_reuses_the_shards_of_its_prefix(setup, tmp_path, monkeypatch):
    """Appending examples: the earlier cache's full shards are linked, only the rest is computed, and
    the result equals a cache built from scratch, byte for byte."""
    target, _, examples = setup
    grown = examples + make_examples(5, seed=7)
    old = FeatureCache.build(tmp_path / "old", target, examples, DRAFT_IDS, examples_per_shard=4)  # 4, 4, 2
    assert len(old.meta["shard_hashes"]) == 3
    scratch = FeatureCache.build(tmp_path / "scratch", target, grown, DRAFT_IDS, examples_per_shard=4)
    calls = _counting(monkeypatch)
    new = FeatureCache.build(tmp_path / "new", target, grown, DRAFT_IDS, examples_per_shard=4,
                             reuse_from=[tmp_path / "old"])
    assert len(calls) == len(grown) - 8  # shards 0 and 1 linked; shard 2 (2 examples before, 4 now) computed
    for s in (0, 1):
        name = f"shard-{s:05d}.safetensors"
        assert (tmp_path / "new" / name).samefile(tmp_path / "old" / name)
    assert not (tmp_path / "new" / "shard-00002.safetensors").samefile(tmp_path / "old" / "shard-00002.safetensors")
    assert new.meta == scratch.meta
    for s in range(new.meta["num_shards"]):
        name = f"shard-{s:05d}.safetensors"
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "scratch" / name).read_bytes()
    assert not list((tmp_path / "new").glob(".*tmp"))


def test_shards_of_other_examples_targets_or_vocabularies_are_not_reused(setup, tmp_path, monkeypatch):
    """Negative controls: a changed example, another target, another draft vocabulary or shard size each
    leave the shard to be computed."""
    target, _, examples = setup
    FeatureCache.build(tmp_path / "old", target, examples, DRAFT_IDS, examples_per_shard=4)
    changed = [dict(e) for e in examples]
    changed[5] = make_examples(1, seed=99)[0]  # shard 1 differs; shards 0 and 2 do not
    calls = _counting(monkeypatch)
    FeatureCache.build(tmp_path / "a", target, changed, DRAFT_IDS, examples_per_shard=4, reuse_from=[tmp_path / "old"])
    assert len(calls) == 4  # shard 1's examples only
    assert not (tmp_path / "a" / "shard-00001.safetensors").samefile(tmp_path / "old" / "shard-00001.safetensors")
    other_target = TargetModel(tiny_causal_lm("llama", vocab_size=VOCAB, num_layers=6, seed=4))
    for folder, tgt, ids, per in (("b", other_target, DRAFT_IDS, 4), ("c", target, DRAFT_IDS[:-1], 4),
                                  ("d", target, DRAFT_IDS, 5)):
        calls.clear()
        FeatureCache.build(tmp_path / folder, tgt, examples, ids, examples_per_shard=per,
                           reuse_from=[tmp_path / "old"])
        assert len(calls) == len(examples), folder
    with pytest.raises(InputError, match="not a feature cache"):
        FeatureCache.build(tmp_path / "e", target, examples, DRAFT_IDS, examples_per_shard=4,
                           reuse_from=[tmp_path / "nowhere"])


def test_a_cache_without_shard_hashes_gets_them_when_built_again(setup, tmp_path, monkeypatch):
    """Caches written before shards had hashes: building the complete cache again adds them (nothing computed)."""
    import json

    target, _, examples = setup
    folder = tmp_path / "old"
    FeatureCache.build(folder, target, examples, DRAFT_IDS, examples_per_shard=4)
    meta = json.loads((folder / "meta.json").read_text())
    hashes = meta.pop("shard_hashes")
    (folder / "meta.json").write_text(json.dumps(meta))
    calls = _counting(monkeypatch)
    FeatureCache.build(tmp_path / "x", target, examples, DRAFT_IDS, examples_per_shard=4, reuse_from=[folder])
    assert len(calls) == len(examples)  # no hashes: nothing can be proven equal, so nothing is reused
    calls.clear()
    assert FeatureCache.build(folder, target, examples, DRAFT_IDS, examples_per_shard=4).meta["shard_hashes"] == hashes
    assert calls == []


def test_a_packed_target_has_the_fingerprint_and_the_features_of_the_unpacked_one(setup):
    """target.prepack is a kernel choice: a cache written with either kernels is the other's cache too."""
    import copy

    from eagle_tree.models.prepack import PackedLinear, prepack_available, prepack_linears
    from eagle_tree.training.feature_cache import target_fingerprint

    if not prepack_available():
        pytest.skip("this torch build lacks oneDNN's packed linear")
    target, _, examples = setup
    packed = TargetModel(copy.deepcopy(target.model))
    assert prepack_linears(packed.model) > 0
    assert target_fingerprint(packed) == target_fingerprint(target)
    ids = torch.tensor(examples[0]["input_ids"])
    (f0, l0), (f1, l1) = example_targets(target, ids), example_targets(packed, ids)
    torch.testing.assert_close(f1, f0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-5)
    # the fingerprint still reads the weights under the packed copies
    linear = next(m for m in packed.model.modules() if isinstance(m, PackedLinear))
    with torch.no_grad():
        linear.weight[0, 0] += 1e-3
    assert target_fingerprint(packed) != target_fingerprint(target)


def test_train_config_target_prepack_loads_a_packed_target(tmp_path):
    from eagle_tree.models.prepack import PackedLinear, prepack_available
    from eagle_tree.training.config import TrainConfig
    from eagle_tree.training.resolve import load_target
    from tests.tiny_gguf import write_tiny_gguf

    if not prepack_available():
        pytest.skip("this torch build lacks oneDNN's packed linear")
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    for prepack in (False, True):
        cfg = TrainConfig()
        cfg.target.path, cfg.target.prepack = str(tiny.path), prepack
        target, _ = load_target(cfg)
        assert any(isinstance(m, PackedLinear) for m in target.model.modules()) == prepack


def test_draft_targets_give_the_full_logits_loss_bit_for_bit(setup):
    """The loss and its gradients from DraftTargets (the draft columns and the top-token flag, as the
    trainer passes them) equal those from the full (B, T, V) logits, with padding, a partial mask and top
    tokens outside the draft vocabulary. Negative control: a flag flipped at one counted position changes
    the loss. The overlap needs the full logits and says so."""
    target, draft, examples = setup
    batch = next(iter(batches(examples, batch_size=4, seed=0, epoch=0)))
    assert len(set(batch.lengths.tolist())) > 1  # padded rows
    rows = [example_targets(target, batch.input_ids[r, : int(batch.lengths[r])]) for r in range(4)]
    features, full = pad_targets(rows, batch.input_ids.shape[1])
    f2, compact = batch_targets(batch, target=target, draft=draft)
    assert isinstance(compact, DraftTargets) and torch.equal(features, f2)
    assert not bool(compact.top_in_draft.all())
    args = (features, batch.input_ids, batch.loss_mask)
    kwargs = {"steps": 3, "lengths": batch.lengths}

    def run(targets):
        draft.zero_grad(set_to_none=True)
        out = ttt_forward(draft, *args, targets, **kwargs)
        out.loss.backward()
        return out, {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}

    out_full, g_full = run(full)
    out_compact, g_compact = run(compact)
    assert out_full.loss.item() == out_compact.loss.item()
    assert out_full.step_accuracy == out_compact.step_accuracy and out_full.step_counts == out_compact.step_counts
    assert all(torch.equal(g_full[k], g_compact[k]) for k in g_full)
    flipped = compact.top_in_draft.clone()
    r, k = next((r, k) for r in range(4) for k in range(int(batch.lengths[r]) - 1)
                if flipped[r, k] and batch.loss_mask[r, k + 1])  # step 0 counts position k - 1
    flipped[r, k] = False
    other = ttt_forward(draft, *args, DraftTargets(compact.logits, flipped), **kwargs)
    assert other.loss.item() != out_full.loss.item()
    with pytest.raises(ValueError, match="full-vocabulary logits"):
        ttt_forward(draft, *args, compact, overlap=True, **kwargs)
