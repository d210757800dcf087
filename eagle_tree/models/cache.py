"""The key/value caches of decoding: the target's (``TargetCache``) and the head's (``DraftCache``).

Both hold the entries of B requests (1 for ``generate``) in buffers (B, n_kv_heads, capacity, head_dim)
that grow geometrically: request b's committed entries fill slots ``0 .. lengths[b] - 1``, slot ``s``
holding position ``s``. A forward of T tokens writes request b's entries at ``lengths[b] + i``
(``write_slots``: one slice write when the requests are level, else one scatter); the model reads the
buffer up to the longest request, and slots past a request's length (stale) are hidden by the caller's
mask. Buffers are allocated zeroed: a hidden slot gets weight 0, and 0 times a NaN would still be a NaN.
Requests leave (``select``) and join (``extend``) with one copy of the buffers per event, not per round.

``TargetCache`` is a ``transformers`` ``Cache``; what the target's forward uses from it is implemented
here: ``update`` (per layer), ``get_seq_length``, ``get_mask_sizes`` (causal mask building when no 4D
mask is given) and ``is_sliding`` / ``is_linear`` / ``is_dummy`` (from ``Cache``). ``compact`` keeps the
root and the accepted entries of every request after verification with one gather per layer over the
moved entries only, and owns the buffer of the round's attention mask (``mask``).

``DraftCache`` is the head's: ``attend`` (the :class:`AttentionCache` protocol that the head's ``step``
calls) appends the new entries after each request's own and attends over the buffer; ``crop`` forgets
the tree nodes after a proposal, so it keeps only committed pairs between rounds.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_CAPACITY = 64


class AttentionCache(Protocol):
    """What the head's ``step`` needs from a cache: store the new keys and values k / v (B, n_kv, T, hd)
    and return ``attn.attend(q, keys, values, mask)`` over what ``mask`` shows. The draft cache of
    decoding and the diagonal store of the training-time test implement it."""

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


def write_slots(buffer: torch.Tensor, lengths: list[int], new: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Write ``new`` (B, h, T, d) into ``buffer`` (B, h, capacity, d) at request b's slots ``lengths[b]`` ..
    ``lengths[b] + T - 1``: one slice write when every request has the same length, else one scatter along
    the slot axis (``slots``: the (B, T) slot indices on the buffer's device, computed once per forward)."""
    t = new.shape[2]
    if len(set(lengths)) == 1:
        buffer[:, :, lengths[0] : lengths[0] + t] = new
        return
    if slots is None:
        slots = request_slots(lengths, t, buffer.device)
    index = slots[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
    buffer.scatter_(2, index, new)


def request_slots(lengths: list[int], t: int, device) -> torch.Tensor:
    """(B, T) slot indices ``lengths[b] + i``: where request b's next T entries go."""
    return torch.tensor(lengths, dtype=torch.long)[:, None].add(torch.arange(t)).to(device)


def grown(buffer: torch.Tensor, capacity: int, filled: int) -> torch.Tensor:
    """A zeroed buffer of ``capacity`` slots holding the first ``filled`` slots of ``buffer``."""
    out = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.shape[3])
    out[:, :, :filled] = buffer[:, :, :filled]
    return out


def joined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The requests of ``first`` then those of ``second`` (B1 + B2, h, capacity, d), slots padded with
    zeros to the larger capacity."""
    capacity = max(first.shape[2], second.shape[2])
    parts = [t if t.shape[2] == capacity else torch.nn.functional.pad(t, (0, 0, 0, capacity - t.shape[2]))
             for t in (first, second)]
    return torch.cat(parts)


def check_offsets(starts: list[int], offsets: list[list[int]], end: int) -> None:
    """Refuse offsets that are not strictly ascending and non-negative, or that point past ``end``."""
    for b, (start, keep) in enumerate(zip(starts, offsets, strict=True)):
        if any(y <= x for x, y in zip(keep, keep[1:], strict=False)) or (keep and keep[0] < 0):
            raise ValueError(f"request {b}: offsets must be strictly ascending and non-negative, got {keep}")
        if start < 0 or (keep and start + keep[-1] >= end):
            raise ValueError(f"request {b}: start={start} with offsets {keep} is outside the cache of length {end}")


class BufferLayer(CacheLayerMixin):
    """One attention layer of a :class:`TargetCache`: the requests' new entries go to each request's own
    next slots (``write_slots``); the model reads the buffer up to the longest request."""

    is_sliding = False
    is_croppable = False

    def __init__(self, capacity: int, owner: TargetCache):
        super().__init__()
        self.capacity = max(int(capacity), 1)
        self.owner = owner
        self.length = 0  # the longest request's length: what the model sees

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, self.capacity, d)  # zeroed: stale slots are hidden,
        self.values = value_states.new_zeros(b, value_states.shape[1], self.capacity, value_states.shape[3])
        self.is_initialized = True  # but 0 * NaN would still be NaN

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner, t = self.owner, key_states.shape[-2]
        end = owner.end(t)
        if end > self.capacity:  # doubling, keeping the slots up to the longest request
            self.capacity = max(end, 2 * self.capacity)
            self.keys = grown(self.keys, self.capacity, self.length)
            self.values = grown(self.values, self.capacity, self.length)
        slots = owner.slots(t, self.keys.device)
        write_slots(self.keys, owner.lengths, key_states, slots)
        write_slots(self.values, owner.lengths, value_states, slots)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand

    def reset(self) -> None:
        self.length = 0


class TargetCache(Cache):
    """The target's keys and values for ``requests`` requests of possibly different lengths (module
    docstring). ``TargetModel.forward`` appends T entries to every request (:meth:`advance`);
    :meth:`set_lengths` keeps a right-padded prefill's prompts, :meth:`compact` a round's root and
    accepted entries."""

    def __init__(self, num_layers: int, requests: int = 1, capacity: int = MIN_CAPACITY):
        super().__init__(layers=[BufferLayer(max(capacity, MIN_CAPACITY), self) for _ in range(num_layers)])
        self.lengths: list[int] = [0] * requests
        self._slots: tuple[tuple, torch.Tensor] | None = None
        self._mask: torch.Tensor | None = None

    @property
    def requests(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def level(self) -> bool:
        """Whether every request holds the same number of entries."""
        return len(set(self.lengths)) <= 1

    @property
    def nbytes(self) -> int:
        """The size of the key/value buffers."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))

    def end(self, t: int) -> int:
        """The buffer length the model sees during a forward of ``t`` new tokens per request."""
        return max(self.lengths, default=0) + t

    def slots(self, t: int, device) -> torch.Tensor | None:
        """(B, T) write slots of the current forward (None when level), computed once for all layers."""
        if self.level:
            return None
        key = (tuple(self.lengths), t, str(device))
        if self._slots is None or self._slots[0] != key:
            self._slots = (key, request_slots(self.lengths, t, device))
        return self._slots[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.end(query_length), 0

    def advance(self, t: int) -> None:
        """After a forward of ``t`` tokens per request: every request now holds them."""
        self.lengths = [n + t for n in self.lengths]
        self._sync()

    def set_lengths(self, lengths: list[int]) -> None:
        """Keep the first ``lengths[b]`` entries of request b (e.g. a right-padded prefill's prompts)."""
        if len(lengths) != self.requests:
            raise ValueError(f"set_lengths needs {self.requests} lengths, got {len(lengths)}")
        self.lengths = [int(n) for n in lengths]
        self._sync()

    def _sync(self) -> None:
        for layer in self.layers:
            layer.length = max(self.lengths, default=0)

    def compact(self, starts: list[int], offsets: list[list[int]]) -> None:
        """For every request b: move the entries at ``starts[b] + offsets[b][j]`` to ``starts[b] + j`` and
        keep ``starts[b] + len(offsets[b])`` entries (``Tree.cache_offsets`` of the accepted nodes after a
        verification). Each ``offsets[b]`` is strictly ascending and non-negative; entries already in
        place are not moved, and the rest move in one gather per layer (one host-to-device copy)."""
        if len(starts) != self.requests or len(offsets) != self.requests:
            raise ValueError(f"compact needs one start and one offset list per request ({self.requests})")
        check_offsets(starts, offsets, self.end(0))
        moves = [(b, start + k, start + j) for b, (start, keep) in enumerate(zip(starts, offsets, strict=True))
                 for j, k in enumerate(keep) if k != j]
        if moves and self.layers[0].is_initialized:
            index = torch.tensor(moves, dtype=torch.long).T.to(self.layers[0].keys.device, non_blocking=True)
            b, src, dst = index  # (N,) each
            for layer in self.layers:
                layer.keys[b, :, dst] = layer.keys[b, :, src]  # (N, h, hd): gathered before the write
                layer.values[b, :, dst] = layer.values[b, :, src]
        self.set_lengths([start + len(keep) for start, keep in zip(starts, offsets, strict=True)])

    def select(self, requests: list[int]) -> None:
        """Keep only these requests, in this order (a copy of every buffer: done when requests leave)."""
        self.lengths = [self.lengths[r] for r in requests]
        if self.layers[0].is_initialized:
            index = torch.tensor(requests, dtype=torch.long, device=self.layers[0].keys.device)
            for layer in self.layers:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self._sync()

    def extend(self, other: TargetCache) -> None:
        """Append the requests of ``other`` after this cache's (a copy of every buffer: done when requests
        join); capacities are levelled up to the larger one."""
        if len(other.layers) != len(self.layers):
            raise ValueError(f"cannot join a {len(other.layers)}-layer cache to a {len(self.layers)}-layer one")
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if not self.requests or not mine.is_initialized:
                mine.keys, mine.values, mine.capacity = theirs.keys, theirs.values, theirs.capacity
                mine.is_initialized = theirs.is_initialized
            elif other.requests and theirs.is_initialized:
                mine.keys, mine.values = joined(mine.keys, theirs.keys), joined(mine.values, theirs.values)
                mine.capacity = mine.keys.shape[2]
        self.lengths = (self.lengths if self.requests else []) + other.lengths
        self._sync()

    def mask(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A (B, 1, rows, cols) view of this cache's mask buffer (contents undefined: the caller fills
        it). The buffer is reallocated, geometrically, only when it is too small or of another kind."""
        buf, b = self._mask, self.requests
        if (buf is None or buf.dtype != dtype or buf.device != device or buf.shape[0] != b
                or buf.shape[1] < rows or buf.shape[2] < cols):
            old_rows, old_cols = (0, 0) if buf is None else buf.shape[1:]
            c = max(cols, self.capacity, 2 * old_cols if cols > old_cols else old_cols)
            r = max(rows, MIN_CAPACITY, 2 * old_rows if rows > old_rows else old_rows)
            buf = self._mask = torch.empty(b, r, c, dtype=dtype, device=device)
        return buf[:, :rows, :cols][:, None]


class DraftCache:
    """Keys and values (B, n_kv, S, hd) of the head's single layer for B requests (module docstring);
    ``attend`` implements :class:`AttentionCache`."""

    def __init__(self, requests: int = 1) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.lengths = [0] * requests

    @property
    def length(self) -> int:
        """The longest request's length (the only one's, outside batched decoding)."""
        return max(self.lengths, default=0)

    @property
    def requests(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n, end = k.shape[2], self.length + k.shape[2]
        if self.k is None:
            capacity = max(256, 2 * end)
            self.k = k.new_zeros(*k.shape[:2], capacity, k.shape[3])
            self.v = v.new_zeros(*v.shape[:2], capacity, v.shape[3])
        elif end > self.k.shape[2]:
            self.k, self.v = grown(self.k, 2 * end, self.length), grown(self.v, 2 * end, self.length)
        write_slots(self.k, self.lengths, k)
        write_slots(self.v, self.lengths, v)
        self.lengths = [length + n for length in self.lengths]

    def crop(self, lengths: int | list[int]) -> None:
        """Keep at most ``lengths[b]`` entries of request b (an int: of every request)."""
        if isinstance(lengths, int):
            lengths = [lengths] * self.requests
        self.lengths = [min(a, int(b)) for a, b in zip(self.lengths, lengths, strict=True)]

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Append k/v (B, n_kv, T, hd), then ``attn.attend`` over the cache; mask (B, 1, T, S_after) bool."""
        self.append(k, v)
        return attn.attend(q, *self.view(), mask)

    def select(self, requests: list[int]) -> None:
        """Keep only these requests, in this order (a copy of the buffers)."""
        self.lengths = [self.lengths[r] for r in requests]
        if self.k is not None:
            index = torch.tensor(requests, dtype=torch.long, device=self.k.device)
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)

    def extend(self, other: DraftCache) -> None:
        """Append the requests of ``other`` after these (a copy of the buffers)."""
        if self.k is None or not self.requests:
            self.k, self.v, self.lengths = other.k, other.v, list(other.lengths)
            return
        if other.k is not None:
            self.k, self.v = joined(self.k, other.k), joined(self.v, other.v)
        self.lengths = self.lengths + list(other.lengths)
