"""The EAGLE-3 draft head and its checkpoint format.

One decoder layer reads, at position ``j``, the fused target feature ``fc([f_low; f_mid; f_high])``
(or, when drafting deeper, the head's own output feature of the previous step) together with the
embedding of the next token ``x_{j+1}``; each is RMS-normalised and the two are concatenated (2H)
as the attention input, with the feature as the residual stream (its ``hidden_norm`` for
``norm_before_residual`` heads, a speculators / vLLM variant). A final norm and a head over a
reduced draft vocabulary give the logits for ``x_{j+2}``; ``d2t`` maps draft ids to target ids
(``target = draft + d2t[draft]``) and ``t2d`` marks the target ids that the draft vocabulary holds.

Weights follow the public EAGLE-3 checkpoint layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d``); the token embedding is the target's own (frozen) and is not saved: it is bound
from the target with :meth:`Eagle3DraftModel.bind_target`. The config, vocabulary maps and checks
are in :mod:`eagle_tree.models.head_config`, the engine layouts in :mod:`eagle_tree.models.layouts`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eagle_tree.models.cache import AttentionCache
from eagle_tree.models.head_config import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    Eagle3Config,
    HeadFormatError,
    check_head_matches_target,
    check_vocab_maps,
    default_feature_layers,
    text_config,
    vocab_maps,
)
from eagle_tree.models.head_init import INIT_PARTS, init_from_target
from eagle_tree.models.layouts import read_head
from eagle_tree.models.target import TargetModel
from eagle_tree.utils.atomic import atomic_dir


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

    def attend_diagonal(
        self,
        q: torch.Tensor,
        k0: torch.Tensor,
        v0: torch.Tensor,
        diag_k: Sequence[torch.Tensor],
        diag_v: Sequence[torch.Tensor],
        valid_keys: torch.Tensor,
    ) -> torch.Tensor:
        """The training-time test's attention at step s, for every position j at once.

        q (B, nh, T, hd); k0/v0 (B, nkv, T, hd): the step-0 entries, seen causally (positions <= j,
        limited to ``valid_keys`` (B, T) bool); diag_k/diag_v: s tensors (B, nkv, T, hd), the entries of
        steps 1..s at the same position j (the diagonal). Equals :meth:`attend` over the committed pairs
        and a node's ancestors in decoding. Returns (B, T, H) after o_proj."""
        groups = self.num_heads // self.num_kv_heads

        def rep(t):
            return t.repeat_interleave(groups, dim=1) if groups > 1 else t

        q = q * (1.0 / self.head_dim**0.5)  # scaled once here, not the (B, nh, T, T) scores
        t = q.shape[2]
        scores = torch.matmul(q, rep(k0).transpose(-1, -2))  # (B, nh, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        visible = causal[None, None] & valid_keys[:, None, None, :]
        scores = scores.masked_fill(~visible, float("-inf"))
        diag = [(q * rep(k)).sum(-1, keepdim=True) for k in diag_k]  # each (B, nh, T, 1)
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        out = torch.matmul(probs[..., :t], rep(v0))
        for i, v in enumerate(diag_v):
            out = out + probs[..., t + i : t + i + 1] * rep(v)
        b = out.shape[0]
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
        self.norm_before_residual = cfg.norm_before_residual

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """hidden: the layer's input feature (B, T, H); the residual stream is that feature, or its
        ``hidden_norm`` for ``norm_before_residual`` heads."""
        hidden = (self.hidden_norm(hidden) if self.norm_before_residual else hidden) + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3DraftModel(nn.Module):
    """EAGLE-3 draft head. ``step`` is the one forward used by drafting and by training."""

    def __init__(self, cfg: Eagle3Config, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        th, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        self.input_norm = LlamaRMSNorm(3 * th, eps=eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(th, eps=eps) for _ in range(3)) if cfg.fc_norm else None
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())
        if d2t is None:
            d2t, t2d = vocab_maps(torch.arange(cfg.draft_vocab_size), cfg.vocab_size)
        check_vocab_maps(d2t.long(), t2d.bool(), cfg)  # before d2t is used: a clear error for bad maps
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
        init: str = "random",
        init_parts: Sequence[str] = INIT_PARTS,
    ) -> Eagle3DraftModel:
        """A fresh head for ``target_model`` (a TargetModel or a Hugging Face causal LM).

        draft_vocab: target token ids the head predicts (e.g. the most frequent loss-masked tokens);
        None = the whole target vocabulary. layers: the three feature layers (default 2, L/2, L-3).
        init: 'random', or 'target' to copy ``init_parts`` of the target's weights where shapes allow
        (see :mod:`eagle_tree.models.head_init`; the parts copied are in ``model.init_report``).
        """
        if init not in ("random", "target"):
            raise ValueError(f"init must be 'random' or 'target', got {init!r}")
        hf = target_model.model if _is_wrapper(target_model) else target_model
        tc = hf.config
        n_layers = tc.num_hidden_layers
        layers = tuple(layers) if layers is not None else getattr(target_model, "feature_layers", None)
        layers = tuple(layers) if layers is not None else default_feature_layers(n_layers)  # checked by the config
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
        model.init_report = init_from_target(model, hf, init_parts) if init == "target" else []
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
        """Target features (B, T, 3H_target) -> fused feature (B, T, H) (normalised first for the
        ``norm_before_fc`` and ``fc_norm`` variants)."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            parts = zip(self.fc_norm, features.chunk(3, -1), strict=True)
            features = torch.cat([norm(part) for norm, part in parts], -1)
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
        cache: AttentionCache,
        mask: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's one forward over T new inputs: embed + norms, attention over ``cache``, MLP, norm,
        logits. Drafting (catch-up, tree levels) and the training-time test both call it.

        hidden (B, T, H): fused target features (:meth:`fuse`) or the head's own previous outputs;
        input_ids (B, T): target ids of the next tokens; position_ids (B, T). cache: an
        :class:`~eagle_tree.models.cache.AttentionCache`, which stores the new keys and values and
        returns the attention's output over what ``mask`` (the visibility it expects) shows: the
        ``DraftCache`` of decoding, the diagonal store of training.
        rows (B, T) bool, optional: the logits of those positions only, as (n, draft_vocab) in row-major
        order (the training-time test's loss positions: the ``lm_head`` is most of the head's cost).
        Returns (out_hidden (B, T, H), logits (B, T, draft_vocab), or (n, draft_vocab) with ``rows``).
        """
        q, k, v = self.project(hidden, input_ids, position_ids)
        out = self.midlayer.finish(hidden, cache.attend(self.midlayer.self_attn, q, k, v, mask))
        return out, self.logits(out if rows is None else out[rows])

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
        layers = None
        if target is not None:
            hf = target.model if _is_wrapper(target) else target
            layers = text_config(hf.config).num_hidden_layers
        try:
            cfg, state = read_head(path, target_num_layers=layers)
            model = cls.from_state_dict(cfg, state, target=target, dtype=dtype)
        except HeadFormatError:
            raise
        except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
            what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise HeadFormatError(f"the head in {path}: {what}") from exc
        model.pretrained_path = str(path)  # its decoding.json, if any, gives the decoder's default shapes
        return model

    @classmethod
    def from_state_dict(cls, cfg: Eagle3Config, state: dict, target=None, dtype=None) -> Eagle3DraftModel:
        """Build a head from an EAGLE-3-keyed state dict (``fc``, ``midlayer.*``, ``norm``, ...)."""
        state = {k.removeprefix("model."): v for k, v in state.items()}
        d2t, t2d = state.get("d2t"), state.get("t2d")
        if (d2t is None) != (t2d is None):
            raise ValueError("the checkpoint holds only one of d2t / t2d; both or neither are needed")
        if d2t is not None and (d2t.dtype.is_floating_point or d2t.dtype == torch.bool or t2d.dtype != torch.bool):
            raise ValueError(f"d2t must hold integers and t2d booleans, got {d2t.dtype} and {t2d.dtype}")
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
            if k in state and v.is_floating_point() and not state[k].is_floating_point():
                raise ValueError(f"weight {k} has dtype {state[k].dtype}; head weights are floating point "
                                 "(float32, bfloat16 or float16): the file was not written as a head")

        model.load_state_dict(state, strict=False)
        if embed is not None:
            model.embed_tokens.weight.data.copy_(embed)
            model._embedding_bound = True
        if dtype is not None:
            model = model.to(dtype)
        if target is not None:
            model.bind_target(target)
        return model.eval()


def _is_wrapper(obj) -> bool:
    return isinstance(obj, TargetModel)


__all__ = ["Eagle3DraftModel"]
