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


def write_rows(buffer: torch.Tensor, lengths: list[int], new: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Write ``new`` (B, h, T, d) into ``buffer`` (B, h, capacity, d) at row b's slots ``lengths[b]`` ..
    ``lengths[b] + T - 1``: one slice write when every row has the same length, else one scatter along the
    slot axis (``slots``: the (B, T) slot indices on the buffer's device, computed once per forward)."""
    t = new.shape[2]
    if len(set(lengths)) == 1:
        buffer[:, :, lengths[0] : lengths[0] + t] = new
        return
    if slots is None:
        slots = row_slots(lengths, t, buffer.device)
    index = slots[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
    buffer.scatter_(2, index, new)


def row_slots(lengths: list[int], t: int, device) -> torch.Tensor:
    """(B, T) slot indices ``lengths[b] + i``: where row b's next T entries go."""
    return torch.tensor(lengths, dtype=torch.long)[:, None].add(torch.arange(t)).to(device)


class RowLayer(BufferLayer):
    """One attention layer of a :class:`BatchCache`: the rows' new entries go to each row's own next
    slots (``write_rows``); the model reads the buffer up to the longest row."""

    def __init__(self, capacity: int, owner: BatchCache):
        super().__init__(capacity)
        self.owner = owner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner, t = self.owner, key_states.shape[-2]
        end = owner.end(t)
        if end > self.capacity:
            self._grow(end)
        write_rows(self.keys, owner.lengths, key_states, owner.slots(t, self.keys.device))
        write_rows(self.values, owner.lengths, value_states, owner.slots(t, self.keys.device))
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys.zero_(), self.values.zero_()  # stale slots are hidden, but 0 * NaN would still be NaN

    def _grow(self, needed: int) -> None:
        """Reallocate (zeroed, doubling), keeping the slots up to the longest row."""
        length = max(self.owner.lengths, default=0)
        self.capacity = max(needed, 2 * self.capacity)
        keys, values = self.keys, self.values
        self.keys = keys.new_zeros(*keys.shape[:2], self.capacity, keys.shape[3])
        self.values = values.new_zeros(*values.shape[:2], self.capacity, values.shape[3])
        self.keys[:, :, :length] = keys[:, :, :length]
        self.values[:, :, :length] = values[:, :, :length]


class BatchCache(Cache):
    """A target cache of several rows (requests) of different lengths: row b's committed entries fill
    slots ``0 .. lengths[b] - 1`` of every layer's buffer (B, n_kv_heads, capacity, head_dim), entry ``s``
    holding position ``s``; slots past a row's length are stale and must be hidden by the caller's mask
    (buffers are allocated zeroed, so a hidden slot never holds a NaN that a zero weight would spread).

    A forward of T tokens writes row b's entries at ``lengths[b] .. lengths[b] + T - 1`` (one slice write
    when the rows are level, one scatter otherwise) and shows the model the buffer up to the longest row;
    :meth:`advance` (or :meth:`set_lengths`) then moves the lengths. :meth:`compact_rows` keeps chosen
    entries of each row's tail with one gather per layer over the moved entries only; :meth:`select_rows`
    and :meth:`add_rows` change the rows (a copy of the buffers, once per request that leaves or joins).
    """

    def __init__(self, num_layers: int, rows: int = 0, capacity: int = MIN_CAPACITY):
        super().__init__(layers=[RowLayer(max(capacity, MIN_CAPACITY), self) for _ in range(num_layers)])
        self.lengths: list[int] = [0] * rows
        self._slots: tuple[tuple, torch.Tensor] | None = None

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    def end(self, t: int) -> int:
        """The buffer length the model sees during a forward of ``t`` new tokens per row."""
        return max(self.lengths, default=0) + t

    def slots(self, t: int, device) -> torch.Tensor | None:
        """(B, T) write slots of the current forward, computed once and shared by the layers."""
        if len(set(self.lengths)) <= 1:
            return None
        key = (tuple(self.lengths), t, str(device))
        if self._slots is None or self._slots[0] != key:
            self._slots = (key, row_slots(self.lengths, t, device))
        return self._slots[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.end(query_length), 0

    def advance(self, t: int) -> None:
        """After a forward of ``t`` tokens per row: every row now holds them."""
        self.lengths = [n + t for n in self.lengths]

    def set_lengths(self, lengths: list[int]) -> None:
        """Keep the first ``lengths[b]`` entries of row b (e.g. a right-padded prefill's prompt lengths)."""
        if len(lengths) != self.rows:
            raise ValueError(f"set_lengths needs {self.rows} lengths, got {len(lengths)}")
        self.lengths = [int(n) for n in lengths]
        self._sync()

    def _sync(self) -> None:
        for layer in self.layers:
            layer.length = max(self.lengths, default=0)

    def compact_rows(self, starts: list[int], keeps: list[list[int]]) -> None:
        """For every row b: move the entries at ``starts[b] + keeps[b][j]`` to ``starts[b] + j`` and keep
        ``starts[b] + len(keeps[b])`` entries. Each ``keeps[b]`` is strictly ascending and non-negative;
        entries already in place are not moved, and the rest move in one gather per layer."""
        if len(starts) != self.rows or len(keeps) != self.rows:
            raise ValueError(f"compact_rows needs one start and one keep list per row ({self.rows})")
        rows, src, dst = [], [], []
        for b, (start, keep) in enumerate(zip(starts, keeps, strict=True)):
            if any(y <= x for x, y in zip(keep, keep[1:], strict=False)) or (keep and keep[0] < 0):
                raise ValueError(f"row {b}: keep must be strictly ascending non-negative offsets, got {keep}")
            if start < 0 or (keep and start + keep[-1] >= self.end(0)):
                raise ValueError(f"row {b}: start={start} with keep={keep} is outside the cache")
            for j, k in enumerate(keep):
                if k != j:
                    rows.append(b), src.append(start + k), dst.append(start + j)
        if rows and self.layers[0].is_initialized:
            device = self.layers[0].keys.device
            b, s, d = (torch.tensor(x, dtype=torch.long).to(device) for x in (rows, src, dst))
            for layer in self.layers:
                layer.keys[b, :, d] = layer.keys[b, :, s]  # (N, h, hd): gathered before the write
                layer.values[b, :, d] = layer.values[b, :, s]
        self.set_lengths([start + len(keep) for start, keep in zip(starts, keeps, strict=True)])

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (a copy of every buffer: done when requests leave)."""
        self.lengths = [self.lengths[r] for r in rows]
        if self.layers[0].is_initialized:
            index = torch.tensor(rows, dtype=torch.long, device=self.layers[0].keys.device)
            for layer in self.layers:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self._sync()

    def add_rows(self, other: BatchCache) -> None:
        """Append the rows of ``other`` after this cache's rows (a copy of every buffer: done when requests
        join); capacities are levelled up to the larger one."""
        if len(other.layers) != len(self.layers):
            raise ValueError(f"cannot add rows of a {len(other.layers)}-layer cache to a {len(self.layers)}-layer one")
        if not self.rows:
            for mine, theirs in zip(self.layers, other.layers, strict=True):
                mine.keys, mine.values, mine.capacity = theirs.keys, theirs.values, theirs.capacity
                mine.is_initialized = theirs.is_initialized
            self.lengths = []
        elif other.rows:
            capacity = max(self.capacity, other.capacity)
            for mine, theirs in zip(self.layers, other.layers, strict=True):
                parts = []
                for layer in (mine, theirs):
                    keys, values = layer.keys, layer.values
                    if layer.capacity < capacity:
                        pad = capacity - layer.capacity
                        keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
                        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
                    parts.append((keys, values))
                mine.keys = torch.cat([parts[0][0], parts[1][0]])
                mine.values = torch.cat([parts[0][1], parts[1][1]])
                mine.capacity = capacity
        self.lengths = self.lengths + other.lengths
        self._sync()
