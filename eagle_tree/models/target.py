"""The target model: a frozen Hugging Face causal LM with feature capture, tree-masked verification
and KV-cache compaction.

Everything goes through the model's public inputs (``input_ids``, ``position_ids``, a 4D float
``attention_mask`` and a ``cache`` object) plus forward pre-hooks on the decoder layers; no modeling
code is forked per architecture. One path for one request and for B requests of different lengths:
``generate`` is B = 1.

Cache contract (the caller owns the cache; this class never stores one):

* ``new_cache(capacity, requests)`` gives an empty :class:`~eagle_tree.models.cache.TargetCache`:
  keys and values of every layer in buffers (B, n_kv_heads, capacity, head_dim) grown geometrically,
  slot ``s`` holding position ``s``. Sliding-window models get full layers too; the window is applied
  in the masks built here.
* ``prefill`` / ``forward`` / ``verify`` append to it (a slice write for level requests, a scatter
  otherwise); ``TargetCache.compact`` gathers the accepted entries into contiguous positions (one
  gather per layer over the moved entries) and drops the rest. ``verify`` of level requests writes its
  mask into the cache's mask buffer: an additive float mask, measured as fast as a boolean one with
  sdpa on CPU, and the one eager attention needs. Plain decoding of level requests (empty trees)
  passes no mask at all, as Hugging Face ``generate`` does.

Features: the hidden states entering the three feature layers, caught by forward pre-hooks that are
registered for the duration of one forward and removed in a ``finally`` block, so nothing stays
attached to the model between calls and only those three tensors are kept.

Supported models (checked at construction, see ``_check_supported``): the forward takes
``attention_mask``, ``position_ids`` and ``cache`` by name; the attention implementation is
``"eager"``, ``"sdpa"`` or ``GROUPED_SDPA`` (sdpa with the query groups packed instead of the
cache repeated, :mod:`eagle_tree.models.grouped_attention`: the ones that add a custom 4D float mask
as given; flash attention ignores custom masks and flex attention wants a ``BlockMask``); the
decoder layers are reachable as ``model.get_decoder().layers``; and the attention layers are either
all full or all sliding-window with one window size (mixed layer types would need one mask per layer
type).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eagle_tree.core.tree import Tree
from eagle_tree.models.cache import MIN_CAPACITY, TargetCache
from eagle_tree.models.grouped_attention import GROUPED_SDPA
from eagle_tree.models.head_config import check_feature_layers, default_feature_layers

if TYPE_CHECKING:
    from eagle_tree.models.prepack import PrepackSetting


SUPPORTED_ATTENTION = ("eager", "sdpa", GROUPED_SDPA)
REQUIRED_FORWARD_INPUTS = ("attention_mask", "position_ids", "cache")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (B, T, V) float32
    features: torch.Tensor  # (B, T, 3H) hidden states entering the low, mid and high feature layers


def _sliding_window(text_config, num_layers: int) -> int | None:
    """The attention window shared by every layer, None for full attention; mixed types are refused."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:  # Llama / Mistral style: one kind of layer, set by `sliding_window`
        return window
    kinds = set(layer_types[:num_layers])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window is not None:
        return window
    raise ValueError(
        f"unsupported layer types {sorted(kinds)}: TargetModel builds one 4D mask for all layers, so the "
        "attention layers must be all 'full_attention' or all 'sliding_attention' with one window "
        "(e.g. load Qwen2 with use_sliding_window=False)"
    )


def _check_supported(model) -> None:
    """Raise a TypeError / ValueError naming what is missing when the model cannot be driven here."""
    params = inspect.signature(model.forward).parameters
    missing = [name for name in REQUIRED_FORWARD_INPUTS if name not in params]
    if missing:
        raise TypeError(
            f"{type(model).__name__}.forward lacks the inputs {missing}: TargetModel needs a causal LM whose "
            f"forward takes {list(REQUIRED_FORWARD_INPUTS)} by name (transformers >= 5 models do)"
        )
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"cannot find the decoder layers of {type(model).__name__}: expected model.get_decoder().layers "
            "to be a torch.nn.ModuleList"
        )
    impl = getattr(model.config.get_text_config(decoder=True), "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {impl!r} cannot take the custom 4D float attention mask that tree "
            f"verification needs; load the model with attn_implementation='eager', 'sdpa' or {GROUPED_SDPA!r} "
            "(eagle_tree.models.grouped_attention)"
        )


class TargetModel:
    """A frozen causal LM: logits plus fused low/mid/high features for every input position."""

    def __init__(self, model, feature_layers: Sequence[int] | None = None):
        _check_supported(model)
        self.model = model
        self.config = model.config
        self.prepack_choice = None  # from_pretrained(prepack=...): which kernels the linear layers run on
        text_config = model.config.get_text_config(decoder=True)
        self._layers = model.get_decoder().layers
        self.num_layers = len(self._layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.sliding_window = _sliding_window(text_config, self.num_layers)
        positions = getattr(text_config, "max_position_embeddings", None)
        self.max_positions = int(positions) if isinstance(positions, int) and positions > 0 else None
        if feature_layers is None:
            feature_layers = default_feature_layers(self.num_layers)
        self.feature_layers = check_feature_layers(feature_layers, self.num_layers)
        self.embed_tokens = model.get_input_embeddings()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        dtype: torch.dtype = torch.float32,
        feature_layers: Sequence[int] | None = None,
        prepack: PrepackSetting = False,
        prepack_one_row: bool = True,
        **kwargs,
    ) -> TargetModel:
        """Load a hub id, a local folder or a ``.gguf`` file (or a folder with ``gguf_file=NAME``) through
        :func:`eagle_tree.models.gguf.load_causal_lm` (sdpa attention with packed query groups,
        :mod:`eagle_tree.models.grouped_attention`, unless ``attn_implementation`` is given in ``kwargs``,
        e.g. ``device_map``), in eval mode. ``prepack``: CPU float32 linear layers
        get a oneDNN-packed weight for every forward (``prepack_one_row=False``: for forwards of several
        rows only; ``"auto"``: for the row counts where timing at load finds it faster;
        :mod:`eagle_tree.models.prepack`). The choice is kept as ``prepack_choice`` (None: not packed)."""
        from eagle_tree.models.gguf import load_causal_lm
        from eagle_tree.models.grouped_attention import register

        kwargs.setdefault("attn_implementation", register())
        model = load_causal_lm(name_or_path, dtype=dtype, **kwargs)
        choice = None
        if prepack is not False:
            from eagle_tree.models.prepack import apply_prepack

            choice = apply_prepack(model, prepack, one_row=prepack_one_row)
        target = cls(model.eval(), feature_layers=feature_layers)
        target.prepack_choice = choice
        return target

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def __repr__(self) -> str:
        return (
            f"TargetModel({type(self.model).__name__}, layers={self.num_layers}, hidden={self.hidden_size}, "
            f"vocab={self.vocab_size}, feature_layers={self.feature_layers})"
        )

    # ----------------------------------------------------------------------------------------- cache

    def new_cache(self, capacity: int = MIN_CAPACITY, requests: int = 1) -> TargetCache:
        """An empty cache of ``requests`` requests with ``capacity`` entries each (grown geometrically
        when a forward needs more); its buffers are allocated on the first forward."""
        return TargetCache(self.num_layers, requests, capacity)

    # --------------------------------------------------------------------------------------- forward

    @contextmanager
    def _capture_features(self) -> Iterator[dict[int, torch.Tensor]]:
        """Forward pre-hooks on the feature layers, registered for one forward and always removed."""
        captured: dict[int, torch.Tensor] = {}

        def hook_for(index: int):
            def hook(module, args, kwargs):
                captured[index] = args[0] if args else kwargs["hidden_states"]  # (1, T, H)

            return hook

        handles = [
            self._layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True)
            for i in sorted(set(self.feature_layers))
        ]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: TargetCache,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """One forward over ``input_ids`` (B, T), one sequence per request of ``cache``, appending T entries
        to every request (request b's at slots ``lengths[b] + i``).

        ``position_ids`` (B or 1, T) default to ``lengths[b] + arange(T)``. ``attention_mask``: None for
        causal attention (level requests only), or a 4D mask (B or 1, 1, T, past + T) over the buffer up
        to the longest request plus the new entries, float (0 visible, -inf hidden) or bool (True visible).
        """
        b, t = input_ids.shape if input_ids.dim() == 2 else (0, 0)
        if input_ids.dim() != 2 or b != cache.requests:
            raise ValueError(f"input_ids must have shape (B, T) with B = the cache's {cache.requests} request(s), "
                             f"got {tuple(input_ids.shape)}")
        past = cache.get_seq_length()
        if attention_mask is None and not cache.level:
            raise ValueError("requests of different lengths need an attention_mask that hides each one's stale slots")
        input_ids = input_ids.to(self.device)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=self.device)[None]  # (1, T): level requests
        if attention_mask is not None:
            if attention_mask.dim() != 4 or tuple(attention_mask.shape[1:]) != (1, t, past + t) or \
                    attention_mask.shape[0] not in (1, b):
                raise ValueError(
                    f"attention_mask must have shape (B or 1, 1, T, past + T) = ({b}, 1, {t}, {past + t}), "
                    f"got {tuple(attention_mask.shape)}"
                )
            if attention_mask.dtype == torch.bool:
                attention_mask = _additive_mask(attention_mask.to(self.device), self.dtype)
            attention_mask = attention_mask.to(device=self.device, dtype=self.dtype)
        with self._capture_features() as captured:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids.to(self.device),
                attention_mask=attention_mask,
                cache=cache,
                use_cache=True,
            )
        cache.advance(t)
        features = torch.cat([captured[i] for i in self.feature_layers], dim=-1)  # (B, T, 3H)
        return TargetOutput(logits=out.logits.float(), features=features)

    def prefill(self, prompts: torch.Tensor | Sequence[Sequence[int]], cache: TargetCache) -> TargetOutput:
        """The prompts' forward: ``prompts`` (B, T) of one length (positions continue from the cache
        length) or B token sequences of different lengths into an empty cache, right-padded in one
        forward, each request seeing only its own prompt causally (a padding query sees itself, so no
        row of the mask is all hidden); request b then holds ``len(prompts[b])`` entries, and the outputs
        at its padded positions are meaningless (its last real position is ``len(prompts[b]) - 1``)."""
        prompts = [list(map(int, p)) for p in (prompts.tolist() if isinstance(prompts, torch.Tensor) else prompts)]
        lengths = [len(p) for p in prompts]
        if len(prompts) != cache.requests or not prompts or min(lengths) < 1:
            raise ValueError(f"prefill needs one non-empty prompt per cache request ({cache.requests}), "
                             f"got {len(prompts)} of lengths {lengths}")
        if len(set(lengths)) == 1 and cache.level:  # level requests: plain causal attention
            return self.forward(torch.tensor(prompts, dtype=torch.long), cache)
        if any(cache.lengths):
            raise ValueError(f"prompts of different lengths go into an empty cache, got lengths {cache.lengths}")
        t = max(lengths)
        ids = torch.zeros(len(prompts), t, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        positions = torch.arange(t)[None].expand(len(prompts), -1)
        real = positions < torch.tensor(lengths)[:, None]  # (B, T): the request's own prompt
        visible = torch.ones(t, t, dtype=torch.bool).tril()[None] & real[:, None]
        if self.sliding_window is not None:
            visible &= positions[:, None, :] > positions[:, :, None] - self.sliding_window
        visible |= torch.eye(t, dtype=torch.bool)  # a padding query sees at least itself: no NaN row to spread
        out = self.forward(ids, cache, position_ids=positions, attention_mask=visible[:, None])
        cache.set_lengths(lengths)
        return out

    def verify(self, roots: Sequence[int], trees: Sequence[Tree], cache: TargetCache) -> TargetOutput:
        """One forward over every request's [root, tree] (request b: ``len(trees[b]) + 1`` tokens, rows as
        in ``Tree.row``, padded to the largest) under one (B, 1, T, past + T) mask. Request b's committed
        entries are slots ``0 .. lengths[b] - 1``; its root sits at position ``lengths[b]`` and node i at
        ``lengths[b] + depth(i)``; a query sees its request's committed entries (within the sliding window,
        if any), the root, its ancestors and itself, never another request, a stale slot or padding (a
        padding query sees its request's committed entries and itself; its output is meaningless). Every
        request's length grows by T: keep the accepted entries with ``cache.compact(starts,
        [Tree.cache_offsets(accepted_b), ...])``.

        Plain decoding of level requests (empty trees) passes no mask at all, as Hugging Face
        ``generate`` does; other level requests without a window fill the tree block of the cache's
        mask buffer (the committed prefix is visible to all); the rest build ``rows_visibility``."""
        starts = list(cache.lengths)
        if len(roots) != len(trees) or cache.requests != len(trees):
            raise ValueError(f"verify needs one root and one tree per cache request ({cache.requests}), "
                             f"got {len(roots)} roots and {len(trees)} trees")
        t, past = 1 + max(len(tree) for tree in trees), cache.get_seq_length()
        ids = torch.zeros(len(trees), t, dtype=torch.long)
        for b, (root, tree) in enumerate(zip(roots, trees, strict=True)):
            ids[b, : len(tree) + 1] = torch.tensor([int(root), *tree.tokens], dtype=torch.long)
        if cache.level and self.sliding_window is None:
            if t == 1:  # plain decoding: the root sees the whole cache
                return self.forward(ids, cache)
            visible, offsets = tree_block(trees)  # (B, T, T) over [root, nodes], (B, T)
            mask = cache.mask(t, past + t, self.dtype, self.device)  # (B, 1, T, past + T) additive float
            mask.zero_()
            mask[:, 0, :, past:].masked_fill_(~visible.to(self.device, non_blocking=True), float("-inf"))
            return self.forward(ids, cache, position_ids=past + offsets, attention_mask=mask)
        visible, positions = rows_visibility(starts, trees, past, self.sliding_window)
        return self.forward(ids, cache, position_ids=positions, attention_mask=visible[:, None])


def tree_block(trees: Sequence[Tree]) -> tuple[torch.Tensor, torch.Tensor]:
    """The visibility (B, T, T) bool among every request's [root, tree] padded to T = 1 + the largest tree
    (a padding query sees itself only), and the position offsets (B, T) from each request's root (padding:
    0)."""
    t = 1 + max(len(tree) for tree in trees)
    visible = torch.eye(t, dtype=torch.bool).repeat(len(trees), 1, 1)
    offsets = torch.zeros(len(trees), t, dtype=torch.long)
    for b, tree in enumerate(trees):
        n = len(tree) + 1
        visible[b, :n, :n] = tree.attention_mask_with_root()
        offsets[b, :n] = tree.position_offsets_with_root()
    return visible, offsets


def rows_visibility(starts: Sequence[int], trees: Sequence[Tree], past: int,
                    sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The visibility (B, T, past + T) bool and the positions (B, T) of a verification of requests of
    different lengths (``TargetModel.verify``): request b's committed slots ``0 .. starts[b] - 1`` are
    seen by all its queries (within the window), its [root, tree] sits at slots ``starts[b] + i`` under
    the tree mask (``tree_block``), a padding query sees its request's committed slots and itself; no
    query sees another request's slots, a stale slot (``starts[b] .. past - 1``) or padding."""
    block, offsets = tree_block(trees)
    t = block.shape[1]
    positions = torch.tensor(list(starts), dtype=torch.long)[:, None] + offsets
    key_positions = torch.arange(past + t).repeat(len(trees), 1)  # slot -> position, per request
    visible = torch.zeros(len(trees), t, past + t, dtype=torch.bool)
    for b, start in enumerate(starts):
        visible[b, :, :start] = True
        visible[b, :, start : start + t] = block[b]
        key_positions[b, start : start + t] = positions[b]
    if sliding_window is not None:
        visible &= key_positions[:, None, :] > positions[:, :, None] - sliding_window
    return visible, positions


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = visible) -> float mask with 0 where visible and -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
