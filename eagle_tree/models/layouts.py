"""Draft heads in the layouts that serving engines load: pure config and state-dict transforms (detect,
read, write a layout's config and weights, validate); :mod:`eagle_tree.models.export` writes the files.

Layouts (``docs/INTEROP.md`` says which engine versions they were written for and what is assumed):

* ``eagle3``: the official EAGLE-3 checkpoint layout. ``config.json`` is a one-layer Llama config
  (transformers 4.x keys) with ``architectures = ["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size``,
  as the official code reads it: no ``target_hidden_size`` (with it, that code skips loading the
  target's embedding), ``rope_scaling`` only as ``{type: linear|dynamic, factor}``, head_dim equal to
  hidden_size / heads; ``model.safetensors`` holds ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
  ``d2t``, ``t2d``. The official code always captures the default feature layers, so heads on
  other layers are refused for this layout.
* ``sglang``: the same files, the layout SGLang's ``LlamaForCausalLMEagle3`` loads; heads on
  non-default feature layers also get ``eagle_config.eagle_aux_hidden_state_layer_ids``.
* ``vllm``: the vLLM speculators layout (``Eagle3SpeculatorConfig``): ``speculators_model_type``,
  the nested ``transformer_layer_config``, ``speculators_config`` (algorithm, proposal methods,
  verifier), ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual`` and, when set,
  ``norm_before_fc`` / ``fc_norm``; weights keyed ``layers.0.*`` instead of ``midlayer.*``. The
  only layout for heads with those variants.

Feature layers are where an export most often goes silently wrong ("zero acceptance"). eagle-tree's
``feature_layers`` are the target layers whose *input* hidden states are fused, strictly ascending,
each in [1, L - 1] (:func:`eagle_tree.models.head_config.check_feature_layers` says why). vLLM
captures the input of layer ``i`` for each id ``i``, so its ids equal ``feature_layers``; SGLang
captures the input of layer ``i + 1`` for each id ``i`` in ``eagle_config`` (the id names the layer
whose *output* is taken), so its ids are ``feature_layers - 1``. Engines use the layers
``(2, L // 2, L - 3)`` (:func:`engine_default_layers`) when no ids are given, so heads on exactly
those layers are written without ids in the EAGLE-3 / SGLang layout and read the same way by every
engine. Each export is validated before anything is written, then written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_tree.models.head_config import (
    ARCHITECTURE,
    CONFIG_NAME,
    DEFAULT_ROPE_THETA,
    WEIGHTS_NAME,
    Eagle3Config,
    HeadFormatError,
    check_feature_layers,
    check_head_matches_target,
    check_vocab_maps,
    text_config,
)

__all__ = [
    "LAYOUTS",
    "engine_default_layers",
    "detect_layout",
    "read_config",
    "read_head",
    "layout_config",
    "layout_state",
    "expected_shapes",
    "engine_feature_layers",
    "validate_layout",
]

LAYOUTS = ("eagle3", "sglang", "vllm")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.3.0"  # the Eagle3SpeculatorConfig schema these configs follow
UNSUPPORTED_FLAGS = ("attention_bias", "mlp_bias", "bias", "tie_word_embeddings")


def engine_default_layers(num_layers: int) -> tuple[int, ...]:
    """The layers vLLM, SGLang and the official EAGLE code capture when a config names none: the inputs
    of layers 2, L // 2 and L - 3, each once, in layer order (fewer than three on targets below 7 layers)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


# --------------------------------------------------------------------------------------------- reading
def detect_layout(d: dict) -> str:
    """``"vllm"`` (speculators config), ``"eagle-tree"`` (our own save format) or ``"eagle3"``."""
    if "speculators_model_type" in d:
        return "vllm"
    return "eagle-tree" if "feature_layers" in d else "eagle3"


def read_config(d: dict, target_num_layers: int | None = None) -> Eagle3Config:
    """An :class:`Eagle3Config` from any config layout above, or eagle-tree's own.

    ``target_num_layers`` (the target's layer count) is used only when the config names no feature
    layers, as in the official EAGLE-3 repository's configs: then the engines' default layers are
    assumed, and the head's ``target_num_layers`` stays unknown (-1).
    """
    if "speculators_model_type" in d:
        return _read_speculators(d, target_num_layers)
    return _read_llama_style(d, target_num_layers)


def _read_llama_style(d: dict, target_num_layers: int | None) -> Eagle3Config:
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in d]
    if missing:
        raise ValueError(f"config.json is not an EAGLE-3 head config: missing {missing}")
    _refuse_variants(d, "config.json")
    ours = d.get("eagle_tree") or {}
    aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if d.get("feature_layers") is not None:  # eagle-tree's own save format
        layers = d["feature_layers"]
    elif ours.get("feature_layers") is not None:  # written by this module
        layers = ours["feature_layers"]
    elif aux is not None:  # SGLang / SpecForge: the id names the layer whose output is captured
        layers = [int(i) + 1 for i in aux]
    else:  # a flattened vLLM config: ids are the layers whose input is captured
        layers = d.get("eagle_aux_hidden_state_layer_ids")
    if d.get("norm_output", True) is not True:  # SpecForge: whether the final norm precedes lm_head
        raise ValueError("config.json: norm_output=false (SpecForge: lm_head reads the output without the final "
                         "norm), a variant eagle-tree's head does not compute")
    return _config(d, d, layers, d.get("target_num_layers", ours.get("target_num_layers")), target_num_layers, d)


def _read_speculators(d: dict, target_num_layers: int | None) -> Eagle3Config:
    kind = d.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(f"this is a speculators '{kind}' model, not an EAGLE-3 head (speculators_model_type='eagle3')")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("the speculators config has no transformer_layer_config dict")
    if "norm_before_residual" not in d:
        raise ValueError(
            "the speculators config does not say norm_before_residual: vLLM then assumes true and "
            "speculators false, so the head's residual stream is ambiguous; add the key"
        )
    if d.get("norm_output"):
        raise ValueError("the speculators config sets norm_output (the final-normalised output is fed back as the "
                         "next step's feature), a variant eagle-tree's drafting does not compute")
    _refuse_variants(d, "the speculators config")
    _refuse_variants(layer, "transformer_layer_config")
    ours = d.get("eagle_tree") or {}
    top = {**d, "hidden_size": layer.get("hidden_size")}
    return _config(layer, top, d.get("eagle_aux_hidden_state_layer_ids"), ours.get("target_num_layers"),
                   target_num_layers, d)


def _refuse_variants(d: dict, where: str) -> None:
    layers = d.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{where}: num_hidden_layers={layers}; eagle-tree heads have exactly one decoder layer")
    flags = [k for k in UNSUPPORTED_FLAGS if d.get(k)]
    if flags:
        raise ValueError(f"{where}: unsupported EAGLE-3 variant, {flags} set (eagle-tree heads have no biases "
                         "and their own lm_head)")


def _config(layer: dict, top: dict, layers, n_target, target_num_layers: int | None, variants: dict) -> Eagle3Config:
    """layer: the decoder layer's Llama fields; top: draft_vocab_size, target_hidden_size; variants: the
    dict holding norm_before_residual, norm_before_fc and fc_norm."""
    n_target = None if n_target in (None, -1) else int(n_target)
    if layers is None:
        if n_target is None and target_num_layers is None:
            raise ValueError(
                "the head config names no feature layers (official EAGLE-3 style: the engines' default "
                "layers 2, L//2, L-3 are meant), so the target's layer count is needed: load it with "
                "from_pretrained(path, target=...) or export it with --target"
            )
        n = n_target if n_target is not None else target_num_layers
        layers = engine_default_layers(n)
        if len(layers) != 3:
            raise ValueError(f"the head config names no feature layers, and on a {n}-layer target the engines' "
                             f"default layers (2, L//2, L-3) are only {list(layers)}: such a head cannot be "
                             "served; name its layers in the config")
    heads = layer["num_attention_heads"]
    return Eagle3Config(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer.get("intermediate_size", 4 * layer["hidden_size"]),
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=top.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=top.get("target_hidden_size") or top["hidden_size"],
        target_num_layers=n_target if n_target is not None else -1,
        feature_layers=tuple(layers),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        rope_parameters=_rope(layer),
        hidden_act=layer.get("hidden_act", "silu"),
        norm_before_residual=bool(variants.get("norm_before_residual", False)),
        norm_before_fc=bool(variants.get("norm_before_fc", False)),
        fc_norm=bool(variants.get("fc_norm", False)),
    )


def _rope(d: dict) -> dict:
    """transformers 5 ``rope_parameters``, or the 4.x ``rope_theta`` + ``rope_scaling`` (theta 10000
    when absent, as transformers 4.x and the engines assume)."""
    if d.get("rope_parameters") is not None:
        rope = dict(d["rope_parameters"])
    else:
        rope = dict(d.get("rope_scaling") or {})
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        rope["rope_theta"] = d.get("rope_theta", DEFAULT_ROPE_THETA)
    rope.setdefault("rope_type", "default")
    theta = rope.get("rope_theta", DEFAULT_ROPE_THETA)
    rope["rope_theta"] = float(theta) if isinstance(theta, int | float) and not isinstance(theta, bool) else theta
    return rope


def read_head(path: str | Path, target_num_layers: int | None = None) -> tuple[Eagle3Config, dict]:
    """(config, EAGLE-3-keyed state dict) of a head folder in any layout :func:`read_config` knows."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} holds no {CONFIG_NAME}; is this an EAGLE-3 head folder?")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise HeadFormatError(f"{cfg_file} is not valid JSON ({exc}); export or download the head again") from exc
    except UnicodeDecodeError as exc:
        raise HeadFormatError(f"{cfg_file} is not UTF-8 text ({exc.reason}); is it a head's config.json?") from exc
    if not isinstance(raw, dict):
        raise HeadFormatError(f"{cfg_file} holds a JSON {type(raw).__name__}, not a head config (an object)")
    try:
        cfg = read_config(raw, target_num_layers=target_num_layers)
    except KeyError as exc:
        raise HeadFormatError(f"{cfg_file}: the head config lacks the key {exc}") from exc
    except (ValueError, TypeError) as exc:
        raise HeadFormatError(f"{cfg_file}: {exc}") from exc
    weights = path / WEIGHTS_NAME
    if weights.is_file():
        try:
            state = load_file(str(weights))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{weights} is truncated or corrupt ({exc}); export or download the head again") from exc
    elif (path / "pytorch_model.bin").is_file():
        from eagle_tree.utils.statefile import read_state

        state = read_state(path / "pytorch_model.bin", "head weights file",
                           fix="convert the head to model.safetensors or download it again")
    else:
        raise FileNotFoundError(f"{path} holds no {WEIGHTS_NAME} (or pytorch_model.bin)")
    renamed = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        if key.startswith("layers."):  # speculators / vLLM naming of the single decoder layer
            if not key.startswith("layers.0."):
                raise ValueError(f"weight {key}: eagle-tree heads have exactly one decoder layer")
            key = "midlayer." + key.removeprefix("layers.0.")
        renamed[key] = value
    return cfg, renamed


# --------------------------------------------------------------------------------------------- writing
def _llama_fields(cfg: Eagle3Config) -> dict:
    """The single decoder layer as a Llama config, in transformers 4.x keys (5.x reads them too)."""
    rope = dict(cfg.rope_parameters)
    theta = float(rope.pop("rope_theta", DEFAULT_ROPE_THETA))
    scaling = None if rope.get("rope_type", "default") == "default" and set(rope) <= {"rope_type"} else rope
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


OFFICIAL_ROPE_SCALING = ("linear", "dynamic")  # what the official EAGLE code's EConfig accepts


def _official_fields(cfg: Eagle3Config) -> dict:
    """The Llama fields as the official EAGLE-3 code reads them, or a ValueError naming what it cannot."""
    fields = _llama_fields(cfg)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(f"the official EAGLE code derives head_dim as hidden_size / num_attention_heads = "
                         f"{cfg.hidden_size // cfg.num_attention_heads}, but this head's head_dim is {cfg.head_dim}: "
                         "export with --to sglang or --to vllm")
    scaling = fields["rope_scaling"]
    if scaling is not None:  # EConfig accepts exactly {"type": linear|dynamic, "factor": float > 1}
        kind = scaling.get("rope_type", scaling.get("type"))
        extra = sorted(set(scaling) - {"rope_type", "type", "factor"})
        if kind not in OFFICIAL_ROPE_SCALING or extra or not float(scaling.get("factor", 0)) > 1:
            raise ValueError(f"the official EAGLE code reads rope_scaling only as {{type: linear|dynamic, factor > 1}} "
                             f"and this head's rope is {dict(scaling)}: export with --to sglang or --to vllm")
        fields["rope_scaling"] = {"type": kind, "factor": float(scaling["factor"])}
    return fields


def _uses_default_layers(cfg: Eagle3Config, num_layers: int | None) -> bool | None:
    """Whether the engines' default layers are the head's; None when the layer count is unknown."""
    if num_layers is None or num_layers < 0:
        return None
    return tuple(cfg.feature_layers) == engine_default_layers(num_layers)


def layout_config(
    cfg: Eagle3Config,
    layout: str,
    *,
    num_layers: int | None = None,
    verifier: str | None = None,
    verifier_architectures: list[str] | None = None,
    speculative_tokens: int = 3,
    dtype: str = "float32",
) -> dict:
    """config.json of ``layout`` for a head. num_layers: the target's layer count (default: the
    head's own record of it); verifier, verifier_architectures, speculative_tokens: vLLM only.
    Raises ValueError when the layout's engine cannot run the head as it is."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    num_layers = cfg.target_num_layers if num_layers is None else num_layers
    check_feature_layers(cfg.feature_layers, num_layers)
    ours = {"feature_layers": list(cfg.feature_layers), "target_num_layers": cfg.target_num_layers}
    common = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
              "torch_dtype": dtype}
    if layout == "vllm":
        if speculative_tokens < 1:
            raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
        proposal = {"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1, "accept_tolerance": 0.0}
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": _llama_fields(cfg),
            **common,
            "norm_before_residual": cfg.norm_before_residual,
            **{k: True for k in ("norm_before_fc", "fc_norm") if getattr(cfg, k)},
            "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [proposal],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
            },
            "eagle_tree": ours,
        }
    engine = "SGLang" if layout == "sglang" else "official EAGLE"
    if cfg.norm_before_residual:
        raise ValueError(f"this head takes its residual after hidden_norm (norm_before_residual), which the "
                         f"{engine} layer does not do: export with --to vllm")
    if cfg.norm_before_fc or cfg.fc_norm:
        raise ValueError(f"this head normalises the target features before fc "
                         f"({'norm_before_fc' if cfg.norm_before_fc else 'fc_norm'}), which the {engine} code "
                         "does not: export with --to vllm")
    default = _uses_default_layers(cfg, num_layers)
    if layout == "eagle3":
        if not default:
            why = ("the target's layer count is unknown (pass --target)" if default is None else
                   f"they are not the layers {list(engine_default_layers(num_layers))} (2, L//2, L-3) it captures "
                   f"on a {num_layers}-layer target")
            raise ValueError(
                f"the official EAGLE code always captures the default feature layers, but this head reads "
                f"{list(cfg.feature_layers)} and {why}: export with --to sglang or --to vllm, which record the layers"
            )
        # no target_hidden_size: with that key the official code skips loading the target's embedding
        # (and loads with strict=False), so the draft would run on a random embedding
        common.pop("target_hidden_size")
        return {"architectures": [ARCHITECTURE], **_official_fields(cfg), **common, "eagle_tree": ours}
    config = {"architectures": [ARCHITECTURE], **_llama_fields(cfg), **common}
    if not default:  # SGLang ids name the layer whose output is captured
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.feature_layers],
                                  "use_aux_hidden_state": True}
    config["eagle_tree"] = ours
    return config


def layout_state(state: dict, layout: str, dtype: torch.dtype | None = None) -> dict:
    """An EAGLE-3-keyed state dict (a head's ``state_dict()`` or :func:`read_head`'s) under ``layout``'s
    key names, floating weights cast to ``dtype``; no token embedding (engines share the target's)."""
    out = {}
    for key, value in state.items():
        if key == "embed_tokens.weight":
            continue
        value = value.detach().to("cpu", copy=True).contiguous()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        if key in ("d2t", "t2d"):  # some exporters write int32 / uint8 maps
            value = value.long() if key == "d2t" else value.bool()
        if layout == "vllm" and key.startswith("midlayer."):
            key = "layers.0." + key.removeprefix("midlayer.")
        out[key] = value
    return out


def expected_shapes(cfg: Eagle3Config, layout: str = "eagle3") -> dict[str, tuple[int, ...]]:
    """Every weight a head of this config must hold, with its shape, under ``layout``'s key names."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = {
        "input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
        "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    prefix = "layers.0." if layout == "vllm" else "midlayer."
    th = cfg.target_hidden_size
    feature_norms = {"input_norm.weight": (3 * th,)} if cfg.norm_before_fc else {}
    if cfg.fc_norm:
        feature_norms = {f"fc_norm.{i}.weight": (th,) for i in range(3)}
    return {
        **feature_norms,
        "fc.weight": (h, 3 * th),
        **{prefix + k: v for k, v in layer.items()},
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def engine_feature_layers(layout: str, config: dict, num_layers: int | None) -> tuple[int, ...] | None:
    """The target layers (by input, eagle-tree's convention) whose hidden states the engine that
    reads ``layout`` will capture for this config; None when that needs the unknown layer count."""
    if layout == "vllm":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return tuple(ids)
    elif layout == "sglang":
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return tuple(i + 1 for i in ids)
    return None if num_layers is None or num_layers < 0 else engine_default_layers(num_layers)


def validate_layout(layout: str, config: dict, state: dict, target_config=None) -> Eagle3Config:
    """Check a layout before it is written; return the config as read back. Raises ValueError
    naming the problem: unreadable config, missing / unexpected weights, wrong shapes, d2t / t2d
    disagreeing, engine-side feature layers differing from the head's, or a head / target mismatch."""
    num_layers = None
    if target_config is not None:
        num_layers = text_config(target_config).num_hidden_layers
    cfg = read_config(config, target_num_layers=num_layers)
    shapes = expected_shapes(cfg, layout)
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{layout} export is incomplete: missing weights {missing}, unexpected weights {unexpected}")
    wrong = [f"{k} {tuple(state[k].shape)} (config implies {s})" for k, s in shapes.items()
             if tuple(state[k].shape) != s]
    if wrong:
        raise ValueError(f"{layout} export has weights of the wrong shape: {'; '.join(wrong)}")
    if state["d2t"].dtype != torch.int64 or state["t2d"].dtype != torch.bool:
        raise ValueError(f"d2t must be int64 and t2d bool, got {state['d2t'].dtype} and {state['t2d'].dtype}")
    check_vocab_maps(state["d2t"], state["t2d"], cfg)
    known = num_layers if num_layers is not None else cfg.target_num_layers
    seen = engine_feature_layers(layout, config, known)
    if seen is not None and seen != tuple(cfg.feature_layers):
        raise ValueError(f"an engine reading this {layout} config would capture layers {list(seen)}, "
                         f"but the head was trained on {list(cfg.feature_layers)}")
    if target_config is not None:
        check_head_matches_target(cfg, text_config(target_config))
    return cfg
