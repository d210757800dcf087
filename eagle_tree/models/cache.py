"""A preallocated key/value cache for the target, with in-place compaction.

``TargetCache`` is a ``transformers`` ``Cache`` whose layers keep keys and values (1, n_kv_heads,
capacity, head_dim) in buffers allocated once (on the first forward, with the capacity given at
construction) and grown geometrically when a forward would overflow them. Entry ``s`` holds position
``s``. Appending is a slice write into the buffer; the model reads a view of the filled prefix.
``compact`` keeps chosen entries of the tail with one in-place gather per layer, and ``crop`` only
moves the length: nothing is reallocated between rounds.

It also owns the buffer of the round's attention mask (``mask``), so that building a verification
mask writes into memory allocated once per cache.

What the target's forward uses from a transformers 5 cache, and is implemented here: ``update``
(per layer), ``get_seq_length``, ``get_mask_sizes`` / ``get_query_offset`` (causal mask building
when no 4D mask is given), ``is_sliding`` / ``is_linear`` / ``is_dummy`` (from ``Cache``), ``crop``
and ``reset``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_CAPACITY = 64


class BufferLayer(CacheLayerMixin):
    """One attention layer's keys and values in a preallocated buffer, filled up to ``length``."""

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = max(int(capacity), 1)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.keys = key_states.new_empty(b, h, self.capacity, d)
        self.values = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[3])
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        """Reallocate to at least ``needed`` entries (doubling), keeping the filled prefix."""
        self.capacity = max(needed, 2 * self.capacity)
        keys, values = self.keys, self.values
        self.keys = keys.new_empty(*keys.shape[:2], self.capacity, keys.shape[3])
        self.values = values.new_empty(*values.shape[:2], self.capacity, values.shape[3])
        self.keys[:, :, : self.length] = keys[:, :, : self.length]
        self.values[:, :, : self.length] = values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` entries (a negative count, as in transformers 5), or keep
        the first ``tokens_to_remove`` entries when it is positive."""
        keep = self.length + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        self.length = max(0, min(self.length, keep))

    def reset(self) -> None:
        self.length = 0

    def compact(self, src: torch.Tensor, dst_start: int, dst_end: int) -> None:
        """Write the entries at ``src`` (ascending, each >= its destination) into ``dst_start:dst_end``."""
        if self.is_initialized:
            self.keys[:, :, dst_start:dst_end] = self.keys.index_select(2, src)
            self.values[:, :, dst_start:dst_end] = self.values.index_select(2, src)


class TargetCache(Cache):
    """Preallocated cache of ``num_layers`` full-attention layers holding ``capacity`` entries each."""

    def __init__(self, num_layers: int, capacity: int = MIN_CAPACITY):
        super().__init__(layers=[BufferLayer(max(capacity, MIN_CAPACITY)) for _ in range(num_layers)])
        self._mask: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    def compact(self, start: int, keep: list[int]) -> None:
        """Move the entries at ``start + keep[j]`` to ``start + j`` in every layer, then keep
        ``start + len(keep)`` entries. ``keep`` is strictly ascending and non-negative (checked by the
        caller); entries already in place are not moved."""
        first_move = next((j for j, k in enumerate(keep) if k != j), len(keep))
        if first_move < len(keep):
            layer0 = self.layers[0]
            device = layer0.keys.device if layer0.is_initialized else "cpu"
            src = torch.tensor(keep[first_move:], dtype=torch.long).add_(start).to(device, non_blocking=True)
            for layer in self.layers:
                layer.compact(src, start + first_move, start + len(keep))
        self.crop(start + len(keep))

    def mask(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A (1, 1, rows, cols) view of this cache's mask buffer (contents undefined: the caller fills
        it). The buffer is reallocated, geometrically, only when it is too small or of another dtype."""
        buf = self._mask
        if buf is None or buf.dtype != dtype or buf.device != device or buf.shape[0] < rows or buf.shape[1] < cols:
            old_rows, old_cols = (0, 0) if buf is None else buf.shape
            c = max(cols, self.capacity, 2 * old_cols if cols > old_cols else old_cols)
            r = max(rows, MIN_CAPACITY, 2 * old_rows if rows > old_rows else old_rows)
            buf = self._mask = torch.empty(r, c, dtype=dtype, device=device)
        return buf[:rows, :cols][None, None]
