"""Grouped-query attention for tree verification without copying the cache (docs/MEASURING.md,
"Grouped queries").

With grouped-query attention (SmolLM2: 9 query heads, 3 key/value heads) and a custom mask, the
``sdpa`` attention of transformers repeats every key/value head over its query group before calling
``scaled_dot_product_attention`` on CPU (``repeat_kv``): a copy of the whole cache, every layer, every
verification forward, growing with the context. Its one-token path avoids it by moving the group into
the query rows (``pack_gqa``). :func:`grouped_sdpa_attention` does the same for several query tokens
under a mask shared by all heads: the query (B, H, T, D) becomes (B, H_kv, n_rep * T, D), the group's
heads one after another, the mask's T rows repeated once per head of the group, and the keys and
values are used as cached. Each output row is computed from the same query, keys, values and mask row
as before; only the rows that share a kernel call change.

It is registered with transformers as the attention implementation :data:`GROUPED_SDPA` (and the
``sdpa`` mask builder under the same name); every other case (one query token, no mask, a mask per
head, no grouping) goes to transformers' own ``sdpa_attention_forward``. ``TargetModel.from_pretrained``
loads targets with it unless another ``attn_implementation`` is asked for.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

GROUPED_SDPA = "eagle_tree_grouped_sdpa"
"""The attention implementation name of :func:`grouped_sdpa_attention`."""


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query (B, H, T, D), key / value (B, H_kv, S, D),
    attention_mask (B or 1, 1, T, S) additive float or bool, or None. Returns ((B, T, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, t, dim = query.shape
    if (groups <= 1 or t == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or heads != key.shape[1] * groups):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    packed = query.reshape(b, kv_heads, groups * t, dim)  # head h = g * groups + r: rows r * T + t of group g
    mask = attention_mask.repeat(1, 1, groups, 1)  # (B or 1, 1, groups * T, S): row r * T + t is row t
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(out.shape[0], heads, t, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :data:`GROUPED_SDPA` with transformers (attention and mask interfaces); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return GROUPED_SDPA
