"""Export to the EAGLE-3 / SGLang / vLLM layouts and back: same drafts, same acceptance, clear refusals.

A tiny head is trained for a few TTT steps (so its weights are not the initial ones), exported to each
layout, reloaded through ``Eagle3DraftModel.from_pretrained`` and compared bitwise with the original:
weights, draft logits and trees, and greedy speculative decoding (tokens and acceptance lengths).
Golden configs (tests/golden/*.json) pin what each layout writes for a fixed tiny head.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig

import eagle_tree as et
from eagle_tree.commands.export import main as export_main
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.drafting import Drafter
from eagle_tree.models.export import export_head
from eagle_tree.models.layouts import LAYOUTS, engine_feature_layers, expected_shapes, read_config
from eagle_tree.models.target import TargetModel
from eagle_tree.training.ttt import ttt_forward

GOLDEN = Path(__file__).parent / "golden"
TREE = et.TreeConfig(depth=3, top_k=2, total_tokens=6)
DRAFT_VOCAB = list(range(0, 128, 2))
CUSTOM_LAYERS = (1, 3, 4)  # not the defaults (2, 4, 5) of an 8-layer target


@pytest.fixture(scope="module")
def trained():
    """An 8-layer tiny llama target, a head trained for a few TTT steps on the target's own greedy
    continuations (draft vocabulary: the tokens seen plus every 4th id), and two prompts taken from
    those continuations, on which the head gets some draft tokens accepted."""
    hf = tiny_causal_lm("llama", num_layers=8, initializer_range=0.1)
    hf.config.architectures = ["LlamaForCausalLM"]  # as in the config.json of a saved target
    starts = torch.randint(0, 128, (3, 3), generator=torch.Generator().manual_seed(3))
    x = hf.generate(starts, max_new_tokens=21, min_new_tokens=21, do_sample=False, pad_token_id=0)  # (3, 24)
    target = TargetModel(hf)
    outs = [target.forward(x[i : i + 1], target.new_cache()) for i in range(len(x))]
    feats, logits = torch.cat([o.features for o in outs]), torch.cat([o.logits for o in outs])
    vocab = sorted(set(x.flatten().tolist()) | set(range(0, 128, 4)))
    draft = et.Eagle3DraftModel.from_target(target, draft_vocab=vocab)
    initial = copy.deepcopy(draft.state_dict())
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(10):
        res = ttt_forward(draft, feats, x, torch.ones_like(x), logits, steps=3)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
    draft.eval()
    assert losses[-1] < losses[0]
    changed = [k for k, v in draft.state_dict().items() if not torch.equal(v, initial[k])]
    assert {"fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight"} <= set(changed)
    return target, draft, [x[:1, :4], x[1:2, :4]]


def behaviour(draft, target, prompts, decode: bool = True) -> dict:
    """What a head does: draft logits and tree per prompt, then greedy speculative decoding."""
    out = {"logits": [], "trees": [], "sequences": [], "acceptance": []}
    for prompt in prompts:
        feats = target.prefill(prompt, target.new_cache()).features
        drafter = Drafter(draft, TREE)
        drafter.catch_up(feats[:, :-1], prompt[:, 1:])
        proposal = drafter.propose(et.SamplingConfig(temperature=0.0))[0]
        out["logits"].append(drafter.logits[0])
        out["trees"].append((proposal.tree.parents, proposal.tree.tokens))
    decoder = et.SpeculativeDecoder(target, draft, tree=TREE)
    for prompt in prompts if decode else []:
        gen = decoder.generate(prompt, max_new_tokens=8)
        out["sequences"].append(gen.sequences[0].tolist())
        out["acceptance"].append(gen.acceptance_lengths)
    return out


def assert_same_behaviour(mine: dict, theirs: dict) -> None:
    for a, b in zip(mine["logits"], theirs["logits"], strict=True):
        assert torch.equal(a, b)
    assert mine["trees"] == theirs["trees"]
    assert mine["sequences"] == theirs["sequences"]
    assert mine["acceptance"] == theirs["acceptance"]


@pytest.fixture(scope="module")
def original(trained):
    target, draft, prompts = trained
    out = behaviour(draft, target, prompts)
    assert max(n for lengths in out["acceptance"] for n in lengths) > 1  # some draft tokens are accepted
    return out


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    target, draft, _ = trained
    root = tmp_path_factory.mktemp("exported")
    return {layout: export_head(draft, root / layout, layout, target_config=target.config, verifier="tiny")
            for layout in LAYOUTS}


# ----------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip_gives_identical_drafts_and_acceptance(trained, original, exported, layout):
    target, draft, prompts = trained
    loaded = et.Eagle3DraftModel.from_pretrained(exported[layout], target=target)
    assert loaded.config == draft.config
    mine, theirs = draft.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert_same_behaviour(behaviour(loaded, target, prompts), original)


def test_comparison_detects_a_small_weight_change(trained, original, exported):
    """Negative control: a head that differs by one nudged lm_head row drafts differently."""
    target, _, prompts = trained
    loaded = et.Eagle3DraftModel.from_pretrained(exported["vllm"], target=target)
    with torch.no_grad():
        loaded.lm_head.weight[3] += 1e-3
    changed = behaviour(loaded, target, prompts, decode=False)
    assert not all(torch.equal(a, b) for a, b in zip(changed["logits"], original["logits"], strict=True))


def test_layout_files_and_key_names(exported):
    for layout, folder in exported.items():
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
        keys = set(load_file(str(folder / "model.safetensors")))
        prefix = "layers.0." if layout == "vllm" else "midlayer."
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", prefix + "hidden_norm.weight"} <= keys
        assert not any(k.startswith("embed_tokens") for k in keys)


def test_expected_shapes_match_the_module(trained):
    draft = trained[1]
    shapes = {k: tuple(v.shape) for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    assert expected_shapes(draft.config) == shapes
    assert set(expected_shapes(draft.config, "vllm")) == {k.replace("midlayer.", "layers.0.") for k in shapes}


def test_exported_configs_parse_as_transformers_llama_configs(trained, exported):
    sglang = AutoConfig.from_pretrained(exported["sglang"])  # as SGLang reads the draft's config
    assert isinstance(sglang, LlamaConfig) and sglang.architectures == ["LlamaForCausalLMEagle3"]
    vocab = trained[1].config.draft_vocab_size
    assert (sglang.num_hidden_layers, sglang.draft_vocab_size, sglang.target_hidden_size) == (1, vocab, 64)
    assert sglang.rope_parameters["rope_theta"] == 10000.0 and not sglang.tie_word_embeddings
    # the official EAGLE code loads the target's embedding only when target_hidden_size is absent
    eagle3 = AutoConfig.from_pretrained(exported["eagle3"])
    assert eagle3.draft_vocab_size == vocab and not hasattr(eagle3, "target_hidden_size")
    spec = json.loads((exported["vllm"] / "config.json").read_text())
    layer = LlamaConfig(**spec["transformer_layer_config"])
    assert (layer.hidden_size, layer.vocab_size, layer.num_hidden_layers) == (64, 128, 1)
    assert spec["speculators_config"]["verifier"] == {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}


# ----------------------------------------------------------------------------------------- golden files
def fixed_head(layers=None) -> tuple[et.Eagle3DraftModel, object]:
    hf = tiny_causal_lm("llama", num_layers=8)
    hf.config.architectures = ["LlamaForCausalLM"]  # as in the config.json of a saved target
    return et.Eagle3DraftModel.from_target(hf, draft_vocab=DRAFT_VOCAB, layers=layers), hf.config


def assert_matches_golden(config: dict, name: str) -> None:
    golden = json.loads((GOLDEN / name).read_text())
    assert sorted(config) == sorted(golden), f"{name}: keys differ"
    for key in golden:
        assert config[key] == golden[key], f"{name}: {key} is {config[key]!r}, the golden file says {golden[key]!r}"


@pytest.mark.parametrize(
    ("layout", "layers", "golden"),
    [("eagle3", None, "eagle3.json"), ("sglang", None, "sglang-default.json"),
     ("sglang", CUSTOM_LAYERS, "sglang.json"), ("vllm", CUSTOM_LAYERS, "vllm.json")],
)
@pytest.mark.filterwarnings("ignore:vLLM 0.11.0")
def test_configs_match_golden_files(tmp_path, layout, layers, golden):
    head, target_config = fixed_head(layers)
    out = export_head(head, tmp_path / layout, layout, target_config=target_config, verifier="eagle-tree/tiny-llama")
    assert_matches_golden(json.loads((out / "config.json").read_text()), golden)


@pytest.mark.filterwarnings("ignore:vLLM 0.11.0")
def test_feature_layer_conventions_of_each_engine(tmp_path):
    head, target_config = fixed_head(CUSTOM_LAYERS)
    sglang = export_head(head, tmp_path / "s", "sglang", target_config=target_config)
    vllm = export_head(head, tmp_path / "v", "vllm", target_config=target_config)
    s_cfg, v_cfg = (json.loads((p / "config.json").read_text()) for p in (sglang, vllm))
    assert s_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang adds 1
    assert v_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM captures the input of layer i
    assert engine_feature_layers("sglang", s_cfg, 8) == engine_feature_layers("vllm", v_cfg, 8) == CUSTOM_LAYERS
    # a SpecForge / SGLang config without eagle-tree's own record reads back with the +1
    del s_cfg["eagle_tree"]
    assert read_config(s_cfg).feature_layers == CUSTOM_LAYERS
    with pytest.raises(ValueError, match="always captures the default feature layers"):
        export_head(head, tmp_path / "e", "eagle3", target_config=target_config)
    assert not (tmp_path / "e").exists()


def test_export_warns_where_vllm_0_11_0_would_ignore_a_feature(tmp_path):
    """vLLM 0.11.0 captures (2, L//2, L-3) whatever the config says and swaps in the target's lm_head
    for full-vocabulary heads (docs/INTEROP.md, version floors); the export says so."""
    head, target_config = fixed_head()  # default layers, reduced vocabulary: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_head(head, tmp_path / "quiet", "vllm", target_config=target_config)
    custom, _ = fixed_head(CUSTOM_LAYERS)
    with pytest.warns(UserWarning, match=r"vLLM 0.11.0 ignores eagle_aux_hidden_state_layer_ids.*>= 0.11.1"):
        export_head(custom, tmp_path / "layers", "vllm", target_config=target_config)
    hf = tiny_causal_lm("llama", num_layers=8)
    full = et.Eagle3DraftModel.from_target(hf)
    with pytest.warns(UserWarning, match=r"vLLM 0.11.0 replaces the lm_head .*>= 0.11.1"):
        export_head(full, tmp_path / "full", "vllm", target_config=hf.config)
    with warnings.catch_warnings():  # the SGLang and official layouts carry no such note
        warnings.simplefilter("error")
        export_head(full, tmp_path / "full-sglang", "sglang", target_config=hf.config)


# ----------------------------------------------------------------------------------------- official EAGLE-3 style
def official_style(exported, tmp_path):
    folder = tmp_path / "official"
    shutil.copytree(exported["eagle3"], folder)
    config = json.loads((folder / "config.json").read_text())
    del config["eagle_tree"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_official_eagle3_config_assumes_the_targets_default_layers(trained, original, exported, tmp_path):
    target, draft, prompts = trained
    folder = official_style(exported, tmp_path)
    with pytest.raises(ValueError, match="names no feature layers"):
        et.Eagle3DraftModel.from_pretrained(folder)
    loaded = et.Eagle3DraftModel.from_pretrained(folder, target=target)
    assert loaded.config.feature_layers == (2, 4, 5) and loaded.config.target_num_layers == -1
    assert loaded.config.target_hidden_size == 64
    assert_same_behaviour(behaviour(loaded, target, prompts), original)
    other = TargetModel(target.model, feature_layers=CUSTOM_LAYERS)
    with pytest.raises(ValueError, match=r"feature layers \[2, 4, 5\] vs the target wrapper's \[1, 3, 4\]"):
        et.Eagle3DraftModel.from_pretrained(folder, target=other)


# ----------------------------------------------------------------------------------------- refusals
def corrupt(folder, how: str) -> None:
    weights = folder / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        return
    state = load_file(str(weights))
    if how == "missing key":
        del state[next(k for k in state if k.endswith("mlp.up_proj.weight"))]
    elif how == "wrong shape":
        state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()
    elif how == "d2t/t2d inconsistent":
        t2d = state["t2d"].clone()
        t2d[0], t2d[1] = ~t2d[0], ~t2d[1]  # id 0 is in the draft vocabulary, id 1 is not
        state["t2d"] = t2d
    save_file(state, str(weights))


@pytest.mark.parametrize(
    ("how", "message"),
    [("truncated", "model.safetensors is truncated or corrupt"), ("missing key", "missing keys .*up_proj"),
     ("wrong shape", r"weight fc.weight has shape \(64, 191\)"), ("d2t/t2d inconsistent", "d2t and t2d disagree")],
)
@pytest.mark.parametrize("layout", ["eagle3", "vllm"])
def test_corrupted_head_is_refused(trained, exported, tmp_path, layout, how, message):
    folder = tmp_path / "head"
    shutil.copytree(exported[layout], folder)
    corrupt(folder, how)
    with pytest.raises(ValueError, match=message):
        et.Eagle3DraftModel.from_pretrained(folder, target=trained[0])


def other_target(kind: str, hf):
    if kind == "feature layers":
        return TargetModel(hf, feature_layers=CUSTOM_LAYERS)
    extra = {"hidden size": {"hidden_size": 48}, "vocabulary": {"vocab_size": 96}}[kind]
    return TargetModel(tiny_causal_lm("llama", num_layers=8, **extra))


@pytest.mark.parametrize(
    ("kind", "message"),
    [("hidden size", "target hidden size 64 vs the target's 48"), ("vocabulary", "vocabulary 128 vs the target's 96"),
     ("feature layers", r"feature layers \[2, 4, 5\] vs the target wrapper's \[1, 3, 4\]")],
)
@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_head_of_another_target_is_refused(trained, exported, layout, kind, message):
    with pytest.raises(ValueError, match=f"does not belong to this target: .*{message}"):
        et.Eagle3DraftModel.from_pretrained(exported[layout], target=other_target(kind, trained[0].model))


@pytest.mark.parametrize("layout", ["eagle3", "vllm"])
def test_the_heads_rope_is_its_own_not_the_targets(trained, exported, tmp_path, layout):
    """Published Llama-3.1 heads name no rope_theta (the draft layer runs with 10000, the engines'
    default) while the target uses 500000: they load, with the head's rope, on such a target."""
    target, draft, _ = trained
    folder = tmp_path / "head"
    shutil.copytree(exported[layout], folder)
    config = json.loads((folder / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    del layer["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    other = TargetModel(tiny_causal_lm("llama", num_layers=8, initializer_range=0.1, rope_theta=500000.0))
    loaded = et.Eagle3DraftModel.from_pretrained(folder, target=other)
    assert loaded.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert loaded.config == draft.config
    out = export_head(loaded, tmp_path / "again", layout, target_config=other.config)
    again = json.loads((out / "config.json").read_text())
    assert again.get("transformer_layer_config", again)["rope_theta"] == 10000.0
    # negative control: a head whose own rope differs drafts differently
    changed = copy.deepcopy(loaded)
    changed.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    changed.rotary_emb = type(loaded.rotary_emb)(changed.config.llama_config())
    mine, theirs = behaviour(loaded, target, [torch.tensor([[5, 9, 3, 7, 11, 2]])], decode=False), \
        behaviour(changed, target, [torch.tensor([[5, 9, 3, 7, 11, 2]])], decode=False)
    assert not torch.allclose(mine["logits"][0], theirs["logits"][0])


@pytest.mark.parametrize(
    ("change", "message"),
    [({"norm_before_residual": None}, "does not say norm_before_residual"),
     ({"speculators_model_type": "mlp"}, "speculators 'mlp' model"),
     ({"norm_before_fc": True, "fc_norm": True}, "norm_before_fc and fc_norm are exclusive"),
     ({"norm_output": True}, "sets norm_output .* fed back as the next step's feature"),
     ({"transformer_layer_config": {"num_hidden_layers": 2}}, "num_hidden_layers=2"),
     ({"eagle_aux_hidden_state_layer_ids": [4, 1, 3]}, "not ascending: engines capture the layers in layer order"),
     ({"eagle_aux_hidden_state_layer_ids": [1, 3, 3]}, "repeat a layer: engines capture each layer once"),
     ({"eagle_aux_hidden_state_layer_ids": [0, 3, 4]}, "include layer 0: the input of layer 0 is the token embedding")],
)
def test_unsupported_speculators_configs_are_refused(exported, change, message):
    config = json.loads((exported["vllm"] / "config.json").read_text())
    del config["eagle_tree"]
    for key, value in change.items():
        if isinstance(value, dict):
            config[key].update(value)
        elif value is None:
            del config[key]
        else:
            config[key] = value
    with pytest.raises(ValueError, match=message):
        read_config(config)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"norm_output": False}, "norm_output=false .*without the final norm"),
     ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 0, 2]}}, "not ascending")],
)
def test_unsupported_llama_style_configs_are_refused(exported, change, message):
    """SpecForge / SGLang style configs: a head without the final norm and unusable layer ids are refused."""
    config = json.loads((exported["sglang"] / "config.json").read_text())
    del config["eagle_tree"]
    config.update(change)
    with pytest.raises(ValueError, match=message):
        read_config(config, target_num_layers=8)


def test_specforge_eagle31_config_reads_its_variants(exported):
    """SpecForge's Eagle 3.1 config: fc_norm (per-layer feature norms, supported) and norm_output: true
    (SpecForge's name for the final norm before lm_head, which every eagle-tree head applies)."""
    config = json.loads((exported["sglang"] / "config.json").read_text())
    del config["eagle_tree"]
    config.update({"fc_norm": True, "norm_output": True})
    cfg = read_config(config, target_num_layers=8)
    assert cfg.fc_norm and not cfg.norm_before_fc and not cfg.norm_before_residual
    assert "fc_norm.2.weight" in expected_shapes(cfg) and "input_norm.weight" not in expected_shapes(cfg)


def test_export_validates_before_writing_and_replaces_atomically(trained, tmp_path):
    target, draft, _ = trained
    out = export_head(draft, tmp_path / "head", "sglang", target_config=target.config)
    (out / "stale.txt").write_text("from an older export")
    export_head(draft, out, "sglang", target_config=target.config)
    assert not (out / "stale.txt").exists()  # replaced as a whole
    before = (out / "model.safetensors").read_bytes()
    broken = copy.deepcopy(draft)
    broken.t2d[1] = True  # a target id that d2t does not map to
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        export_head(broken, out, "sglang", target_config=target.config)
    assert (out / "model.safetensors").read_bytes() == before
    other = TargetModel(tiny_causal_lm("llama", num_layers=8, vocab_size=96))
    with pytest.raises(ValueError, match="vocabulary 128 vs the target's 96"):
        export_head(draft, tmp_path / "never", "vllm", target_config=other.config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temporary folders left


# ----------------------------------------------------------------------------------------- command line
def test_export_command(trained, exported, tmp_path, capsys):
    target, draft, _ = trained
    target.model.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "native")
    out = tmp_path / "vllm"
    assert export_main(["--to", "vllm", str(tmp_path / "native"), str(out), "--target", str(tmp_path / "target"),
                        "--speculative-tokens", "5", "--dtype", "bfloat16"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16

    official = official_style(exported, tmp_path)
    assert export_main(["--to", "sglang", str(official), str(tmp_path / "s")]) == 2
    assert "names no feature layers" in capsys.readouterr().err and not (tmp_path / "s").exists()
    with_target = ["--target", str(tmp_path / "target")]
    assert export_main(["--to", "sglang", str(official), str(tmp_path / "s"), *with_target]) == 0

    tiny_causal_lm("llama", num_layers=8, vocab_size=96).save_pretrained(tmp_path / "other")
    assert export_main(["--to", "eagle3", str(tmp_path / "native"), str(tmp_path / "e"),
                        "--target", str(tmp_path / "other")]) == 2
    assert "vocabulary 128 vs the target's 96" in capsys.readouterr().err and not (tmp_path / "e").exists()


# ----------------------------------------------------------------------------------------- W&B
def test_head_artifact_is_logged_offline(exported, tmp_path, monkeypatch):
    from eagle_tree.models.export import log_head_artifact
    from eagle_tree.utils.tracking import RunLogger, WandbConfig
    from tests.wandb_records import read_run

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_config = {"train": {"lr": 3e-4, "steps": 100}, "seed": 0}
    with RunLogger(WandbConfig(project="eagle-tree-test"), run_config=run_config, job_type="train") as logger:
        assert logger.mode == "offline"
        log_head_artifact(logger, exported["sglang"], "head step 100", run_config, 2.75)
        log_head_artifact(logger, exported["vllm"], "head-vllm", run_config, None)
    arts = {a["name"]: a for a in read_run(logger.run_dir).artifacts}
    assert set(arts) == {"head-step-100", "head-vllm"}
    first = arts["head-step-100"]
    assert first["type"] == "model" and first["files"] == ["config.json", "model.safetensors"]
    assert first["metadata"]["config"] == run_config and first["metadata"]["acceptance_length"] == 2.75
    assert first["metadata"]["layout"] == "eagle3"
    assert first["metadata"]["head_config"]["eagle_tree"] == {"feature_layers": [2, 4, 5], "target_num_layers": 8}
    assert arts["head-vllm"]["metadata"]["acceptance_length"] is None
    assert arts["head-vllm"]["metadata"]["layout"] == "vllm"
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        log_head_artifact(logger, tmp_path, "x", run_config, 1.0)
