"""The EAGLE-3 draft head and its checkpoint format.

One decoder layer reads, at position ``j``, the fused target feature ``fc([f_low; f_mid; f_high])``
(or, when drafting deeper, the head's own output feature of the previous step) together with the
embedding of the next token ``x_{j+1}``; each is RMS-normalised and the two are concatenated (2H)
as the attention input, with the feature as the residual stream. A final norm and a head over a
reduced draft vocabulary give the logits for ``x_{j+2}``; ``d2t`` maps draft ids to target ids
(``target = draft + d2t[draft]``) and ``t2d`` marks the target ids that the draft vocabulary holds.

Weights follow the public EAGLE-3 checkpoint layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d``); the token embedding is the target's own (frozen) and is not saved: it is bound
from the target with :meth:`Eagle3DraftModel.bind_target`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eagle_tree.models.target import default_feature_layers
from eagle_tree.utils.atomic import atomic_dir

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 head and of the target it belongs to."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    feature_layers: tuple[int, int, int]  # hidden states entering these target layers
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        if len(self.feature_layers) != 3:
            raise ValueError(f"an EAGLE-3 head fuses exactly 3 target layers, got {self.feature_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must lie in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )

    def llama_config(self) -> LlamaConfig:
        """The Llama config of the single decoder layer (rope, norms, MLP)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            hidden_act=self.hidden_act,
        )

    def to_json_dict(self) -> dict:
        """The config.json of the EAGLE-3 layout (a Llama config with the EAGLE-3 fields)."""
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            **d,
        }

    @classmethod
    def from_json_dict(cls, d: dict, target_num_layers: int | None = None) -> Eagle3Config:
        """Read our config.json, the official EAGLE-3 / SGLang style (a Llama config plus
        ``draft_vocab_size``, optional ``target_hidden_size`` and ``eagle_config``) or a vLLM speculators
        config; see :func:`eagle_tree.models.layouts.read_config` (``target_num_layers`` resolves the default
        feature layers of configs that name none)."""
        from eagle_tree.models.layouts import read_config

        return read_config(d, target_num_layers=target_num_layers)


class Eagle3Attention(nn.Module):
    """Attention over the 2H input; keys and values are returned so callers own the cache."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, 2H) -> q (B, nh, T, hd), k and v (B, nkv, T, hd), rope applied to q and k."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hd), k/v (B, nkv, S, hd), mask (B or 1, 1, T, S) bool (True = visible)."""
        gqa = self.num_heads != self.num_kv_heads  # sdpa shares each key/value head across its query group
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # (B, nh, T, hd)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3DecoderLayer(nn.Module):
    """The single EAGLE-3 layer: norm(embedding) ++ norm(feature) -> attention -> MLP."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        llama = cfg.llama_config()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3DraftModel(nn.Module):
    """EAGLE-3 draft head. ``step`` is the one forward used by drafting and by training."""

    def __init__(self, cfg: Eagle3Config, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())
        if d2t is None:
            d2t, t2d = vocab_maps(torch.arange(cfg.draft_vocab_size), cfg.vocab_size)
        _check_vocab_maps(d2t.long(), t2d.bool(), cfg)  # before d2t is used: a clear error for bad maps
        self.register_buffer("d2t", d2t.long().clone())
        self.register_buffer("t2d", t2d.bool().clone())
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size) + self.d2t, persistent=False)
        # The target's token embedding, frozen; bound from the target, never saved.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self._embedding_bound = False

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_target(
        cls,
        target_model,
        draft_vocab: Sequence[int] | torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        seed: int | None = 0,
    ) -> Eagle3DraftModel:
        """A fresh head for ``target_model`` (a TargetModel or a Hugging Face causal LM).

        draft_vocab: target token ids the head predicts (e.g. the most frequent loss-masked tokens);
        None = the whole target vocabulary. layers: the three feature layers (default 2, L/2, L-3).
        """
        hf = target_model.model if _is_wrapper(target_model) else target_model
        tc = hf.config
        n_layers = tc.num_hidden_layers
        layers = tuple(layers) if layers is not None else getattr(target_model, "feature_layers", None)
        layers = tuple(layers) if layers is not None else default_feature_layers(n_layers)
        for i in layers:
            if not 0 <= i < n_layers:
                raise ValueError(f"feature layer {i} is out of range for a target with {n_layers} layers")
        vocab = tc.vocab_size
        ids = torch.arange(vocab) if draft_vocab is None else torch.as_tensor(draft_vocab).long().unique()
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"draft_vocab must hold target token ids in [0, {vocab}), got {ids.numel()} ids")
        heads = tc.num_attention_heads
        cfg = Eagle3Config(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            vocab_size=vocab,
            draft_vocab_size=int(ids.numel()),
            target_hidden_size=tc.hidden_size,
            target_num_layers=n_layers,
            feature_layers=layers,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
            rope_parameters=dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default"}),
            hidden_act=getattr(tc, "hidden_act", "silu"),
        )
        with torch.random.fork_rng(devices=[]):  # seed the initialisation without touching the caller's RNG
            if seed is not None:
                torch.manual_seed(seed)
            model = cls(cfg, *vocab_maps(ids, vocab))
        model.bind_target(target_model)
        return model.to(dtype=hf.dtype)

    def bind_target(self, target_model) -> Eagle3DraftModel:
        """Check that this head belongs to ``target_model`` and copy its (frozen) token embedding."""
        hf = target_model.model if _is_wrapper(target_model) else target_model
        check_head_matches_target(self.config, hf.config, getattr(target_model, "feature_layers", None))
        emb = hf.get_input_embeddings().weight
        with torch.no_grad():
            self.embed_tokens.weight.copy_(emb.detach().to(self.embed_tokens.weight.dtype))
        self._embedding_bound = True
        return self

    # ----------------------------------------------------------------- forward
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, 3H_target) -> fused feature (B, T, H)."""
        return self.fc(features)

    def project(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """Attention inputs of one step: (q, k, v) for hidden (B, T, H), next-token ids (B, T)."""
        if not self._embedding_bound:
            raise RuntimeError(
                "the head's token embedding is not bound: call draft.bind_target(target) first "
                "(SpeculativeDecoder and the trainer do this for you)"
            )
        x = self.midlayer.attention_input(self.embed_tokens(input_ids).to(hidden.dtype), hidden)
        cos, sin = self.rotary_emb(x, position_ids)
        return self.midlayer.self_attn.project(x, cos, sin)

    def step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_kv: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
    ):
        """One draft step over T new inputs.

        hidden (B, T, H): fused target features or the head's own previous outputs; input_ids (B, T):
        target ids of the next tokens; position_ids (B, T); past_kv: keys/values (B, nkv, S, hd) of
        visible earlier entries or None; mask (B or 1, 1, T, S + T) bool over [past, new].
        Returns (out_hidden (B, T, H), logits (B, T, draft_vocab), (k_new, v_new)).
        """
        q, k, v = self.project(hidden, input_ids, position_ids)
        k_all, v_all = (k, v) if past_kv is None else (torch.cat([past_kv[0], k], 2), torch.cat([past_kv[1], v], 2))
        out = self.midlayer.finish(hidden, self.midlayer.self_attn.attend(q, k_all, v_all, mask))
        return out, self.logits(out), (k, v)

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out_hidden))

    # ----------------------------------------------------------------- checkpoints
    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json and model.safetensors (EAGLE-3 keys) atomically into ``path``."""
        from safetensors.torch import save_file

        with atomic_dir(path) as tmp:
            state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            state.pop("embed_tokens.weight")
            save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(json.dumps(self.config.to_json_dict(), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target=None, dtype: torch.dtype | None = None):
        """Load a head saved by eagle-tree or in the EAGLE-3, SGLang or vLLM speculators layout (see
        :mod:`eagle_tree.models.layouts`); bind it to ``target`` if given. A config that names no feature
        layers (official EAGLE-3 style) gets the default layers of ``target``, which is then required."""
        from eagle_tree.models.layouts import read_head

        layers = None
        if target is not None:
            hf = target.model if _is_wrapper(target) else target
            layers = hf.config.get_text_config(decoder=True).num_hidden_layers
        cfg, state = read_head(path, target_num_layers=layers)
        return cls.from_state_dict(cfg, state, target=target, dtype=dtype)

    @classmethod
    def from_state_dict(cls, cfg: Eagle3Config, state: dict, target=None, dtype=None) -> Eagle3DraftModel:
        """Build a head from an EAGLE-3-keyed state dict (``fc``, ``midlayer.*``, ``norm``, ...)."""
        state = {k.removeprefix("model."): v for k, v in state.items()}
        d2t, t2d = state.get("d2t"), state.get("t2d")
        if (d2t is None) != (t2d is None):
            raise ValueError("the checkpoint holds only one of d2t / t2d; both or neither are needed")
        model = cls(cfg, d2t, t2d)
        expected = set(model.state_dict()) - {"embed_tokens.weight"}
        embed = state.pop("embed_tokens.weight", None)
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                "the checkpoint does not have the EAGLE-3 layout: "
                f"missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
            )
        for k, v in model.state_dict().items():
            if k in state and tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(f"weight {k} has shape {tuple(state[k].shape)}, the config implies {tuple(v.shape)}")
        model.load_state_dict(state, strict=False)
        if embed is not None:
            model.embed_tokens.weight.data.copy_(embed)
            model._embedding_bound = True
        if dtype is not None:
            model = model.to(dtype)
        if target is not None:
            model.bind_target(target)
        return model.eval()


# --------------------------------------------------------------------- vocabulary maps and checks
def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted target ids of the draft vocabulary -> (d2t offsets (Vd,), t2d mask (V,))."""
    ids = torch.as_tensor(draft_ids).long().sort().values
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, cfg: Eagle3Config) -> None:
    if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
        raise ValueError(
            f"d2t must have shape ({cfg.draft_vocab_size},) and t2d ({cfg.vocab_size},), "
            f"got {tuple(d2t.shape)} and {tuple(t2d.shape)}"
        )
    target_ids = torch.arange(cfg.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[target_ids].all()):
        raise ValueError("d2t and t2d disagree: t2d must mark exactly the target ids that d2t maps to")


def _is_wrapper(obj) -> bool:
    from eagle_tree.models.target import TargetModel

    return isinstance(obj, TargetModel)


def check_head_matches_target(cfg: Eagle3Config, target_config, target_layers=None) -> None:
    """Refuse a head whose shapes, vocabulary, feature layers or rope settings differ from the target's."""
    problems = []
    if cfg.target_hidden_size != target_config.hidden_size:
        problems.append(f"target hidden size {cfg.target_hidden_size} vs the target's {target_config.hidden_size}")
    if cfg.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} vs the target embedding size {target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs the target's {target_config.vocab_size}")
    n_layers = target_config.num_hidden_layers
    if cfg.target_num_layers not in (-1, n_layers):
        problems.append(f"trained on a target of {cfg.target_num_layers} layers, this target has {n_layers}")
    bad = [i for i in cfg.feature_layers if not 0 <= i < n_layers]
    if bad:
        problems.append(f"feature layers {list(cfg.feature_layers)} out of range for {n_layers} layers")
    if target_layers is not None and tuple(target_layers) != tuple(cfg.feature_layers):
        problems.append(f"feature layers {list(cfg.feature_layers)} vs the target wrapper's {list(target_layers)}")
    rope = getattr(target_config, "rope_parameters", None)
    if rope is None and getattr(target_config, "rope_theta", None) is not None:  # transformers 4.x config
        rope = {**(getattr(target_config, "rope_scaling", None) or {}), "rope_theta": target_config.rope_theta}
    if rope is not None and cfg.rope_parameters:
        for key in sorted(set(rope) & set(cfg.rope_parameters)):  # type, theta and the scaling fields
            mine, theirs = cfg.rope_parameters[key], rope[key]
            if not isinstance(theirs, dict) and mine != theirs:  # dict: per-layer-type rope, not compared
                problems.append(f"rope {key} {mine} vs the target's {theirs}")
    if problems:
        raise ValueError("this draft head does not belong to this target: " + "; ".join(problems))


__all__ = [
    "Eagle3Config",
    "Eagle3DraftModel",
    "check_head_matches_target",
    "default_feature_layers",
    "vocab_maps",
]
