"""An independent reference for what the serving engines compute with an exported head.

``EngineReference`` re-implements, for this test only, the draft forward of vLLM, SGLang and the
official EAGLE code from their published loading rules, and reads an export folder by key names
alone (``config.json`` + ``model.safetensors``, no eagle_tree model code):

* key names: ``midlayer.*`` (EAGLE-3 / SGLang) or ``layers.0.*`` (speculators / vLLM); q, k, v and
  gate, up are stacked into ``qkv_proj`` and ``gate_up_proj`` as the engines' loaders do, and split
  again by the head sizes of the config (``head_dim``, else hidden_size / heads);
* norm order: ``cat([input_layernorm(embedding), hidden_norm(feature)])`` is the attention input;
  the residual is the feature (``hidden_norm(feature)`` when ``norm_before_residual``); the final
  ``norm`` precedes ``lm_head``; the pre-norm output is the next step's feature;
* the d2t offset rule: draft id ``i`` is target id ``i + d2t[i]``; logits are scattered into the
  target vocabulary with -inf elsewhere (vLLM's ``compute_logits``);
* the layer-id rule: the speculators layout captures the input of layer ``i`` for each
  ``eagle_aux_hidden_state_layer_ids`` entry; the Llama-style layout (SGLang) the output of layer
  ``i`` (the input of ``i + 1``) for each ``eagle_config`` id; no ids: the inputs of layers
  (2, L // 2, L - 3); captured states are concatenated in layer order;
* the official EAGLE code: its ``EConfig`` accepts ``rope_scaling`` only as ``{type: linear |
  dynamic, factor > 1}``, it loads the target's embedding only when the config has no
  ``target_hidden_size``, and derives head_dim as hidden_size / heads;
* rope from the head's own config (theta 10000 when absent), default, linear and llama3 scaling.

The target's hidden states come from the Hugging Face model's ``output_hidden_states`` (entry ``i`` =
the input of layer ``i``), not from eagle_tree's capture. The reference must match
``Eagle3DraftModel`` logits over a prefill and three chained draft steps for every layout, default
and non-default layers, reduced and full draft vocabularies and rope with and without scaling; the
negative controls (swapped norms, d2t read as absolute ids, swapped concat order, SGLang ids read
without the + 1) must be caught.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.models.export import export_head
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from tests.helpers import PastKV

PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 33, 7]
NUM_LAYERS = 8  # the engines' default layers (2, 4, 5) are valid from 7 layers
CUSTOM_LAYERS = (1, 3, 6)
REDUCED_VOCAB = sorted(set(range(0, 128, 3)) | set(PROMPT))
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
}


# ------------------------------------------------------------------------------------ the reference
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies from a transformers 4.x style config (rope_theta + rope_scaling)."""
    theta = float(config.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen - low) / (high - low)).clamp(0, 1)
        scaled = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen < old / high, inv, torch.where(wavelen > old / low, inv / factor, scaled))
    assert kind == "default", f"the reference knows no rope type {kind}"
    return inv


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim); neox style (the halves rotate together), as Llama in every engine."""
    freqs = positions[:, None].double() * inv_freq[None]
    cos, sin = freqs.cos().float()[:, None], freqs.sin().float()[:, None]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class EngineReference:
    """The draft forward of an engine for an export folder, from the loading rules in the docstring."""

    def __init__(self, folder: Path, target_hf, engine: str, *, swap_norms=False, d2t_absolute=False,
                 hidden_first=False, sglang_ids_without_offset=False, ignore_rope_scaling=False,
                 skip_feature_norms=False):
        config = json.loads((folder / "config.json").read_text())
        weights = load_file(str(folder / "model.safetensors"))
        self.controls = dict(swap_norms=swap_norms, hidden_first=hidden_first, skip_feature_norms=skip_feature_norms)
        num_layers = target_hf.config.num_hidden_layers
        if engine == "vllm":  # a speculators config
            layer = config["transformer_layer_config"]
            ids = config.get("eagle_aux_hidden_state_layer_ids")
            self.captured = list(ids) if ids else None  # the input of layer i
            self.norm_before_residual = bool(config["norm_before_residual"])
        elif engine == "sglang":
            layer = config
            ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            offset = 0 if sglang_ids_without_offset else 1
            self.captured = [i + offset for i in ids] if ids else None  # the output of layer i
            self.norm_before_residual = False  # SGLang's layer has no such option
        else:  # the official EAGLE code: no layer ids, no variants
            layer = config
            self._official_checks(config)
            self.captured, self.norm_before_residual = None, False
        if self.captured is None:
            self.captured = [2, num_layers // 2, num_layers - 3]
        self.captured = sorted(set(self.captured))  # captured once each, in layer order
        self.eps = layer.get("rms_norm_eps", 1e-6)
        self.heads, self.kv_heads = layer["num_attention_heads"], layer.get("num_key_value_heads")
        self.kv_heads = self.kv_heads or self.heads
        self.head_dim = layer.get("head_dim") or layer["hidden_size"] // self.heads
        self.inv_freq = rope_inv_freq({**layer, "rope_scaling": None} if ignore_rope_scaling else layer, self.head_dim)
        self.vocab = layer["vocab_size"]
        w = {k.replace("layers.0.", "midlayer."): v.float() for k, v in weights.items()}
        self.qkv = torch.cat([w["midlayer.self_attn.q_proj.weight"], w["midlayer.self_attn.k_proj.weight"],
                              w["midlayer.self_attn.v_proj.weight"]])
        self.gate_up = torch.cat([w["midlayer.mlp.gate_proj.weight"], w["midlayer.mlp.up_proj.weight"]])
        self.w = w
        d2t = weights["d2t"].long()
        self.hot = d2t if d2t_absolute else d2t + torch.arange(d2t.numel())
        self.embedding = target_hf.get_input_embeddings().weight.detach().float()
        self.keys, self.values = [], []

    @staticmethod
    def _official_checks(config: dict) -> None:
        scaling = config.get("rope_scaling")
        if scaling is not None:
            assert set(scaling) == {"type", "factor"} and scaling["type"] in ("linear", "dynamic"), scaling
            assert isinstance(scaling["factor"], float) and scaling["factor"] > 1
        # with target_hidden_size the official code skips loading the target's embedding
        assert "target_hidden_size" not in config, "the official code would run on a random embedding"
        assert config.get("head_dim") in (None, config["hidden_size"] // config["num_attention_heads"])

    def features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """(T, 3H) from the target's per-layer hidden states (entry i = the input of layer i)."""
        return torch.cat([hidden_states[i][0].float() for i in self.captured], dim=-1)

    def step(self, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, fused: bool):
        """feature (T, 3H) target features (fused=False) or (T, H) the previous outputs; tokens (T,)
        target ids. Returns (pre-norm outputs (T, H), logits over the target vocabulary (T, V))."""
        w, eps = self.w, self.eps
        if not fused and "input_norm.weight" in w and not self.controls["skip_feature_norms"]:
            feature = rms_norm(feature, w["input_norm.weight"], eps)  # norm_before_fc
        if not fused and "fc_norm.0.weight" in w and not self.controls["skip_feature_norms"]:
            parts = feature.chunk(3, dim=-1)  # fc_norm: one norm per captured layer
            feature = torch.cat([rms_norm(p, w[f"fc_norm.{i}.weight"], eps) for i, p in enumerate(parts)], dim=-1)
        hidden = feature if fused else feature @ w["fc.weight"].T
        emb = self.embedding[tokens]
        emb_norm, hid_norm = w["midlayer.input_layernorm.weight"], w["midlayer.hidden_norm.weight"]
        if self.controls["swap_norms"]:
            emb_norm, hid_norm = hid_norm, emb_norm
        normed_hidden = rms_norm(hidden, hid_norm, eps)
        residual = normed_hidden if self.norm_before_residual else hidden
        parts = [rms_norm(emb, emb_norm, eps), normed_hidden]
        x = torch.cat(parts[::-1] if self.controls["hidden_first"] else parts, dim=-1)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = (x @ self.qkv.T).split([q_size, kv_size, kv_size], dim=-1)
        t = x.shape[0]
        q = apply_rope(q.view(t, self.heads, self.head_dim), positions, self.inv_freq)
        k = apply_rope(k.view(t, self.kv_heads, self.head_dim), positions, self.inv_freq)
        self.keys.append(k)
        self.values.append(v.view(t, self.kv_heads, self.head_dim))
        keys, values = torch.cat(self.keys), torch.cat(self.values)
        group = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(self.head_dim)
        past = keys.shape[0] - t  # every earlier entry is visible; the new ones causally
        visible = torch.ones(t, keys.shape[0], dtype=torch.bool).tril(past)
        attn = torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
        h = residual + attn.reshape(t, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        gate, up = (rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps) @ self.gate_up.T).chunk(2, -1)
        out = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        draft_logits = rms_norm(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
        logits = torch.full((t, self.vocab), float("-inf"))
        logits[:, self.hot] = draft_logits
        return out, logits


# ------------------------------------------------------------------------------------ running both
@functools.cache
def hf():
    return tiny_causal_lm("llama", num_layers=NUM_LAYERS, initializer_range=0.1)


@functools.cache
def target(layers: tuple[int, ...] | None = None) -> TargetModel:
    return TargetModel(hf(), feature_layers=layers)


def make_head(layers=None, reduced=True, rope="default", **variants) -> Eagle3DraftModel:
    """A head with every weight random (norm weights too, so that a swapped norm shows); variants:
    norm_before_residual, norm_before_fc, fc_norm."""
    head = Eagle3DraftModel.from_target(target(layers), draft_vocab=REDUCED_VOCAB if reduced else None)
    cfg = dataclasses.replace(head.config, rope_parameters=dict(ROPES[rope]), **variants)
    g = torch.Generator().manual_seed(7)
    state = {}
    for key, value in Eagle3DraftModel(cfg, head.d2t, head.t2d).state_dict().items():
        if key in ("d2t", "t2d"):
            state[key] = value
        elif key == "embed_tokens.weight":
            state[key] = head.embed_tokens.weight
        elif "norm" in key:
            state[key] = 1.0 + 0.3 * torch.randn(value.shape, generator=g)
        else:
            state[key] = 0.15 * torch.randn(value.shape, generator=g)
    return Eagle3DraftModel.from_state_dict(cfg, state, target=target(layers))


def export(head: Eagle3DraftModel, layout: str, folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the vLLM 0.11.0 notes (tested in test_export.py)
        return export_head(head, folder / layout, layout, target_config=hf().config)


def eagle_tree_logits(head: Eagle3DraftModel, tokens_after: list[int]):
    """Eagle3DraftModel over the prefill pairs (feature j, token j + 1) and three chained steps fed
    ``tokens_after``; logits scattered into the target vocabulary, as an engine returns them."""
    prompt = torch.tensor([PROMPT])
    tm = target(head.config.feature_layers)
    feats = tm.prefill(prompt, tm.new_cache()).features[:, :-1]  # eagle_tree's own capture
    t = feats.shape[1]
    past = PastKV()
    out, logits = head.step(head.fuse(feats), prompt[:, 1:], torch.arange(t)[None], past,
                            torch.ones(t, t, dtype=torch.bool).tril()[None, None])
    results, hidden = [logits[0]], out[:, -1:]
    for i, token in enumerate(tokens_after):
        mask = torch.ones(1, 1, 1, t + i + 1, dtype=torch.bool)
        hidden, logits = head.step(hidden, torch.tensor([[token]]), torch.tensor([[t + i]]), past, mask)
        results.append(logits[0])
    full = []
    for draft_logits in results:
        scattered = torch.full((draft_logits.shape[0], head.config.vocab_size), float("-inf"))
        scattered[:, head.draft_to_target] = draft_logits.float()
        full.append(scattered)
    return full


def reference_logits(ref: EngineReference, steps: int = 3):
    """The engine over the same prefill pairs, then ``steps`` chained steps on its own greedy tokens."""
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden_states = hf()(prompt, output_hidden_states=True).hidden_states
    feats = ref.features(hidden_states)[:-1]
    t = feats.shape[0]
    out, logits = ref.step(feats, prompt[0, 1:], torch.arange(t), fused=False)
    results, tokens, hidden = [logits], [], out[-1:]
    for i in range(steps):
        token = int(results[-1][-1].argmax())
        tokens.append(token)
        hidden, logits = ref.step(hidden, torch.tensor([token]), torch.tensor([t + i]), fused=True)
        results.append(logits)
    return results, tokens


ENGINES = {"eagle3": "official", "sglang": "sglang", "vllm": "vllm"}


def compare(head: Eagle3DraftModel, folder: Path, **controls) -> float:
    """The largest logit difference between the engine reference and eagle_tree (inf when the
    -inf pattern, i.e. the draft vocabulary's target ids, differs)."""
    ref = EngineReference(folder, hf(), ENGINES[folder.name], **controls)
    theirs, tokens = reference_logits(ref)
    with torch.no_grad():
        mine = eagle_tree_logits(head, tokens)
    worst = 0.0
    for a, b in zip(mine, theirs, strict=True):
        if not torch.equal(torch.isinf(a), torch.isinf(b)):
            return float("inf")
        finite = torch.isfinite(a)
        worst = max(worst, float((a[finite] - b[finite]).abs().max()))
    return worst


TOLERANCE = 1e-4  # float32, different op order; the negative controls differ by > 1e-1


# ------------------------------------------------------------------------------------ agreement
CASES = [
    (layout, layers, reduced)
    for layout in ("eagle3", "sglang", "vllm")
    for layers in (None, CUSTOM_LAYERS)
    for reduced in (True, False)
    if not (layout == "eagle3" and layers is not None)  # the official code reads the default layers only
]


@pytest.mark.parametrize(("layout", "layers", "reduced"), CASES,
                         ids=[f"{a}-{'default' if b is None else 'custom'}-{'reduced' if c else 'full'}"
                              for a, b, c in CASES])
def test_engine_reference_matches_eagle_tree(tmp_path, layout, layers, reduced):
    head = make_head(layers, reduced)
    folder = export(head, layout, tmp_path)
    assert compare(head, folder) < TOLERANCE


@pytest.mark.parametrize(("layout", "rope"), [("eagle3", "linear"), ("sglang", "linear"), ("vllm", "linear"),
                                              ("sglang", "llama3"), ("vllm", "llama3")])
def test_engine_reference_matches_with_scaled_rope(tmp_path, layout, rope):
    head = make_head(CUSTOM_LAYERS if layout != "eagle3" else None, rope=rope)
    folder = export(head, layout, tmp_path)
    assert compare(head, folder) < TOLERANCE


@pytest.mark.parametrize("rope", ["linear", "llama3"])
def test_reference_catches_rope_scaling_ignored(tmp_path, rope):
    head = make_head(CUSTOM_LAYERS, rope=rope)
    folder = export(head, "vllm", tmp_path)
    assert compare(head, folder, ignore_rope_scaling=True) > 1e-2


def test_norm_before_residual_heads_match_the_vllm_forward(tmp_path):
    head = make_head(CUSTOM_LAYERS, norm_before_residual=True)
    folder = export(head, "vllm", tmp_path)
    assert json.loads((folder / "config.json").read_text())["norm_before_residual"] is True
    assert compare(head, folder) < TOLERANCE
    loaded = Eagle3DraftModel.from_pretrained(folder, target=target(CUSTOM_LAYERS))
    assert loaded.config.norm_before_residual and compare(loaded, folder) < TOLERANCE
    loaded.save_pretrained(tmp_path / "own")  # eagle-tree's own format keeps the variant
    again = Eagle3DraftModel.from_pretrained(tmp_path / "own", target=target(CUSTOM_LAYERS))
    assert again.config == head.config and compare(again, folder) < TOLERANCE
    plain = copy.deepcopy(head)  # negative control: the same weights with the residual before the norm
    plain.midlayer.norm_before_residual = False
    assert compare(plain, folder) > 1e-2
    for layout in ("sglang", "eagle3"):  # their layers take the residual before hidden_norm
        with pytest.raises(ValueError, match="norm_before_residual.*--to vllm"):
            export_head(head, tmp_path / layout, layout, target_config=hf().config)


@pytest.mark.parametrize("variant", ["norm_before_fc", "fc_norm"])
@pytest.mark.filterwarnings("ignore:vLLM 0.11.0")
def test_feature_norm_heads_match_the_speculators_forward(tmp_path, variant):
    """The speculators variants that normalise the target features before fc: one norm over the
    concatenation (norm_before_fc, weight input_norm) or one per layer (fc_norm, weights fc_norm.0-2)."""
    head = make_head(CUSTOM_LAYERS, **{variant: True})
    with pytest.warns(UserWarning, match="vLLM 0.11.x has no input_norm / fc_norm"):
        folder = export_head(head, tmp_path / "vllm", "vllm", target_config=hf().config)
    assert json.loads((folder / "config.json").read_text())[variant] is True
    assert compare(head, folder) < TOLERANCE
    assert compare(head, folder, skip_feature_norms=True) > 1e-2  # negative control: the norms ignored
    loaded = Eagle3DraftModel.from_pretrained(folder, target=target(CUSTOM_LAYERS))
    assert loaded.config == head.config and compare(loaded, folder) < TOLERANCE
    for layout in ("sglang", "eagle3"):
        with pytest.raises(ValueError, match=f"normalises the target features before fc .*{variant}.*--to vllm"):
            export_head(head, tmp_path / layout, layout, target_config=hf().config)


def test_official_layout_refuses_rope_it_cannot_read(tmp_path):
    head = make_head(rope="llama3")
    with pytest.raises(ValueError, match=r"official EAGLE code reads rope_scaling only as .*llama3"):
        export_head(head, tmp_path / "e", "eagle3", target_config=hf().config)
    assert not (tmp_path / "e").exists()


# ------------------------------------------------------------------------------------ negative controls
@pytest.mark.parametrize("layout", ["sglang", "vllm"])
@pytest.mark.parametrize("control", ["swap_norms", "d2t_absolute", "hidden_first"])
def test_reference_catches_a_broken_engine_forward(tmp_path, layout, control):
    head = make_head(CUSTOM_LAYERS, reduced=True)
    folder = export(head, layout, tmp_path)
    assert compare(head, folder) < TOLERANCE
    assert compare(head, folder, **{control: True}) > 1e-2


def test_reference_catches_sglang_ids_read_without_the_offset(tmp_path):
    head = make_head(CUSTOM_LAYERS)
    folder = export(head, "sglang", tmp_path)
    assert compare(head, folder, sglang_ids_without_offset=True) > 1e-2


def test_reference_catches_a_head_on_other_layers(tmp_path):
    """An export whose recorded layers differ from the ones the head was trained on drafts differently."""
    head = make_head(CUSTOM_LAYERS)
    folder = export(head, "vllm", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (folder / "config.json").write_text(json.dumps(config))
    assert compare(head, folder) > 1e-2
