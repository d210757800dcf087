"""The EAGLE-3 head's configuration, file names, vocabulary maps and the checks of a head against a
target: plain data and functions shared by the head module, the layout readers and writers, and the
export.

``Eagle3Config`` describes the single decoder layer and the target it belongs to; ``vocab_maps``
builds the reduced draft vocabulary's maps (``target = draft + d2t[draft]``, ``t2d`` marking the
target ids the draft vocabulary holds).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from transformers import LlamaConfig

from eagle_tree.utils.checks import InputError

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_ROPE_THETA = 10000.0  # what transformers 4.x, the EAGLE trainers and the engines use when a config names none
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings")


class HeadFormatError(InputError):
    """A head folder that cannot be loaded (config values, weights, layout, or a target it does not fit);
    the message names the file and what to change."""


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice, the hidden states entering layers 2, L // 2 and L - 3, whenever those are
    three distinct layers (L >= 7); smaller targets get the nearest three distinct ascending layers in
    [1, L - 1] ((1, 2, 3) for L = 4, (2, 3, 4) for L = 5 and 6). Fewer than 4 layers are refused."""
    if num_layers < 4:
        raise ValueError(f"the default feature layers need a target with at least 4 layers (three distinct "
                         f"layers in [1, L - 1]); this one has {num_layers} decoder layers: pass feature_layers")
    low = min(2, num_layers - 3)
    high = max(num_layers - 3, low + 2)
    return (low, min(max(num_layers // 2, low + 1), high - 1), high)


def check_feature_layers(layers, num_layers: int | None = None) -> tuple[int, int, int]:
    """The three feature layers as a tuple, refused unless an engine can capture them as the head reads
    them: strictly ascending, each >= 1 and < ``num_layers`` (the target's layer count; -1 or None =
    unknown). Engines capture the input of each chosen layer once, in layer order, and concatenate."""
    import operator

    try:
        layers = tuple(operator.index(i) for i in layers)
    except TypeError:
        raise ValueError(f"feature layers must be 3 integers, got {layers!r}") from None
    if len(layers) != 3:
        raise ValueError(f"an EAGLE-3 head fuses exactly 3 target layers, got {list(layers)}")
    if len(set(layers)) != 3:
        raise ValueError(f"feature layers {list(layers)} repeat a layer: engines capture each layer once, so fc "
                         "(input 3 x hidden) would get only the distinct ones; choose 3 distinct layers")
    if list(layers) != sorted(layers):
        raise ValueError(f"feature layers {list(layers)} are not ascending: engines capture the layers in layer "
                         f"order and concatenate them, so fc would read a permuted input; use {sorted(layers)} "
                         "(and train the head on that order)")
    if layers[0] < 1:
        raise ValueError(f"feature layers {list(layers)} include layer {layers[0]}: the input of layer 0 is the "
                         "token embedding, which no engine captures (it has no residual yet); use layers >= 1")
    if num_layers is not None and num_layers >= 0 and layers[-1] >= num_layers:
        raise ValueError(f"feature layers {list(layers)} are out of range for a target with {num_layers} layers "
                         f"(valid: 1 to {num_layers - 1})")
    return layers  # type: ignore[return-value]


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
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA})
    hidden_act: str = "silu"
    norm_before_residual: bool = False  # residual stream taken after hidden_norm (a speculators / vLLM variant)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc (speculators >= 0.5)
    fc_norm: bool = False  # an RMSNorm on each of the three features before fc (speculators >= 0.7, SpecForge)

    def __post_init__(self) -> None:
        self._check_types()
        self.feature_layers = check_feature_layers(self.feature_layers, self.target_num_layers)
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are exclusive (both would normalise the features twice)")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must lie in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )

    def _check_types(self) -> None:
        """Sizes are integers >= 1, eps a finite number > 0, the activation one transformers knows."""
        from transformers.activations import ACT2FN

        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        n = self.target_num_layers
        if isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1):
            raise ValueError(f"target_num_layers must be an integer >= 1 (or -1: unknown), got {n!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise ValueError(f"rms_norm_eps must be a finite number > 0, got {eps!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not an activation transformers knows "
                             "(silu for Llama heads)")
        theta = self.rope_parameters.get("rope_theta") if isinstance(self.rope_parameters, dict) else None
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not 0 < theta < math.inf:
            raise ValueError(f"rope_parameters.rope_theta must be a finite number > 0, got {theta!r}")
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")

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


# --------------------------------------------------------------------- vocabulary maps and checks
def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted target ids of the draft vocabulary -> (d2t offsets (Vd,), t2d mask (V,))."""
    ids = torch.as_tensor(draft_ids).long().sort().values
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, cfg: Eagle3Config) -> None:
    """Refuse d2t / t2d maps of the wrong shape, mapping outside the target vocabulary or disagreeing."""
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


def check_head_matches_target(cfg: Eagle3Config, target_config, target_layers=None) -> None:
    """Refuse a head whose shapes, vocabulary or feature layers differ from the target's. The rope
    settings are not compared: the draft layer's rope is the head's own (published Llama-3.1 heads use
    theta 10000 on targets with 500000, and the engines run them so)."""
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
    if problems:
        raise ValueError("this draft head does not belong to this target: " + "; ".join(problems))


def text_config(config):
    """The decoder's config of a (possibly multimodal) Hugging Face config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


__all__ = [
    "ARCHITECTURE",
    "HeadFormatError",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "DEFAULT_ROPE_THETA",
    "Eagle3Config",
    "check_feature_layers",
    "default_feature_layers",
    "check_head_matches_target",
    "check_vocab_maps",
    "text_config",
    "vocab_maps",
]
