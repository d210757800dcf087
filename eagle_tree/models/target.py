"""The target model: a frozen Hugging Face causal LM with feature capture, tree-masked verification
and KV-cache compaction.

Everything goes through the model's public inputs (``input_ids``, ``position_ids``, a 4D float
``attention_mask`` and a ``cache`` object) plus forward pre-hooks on the decoder layers; no modeling
code is forked per architecture. One row (request) per forward, except with a ``BatchCache``
(``prefill_rows`` / ``verify_rows``: rows of different lengths in one forward).

Cache contract (the caller owns the cache; this class never stores one):

* ``new_cache(capacity)`` gives an empty :class:`~eagle_tree.models.cache.TargetCache`: keys and
  values of every layer in buffers (1, n_kv_heads, capacity, head_dim) allocated once and grown
  geometrically, entry ``s`` holding position ``s``. Sliding-window models get full layers too; the
  window is applied in the masks built here. A ``transformers.DynamicCache`` of plain layers works too.
* ``prefill`` / ``forward`` / ``verify`` append to it (a slice write); ``compact_cache`` gathers the
  accepted entries into contiguous positions (one in-place gather per layer) and crops the rest.
  ``verify`` writes its mask into the cache's mask buffer: an additive float mask, measured as fast as
  a boolean one with sdpa on CPU, and the one eager attention needs. Plain decoding (an empty tree)
  passes no mask at all, as Hugging Face ``generate`` does.

Features: the hidden states entering the three feature layers, caught by forward pre-hooks that are
registered for the duration of one forward and removed in a ``finally`` block, so nothing stays
attached to the model between calls and only those three tensors are kept.

Supported models (checked at construction, see ``_check_supported``): the forward takes
``attention_mask``, ``position_ids`` and ``cache`` by name; the attention implementation is
``"eager"`` or ``"sdpa"`` (the ones that add a custom 4D float mask as given: flash attention ignores
custom masks and flex attention wants a ``BlockMask``); the decoder layers are reachable as
``model.get_decoder().layers``; and the attention layers are either all full or all sliding-window
with one window size (mixed layer types would need one mask per layer type).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from eagle_tree.core.tree import Tree
from eagle_tree.models.cache import MIN_CAPACITY, BatchCache, TargetCache

SUPPORTED_ATTENTION = ("eager", "sdpa")
REQUIRED_FORWARD_INPUTS = ("attention_mask", "position_ids", "cache")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (1, T, V) float32
    features: torch.Tensor  # (1, T, 3H) hidden states entering the low, mid and high feature layers


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


def _check_feature_layers(layers: Sequence[int], num_layers: int) -> tuple[int, int, int]:
    layers = tuple(int(i) for i in layers)
    if len(layers) != 3:
        raise ValueError(
            f"feature_layers must be exactly 3 layer indices (low, mid, high), got {len(layers)}: {layers}"
        )
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"feature_layers {layers} has indices {bad} outside the valid range [0, {num_layers}): "
            f"the model has {num_layers} decoder layers"
        )
    return layers  # type: ignore[return-value]


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
            f"verification needs; load the model with attn_implementation='eager' or 'sdpa'"
        )


class TargetModel:
    """A frozen causal LM: logits plus fused low/mid/high features for every input position."""

    def __init__(self, model, feature_layers: Sequence[int] | None = None):
        _check_supported(model)
        self.model = model
        self.config = model.config
        text_config = model.config.get_text_config(decoder=True)
        self._layers = model.get_decoder().layers
        self.num_layers = len(self._layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.sliding_window = _sliding_window(text_config, self.num_layers)
        if feature_layers is None:
            feature_layers = default_feature_layers(self.num_layers)
        self.feature_layers = _check_feature_layers(feature_layers, self.num_layers)
        self.embed_tokens = model.get_input_embeddings()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        dtype: torch.dtype = torch.float32,
        feature_layers: Sequence[int] | None = None,
        **kwargs,
    ) -> TargetModel:
        """Load a hub id, a local folder or a ``.gguf`` file (or a folder with ``gguf_file=NAME``) through
        :func:`eagle_tree.models.gguf.load_causal_lm` (sdpa attention unless ``attn_implementation`` is
        given in ``kwargs``, e.g. ``device_map``), in eval mode."""
        from eagle_tree.models.gguf import load_causal_lm

        kwargs.setdefault("attn_implementation", "sdpa")
        model = load_causal_lm(name_or_path, dtype=dtype, **kwargs)
        return cls(model.eval(), feature_layers=feature_layers)

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

    def new_cache(self, capacity: int = MIN_CAPACITY) -> TargetCache:
        """An empty preallocated cache of ``capacity`` entries per layer (grown geometrically if a
        forward needs more); its buffers are allocated on the first forward."""
        return TargetCache(self.num_layers, capacity)

    def new_batch_cache(self, rows: int, capacity: int = MIN_CAPACITY) -> BatchCache:
        """An empty cache of ``rows`` rows (requests) of different lengths, for :meth:`prefill_rows` and
        :meth:`verify_rows`."""
        return BatchCache(self.num_layers, rows, capacity)

    @staticmethod
    def cache_length(cache) -> int:
        return int(cache.get_seq_length())

    def compact_cache(self, cache, start: int, keep: Sequence[int]) -> None:
        """Move the entries at ``start + keep[j]`` to ``start + j`` in every layer, then crop the cache
        to ``start + len(keep)``. ``keep`` is strictly ascending (so ``keep[j] >= j``), e.g.
        ``Tree.cache_rows(accepted)`` for the root and the accepted nodes after ``verify``. Only entries
        that actually move are gathered. Works on a :class:`TargetCache` (one in-place gather per layer)
        and on a ``DynamicCache`` of plain layers."""
        keep = [int(k) for k in keep]
        length = self.cache_length(cache)
        if any(b <= a for a, b in zip(keep, keep[1:], strict=False)) or (keep and keep[0] < 0):
            raise ValueError(f"keep must be strictly ascending non-negative offsets, got {keep}")
        if not 0 <= start <= length or (keep and start + keep[-1] >= length):
            raise ValueError(f"start={start} with keep={keep} is outside the cache of length {length}")
        if isinstance(cache, TargetCache):
            cache.compact(start, keep)
            return
        from transformers.cache_utils import DynamicLayer

        for i, layer in enumerate(cache.layers):
            if type(layer) is not DynamicLayer:
                raise TypeError(
                    f"cache layer {i} is a {type(layer).__name__}; compact_cache handles TargetCache and plain "
                    "DynamicLayer entries only: make caches with TargetModel.new_cache()"
                )
        first_move = next((j for j, k in enumerate(keep) if k != j), len(keep))
        src = torch.tensor(keep[first_move:], dtype=torch.long)
        for layer in cache.layers:
            if not layer.is_initialized or len(src) == 0:
                continue
            # keys / values: (1, n_kv_heads, S, head_dim); gather the moved entries, write them in place
            idx = (start + src).to(layer.keys.device)
            dst = slice(start + first_move, start + len(keep))
            layer.keys[:, :, dst] = layer.keys.index_select(2, idx)
            layer.values[:, :, dst] = layer.values.index_select(2, idx)
        removed = length - (start + len(keep))
        if removed:
            cache.crop(-removed)  # transformers 5: a negative count removes that many entries

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
        cache,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """One forward over ``input_ids`` (1, T), appending T entries to ``cache`` (B rows: ``input_ids``
        (B, T) with a :class:`BatchCache`, whose lengths the caller then moves; see :meth:`verify_rows`).

        ``position_ids`` (1, T) default to ``past + arange(T)``. ``attention_mask``: None for causal
        attention, or a 4D mask (1, 1, T, past + T), float (0 visible, -inf hidden) or bool (True visible).
        """
        if input_ids.dim() != 2 or (input_ids.shape[0] != 1 and not isinstance(cache, BatchCache)):
            raise ValueError(f"input_ids must have shape (1, T) (B rows: a BatchCache), got {tuple(input_ids.shape)}")
        past, t = self.cache_length(cache), input_ids.shape[1]
        input_ids = input_ids.to(self.device)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=self.device)[None]  # (1, T)
        if attention_mask is not None:
            if attention_mask.dim() != 4 or tuple(attention_mask.shape[1:]) != (1, t, past + t) or \
                    attention_mask.shape[0] not in (1, input_ids.shape[0]):
                raise ValueError(
                    f"attention_mask must have shape (B or 1, 1, T, past + T) = (B, 1, {t}, {past + t}), "
                    f"got {tuple(attention_mask.shape)}"
                )
            if attention_mask.dtype == torch.bool:
                attention_mask = _additive_mask(attention_mask, self.dtype)
            attention_mask = attention_mask.to(device=self.device, dtype=self.dtype)
        with self._capture_features() as captured:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids.to(self.device),
                attention_mask=attention_mask,
                cache=cache,
                use_cache=True,
            )
        features = torch.cat([captured[i] for i in self.feature_layers], dim=-1)  # (1, T, 3H)
        return TargetOutput(logits=out.logits.float(), features=features)

    def prefill(self, input_ids: torch.Tensor, cache) -> TargetOutput:
        """Plain causal forward; positions continue from the cache length."""
        return self.forward(input_ids, cache)

    def verify(self, root_token: int, tree: Tree, cache) -> TargetOutput:
        """One forward over [root, tree.tokens] (T = n + 1, rows as in ``Tree.row``) under the tree mask.

        With ``past`` = cache length (the committed prefix minus the root), the root sits at position
        ``past`` and node i at ``past + depth(i)``; every query sees the whole cache (within the sliding
        window, if any), the root, its ancestors and itself. The cache grows by n + 1 entries. The mask
        is written into the cache's mask buffer when the cache is a :class:`TargetCache`.
        """
        past, t = self.cache_length(cache), len(tree) + 1
        input_ids = torch.tensor([[int(root_token), *tree.tokens]], dtype=torch.long)  # (1, T)
        if t == 1 and self.sliding_window is None:  # plain decoding: the root sees the whole cache
            return self.forward(input_ids, cache)
        offsets = tree.position_offsets_with_root()  # (T,) on the host
        positions = past + offsets
        hidden = ~tree.attention_mask_with_root()  # (T, T) over [root, nodes]
        if self.sliding_window is not None:
            key_positions = torch.cat([torch.arange(past), positions])  # (past + T,)
            outside = key_positions[None, :] <= positions[:, None] - self.sliding_window
            outside[:, past:] |= hidden
            hidden, first = outside, 0
        else:
            first = past  # the committed prefix is visible to every row
        if isinstance(cache, TargetCache):
            mask = cache.mask(t, past + t, self.dtype, self.device)  # (1, 1, T, past + T) additive float
        else:
            mask = torch.empty(1, 1, t, past + t, dtype=self.dtype, device=self.device)
        mask.zero_()
        mask[0, 0, :, first:].masked_fill_(hidden.to(self.device, non_blocking=True), float("-inf"))
        return self.forward(input_ids, cache, position_ids=positions[None], attention_mask=mask)


    def prefill_rows(self, prompts: Sequence[Sequence[int]], cache: BatchCache) -> TargetOutput:
        """Prefill an empty :class:`BatchCache` of ``len(prompts)`` rows with prompts of different lengths
        in one forward: right-padded, each row seeing only its own prompt causally; row b then holds
        ``len(prompts[b])`` entries. The outputs at padded positions are meaningless (row b's last real
        position is ``len(prompts[b]) - 1``)."""
        lengths = [len(p) for p in prompts]
        if cache.rows != len(prompts) or any(cache.lengths):
            raise ValueError(f"prefill_rows needs an empty BatchCache of {len(prompts)} rows, "
                             f"got one with lengths {cache.lengths}")
        if not prompts or min(lengths) < 1:
            raise ValueError("prefill_rows needs at least one prompt, and every prompt at least one token")
        t = max(lengths)
        if len(set(lengths)) == 1 and self.sliding_window is None:  # level rows: plain causal attention
            out = self.forward(torch.tensor([list(p) for p in prompts], dtype=torch.long), cache)
            cache.set_lengths(lengths)
            return out
        ids = torch.zeros(len(prompts), t, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        positions = torch.arange(t)[None].expand(len(prompts), -1)
        real = positions < torch.tensor(lengths)[:, None]  # (B, T): the row's own prompt
        visible = torch.ones(t, t, dtype=torch.bool).tril()[None] & real[:, None]
        if self.sliding_window is not None:
            visible &= positions[:, None, :] > positions[:, :, None] - self.sliding_window
        visible |= torch.eye(t, dtype=torch.bool)  # a padding query sees at least itself: no NaN row to spread
        out = self.forward(ids, cache, position_ids=positions,
                           attention_mask=_additive_mask(visible[:, None].to(self.device), self.dtype))
        cache.set_lengths(lengths)
        return out

    def verify_rows(self, roots: Sequence[int], trees: Sequence[Tree], cache: BatchCache) -> TargetOutput:
        """One forward over every row's [root, tree] (row b: ``len(trees[b]) + 1`` tokens, padded to the
        largest) under one (B, 1, T, past + T) mask. Row b's committed entries are slots
        ``0 .. lengths[b] - 1`` and its new entries go to ``lengths[b] + i`` (``Tree.row``); a query sees
        its row's committed entries (within the sliding window, if any), the root, its ancestors and
        itself, never another row, a stale slot or padding (a padding query sees its row's committed
        entries and itself; its output is meaningless). Every row's length grows by T: compact with
        ``BatchCache.compact_rows(lengths, [Tree.cache_rows(accepted_b), ...])``."""
        b_rows, starts = len(trees), list(cache.lengths)
        if len(roots) != b_rows or cache.rows != b_rows:
            raise ValueError(f"verify_rows needs one root and one tree per cache row ({cache.rows}), "
                             f"got {len(roots)} roots and {b_rows} trees")
        t = 1 + max(len(tree) for tree in trees)
        past = cache.get_seq_length()
        if t == 1 and len(set(starts)) == 1 and self.sliding_window is None:  # level rows, plain decoding
            out = self.forward(torch.tensor([[int(r)] for r in roots]), cache,
                               position_ids=torch.tensor([[past]] * b_rows))
            cache.advance(1)
            return out
        ids = torch.zeros(b_rows, t, dtype=torch.long)
        for b, (root, tree) in enumerate(zip(roots, trees, strict=True)):
            ids[b, : len(tree) + 1] = torch.tensor([int(root), *tree.tokens], dtype=torch.long)
        visible, positions = rows_visibility(starts, trees, past, self.sliding_window)
        mask = _additive_mask(visible[:, None].to(self.device, non_blocking=True), self.dtype)
        out = self.forward(ids, cache, position_ids=positions, attention_mask=mask)
        cache.advance(t)
        return out


def rows_visibility(starts: Sequence[int], trees: Sequence[Tree], past: int,
                    sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The visibility (B, T, past + T) bool and the positions (B, T) of a batched verification
    (``TargetModel.verify_rows``): row b's committed slots ``0 .. starts[b] - 1`` are seen by all its
    queries (within the window), its [root, tree] sits at slots ``starts[b] + i`` under the tree mask, a
    padding query sees its row's committed slots and itself; no query sees another row's slots, a stale
    slot (``starts[b] .. past - 1``) or padding."""
    b_rows, t = len(trees), 1 + max(len(tree) for tree in trees)
    positions = torch.zeros(b_rows, t, dtype=torch.long)
    key_positions = torch.arange(past + t).repeat(b_rows, 1)  # slot -> position, per row
    visible = torch.zeros(b_rows, t, past + t, dtype=torch.bool)
    for b, (tree, start) in enumerate(zip(trees, starts, strict=True)):
        n = len(tree) + 1
        offsets = tree.position_offsets_with_root()
        positions[b, :n] = start + offsets
        positions[b, n:] = start
        visible[b, :, :start] = True
        visible[b, :n, start : start + n] = tree.attention_mask_with_root()
        pads = torch.arange(n, t)
        visible[b, pads, start + pads] = True
        key_positions[b, start : start + n] = start + offsets
    if sliding_window is not None:
        visible &= key_positions[:, None, :] > positions[:, :, None] - sliding_window
    return visible, positions


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = visible) -> float mask with 0 where visible and -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
