"""Target features and target distributions: computed online, or written once to disk and read back.

What the training-time test needs from the target for an example ``x_0..x_{T-1}`` is, per position,
the fused feature ``f_j`` (T, 3H) and the target logits ``z_j``. Both paths compute them the same
way, one example at a time (:func:`example_targets`: a batch-1 causal forward of the unpadded
example), so the cached path reproduces the online one bit for bit; padded batch forwards would
differ in the last bits, and batch 1 keeps accelerators busy anyway once rows are long.

What is stored (and why it is exact). The loss (``ttt.ttt_forward``) uses the logits only through

* ``softmax(z[..., d2t_ids])``: the distribution restricted to the draft vocabulary, and
* ``t2d[argmax z]``: whether the target's top token lies in the draft vocabulary;

so a shard holds the draft-vocabulary columns of the logits in float32 (the dtype the online path
computes them in: ``TargetModel`` returns float32 logits) plus one flag per token, and
:func:`expand_logits` rebuilds a full-vocabulary tensor with the same two properties: the stored
columns in place, ``-inf`` elsewhere, and ``+inf`` in one column outside the draft vocabulary when the
top token was outside it. Features are stored in the target's dtype (the dtype they are captured
in). The loss from the cache therefore equals the online loss exactly (tests/test_feature_cache.py),
at ``Vd / V`` of the full logits' size; top-k storage would save more but change the loss.

Layout of a cache folder::

    meta.json                    format, fingerprint, sizes; written first
    shard-00000.safetensors      examples [0, S): features (N, 3H), draft_logits (N, Vd) float32,
    shard-00001.safetensors      top_in_draft (N,) bool, offsets (n + 1,) int64: example i is rows
    ...                          offsets[i]:offsets[i + 1]

Shards are written atomically (temporary file, then rename); building again skips the shards that
exist, so an interrupted build resumes. Several processes build disjoint shards (shard ``s`` by rank
``s % world``). The fingerprint names the dataset (a hash of every example's ids and loss mask), the
target (config, feature layers, dtype and a hash of its weights, see :func:`target_fingerprint`)
and the draft vocabulary; a cache whose fingerprint differs is refused with :class:`StaleCacheError`.

Reuse across datasets. ``meta.json`` also holds each shard's hash (its examples' ids and loss masks,
:func:`shard_hashes`). A build given ``reuse_from`` folders takes a missing shard ``s`` from one of
them, as a hard link (a copy across file systems), when that cache was built for the same target and
draft vocabulary, with the same shard size and feature dtype, and its shard ``s`` has the same hash:
then the shard's bytes are those this build would write. So a dataset that grew by appending (the
chat data does) only pays the target's forward for the new shards. Building a complete cache again
adds the hashes to a cache written before they existed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from eagle_tree.training.data import iter_token_columns
from eagle_tree.utils.atomic import atomic_file, write_bytes
from eagle_tree.utils.checks import InputError

FORMAT_VERSION = 1
META_NAME = "meta.json"

__all__ = [
    "StaleCacheError",
    "FeatureCache",
    "example_targets",
    "compress_logits",
    "expand_logits",
    "target_fingerprint",
    "dataset_fingerprint",
    "vocab_fingerprint",
]


class StaleCacheError(InputError):
    """A feature cache built for another dataset, target or draft vocabulary, or whose meta.json is unreadable."""


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StaleCacheError(f"{path} cannot be read ({exc}): delete the feature cache {path.parent} to rebuild it, "
                              "or point features.cache_dir elsewhere") from None
    if not isinstance(meta, dict):
        raise StaleCacheError(f"{path} is not a feature cache's meta.json: delete {path.parent} to rebuild it")
    return meta


# ----------------------------------------------------------------------------- what the loss needs


@torch.no_grad()
def example_targets(target, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One example (T,) -> (features (T, 3H) in the target dtype, logits (T, V) float32).

    A causal forward of the example alone (a fresh cache that is then dropped), the function both the
    online and the cached paths use.
    """
    out = target.forward(input_ids.reshape(1, -1), target.new_cache())
    return out.features[0], out.logits[0]


def compress_logits(logits: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor):
    """logits (..., V) float32 -> (draft-vocabulary columns (..., Vd) float32, top token in draft (...,) bool)."""
    return logits[..., draft_ids.to(logits.device)].float(), t2d.to(logits.device)[logits.argmax(-1)]


def expand_logits(draft_logits: torch.Tensor, top_in_draft: torch.Tensor, draft_ids: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`compress_logits` as far as the loss can tell: (..., Vd), (...,) -> (..., V).

    The draft columns hold the stored values, the others ``-inf``; where the target's top token was
    outside the draft vocabulary, one outside column is ``+inf`` so ``argmax`` lands outside too.
    """
    device = draft_logits.device
    full = torch.full((*draft_logits.shape[:-1], vocab_size), float("-inf"), device=device)
    full[..., draft_ids.to(device)] = draft_logits.float()
    if not bool(top_in_draft.all()):
        outside = torch.ones(vocab_size, dtype=torch.bool, device=device)
        outside[draft_ids.to(device)] = False
        col = int(outside.nonzero()[0])
        full[..., col] = torch.where(top_in_draft, full[..., col], torch.full_like(full[..., col], float("inf")))
    return full


# ----------------------------------------------------------------------------- fingerprints


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def target_fingerprint(target) -> str:
    """Hash of the target's config (without private / version fields), feature layers, dtype and
    weights. Weights enter through every tensor's name, shape, dtype, float64 sum and a strided sample
    of up to 65,536 values, so any training of the weights changes it without reading all bytes twice."""
    config = {k: v for k, v in target.model.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "name_or_path")}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(json.dumps([list(target.feature_layers), str(target.dtype)]).encode())
    tensors = dict(target.model.named_parameters())
    tensors.update(dict(target.model.named_buffers()))  # packed weight copies are attributes, not buffers
    for name in sorted(tensors):
        t = tensors[name].detach()
        flat = t.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 65536)].float().cpu().numpy()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}{float(t.sum(dtype=torch.float64))!r}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()



def dataset_fingerprint(examples) -> str:
    """Hash of every example's ``input_ids`` and ``loss_mask``, in order."""
    h = hashlib.sha256()
    for ids, mask in iter_token_columns(examples):
        _hash_example(h, ids, mask)
    return h.hexdigest()


def _hash_example(h, ids, mask) -> None:
    ids = np.asarray(ids, dtype=np.int64)
    h.update(np.int64(len(ids)).tobytes())
    h.update(ids.tobytes())
    h.update(np.asarray(mask, dtype=np.int8).tobytes())


def shard_hashes(examples, examples_per_shard: int) -> list[str]:
    """Per shard of ``examples_per_shard`` examples, a hash of its examples' ``input_ids`` and ``loss_mask``
    (as :func:`dataset_fingerprint` hashes them) and of its first example's index."""
    hashes, h = [], None
    for i, (ids, mask) in enumerate(iter_token_columns(examples)):
        if i % examples_per_shard == 0:
            if h is not None:
                hashes.append(h.hexdigest())
            h = hashlib.sha256(np.int64(i).tobytes())
        _hash_example(h, ids, mask)
    if h is not None:
        hashes.append(h.hexdigest())
    return hashes


def vocab_fingerprint(draft_ids: torch.Tensor) -> str:
    return _sha(torch.as_tensor(draft_ids).long().numpy().tobytes())


# ----------------------------------------------------------------------------- the cache


def _example_ids(examples, i: int) -> torch.Tensor:
    return torch.as_tensor(examples[int(i)]["input_ids"], dtype=torch.long)


class FeatureCache:
    """A folder of safetensors shards holding, per example, features and draft-vocabulary logits.

    ``FeatureCache.build(...)`` writes (or finishes) it; ``FeatureCache.open(folder, fingerprint)``
    reads it back, refusing a stale one; ``cache.get(i)`` gives the stored parts (the trainer pads them into
    ``DraftTargets``), ``cache.targets(i)`` the full-vocabulary form of what :func:`example_targets` gave.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        meta_path = self.directory / META_NAME
        if not meta_path.is_file():
            raise FileNotFoundError(f"no feature cache at {self.directory} (no {META_NAME})")
        self.meta = _read_meta(meta_path)
        if self.meta.get("format") != FORMAT_VERSION:
            raise StaleCacheError(f"feature cache {self.directory} has format {self.meta.get('format')}, "
                                  f"this version reads format {FORMAT_VERSION}; rebuild it")
        self.draft_ids = torch.tensor(self.meta["draft_ids"], dtype=torch.long)
        self.vocab_size = int(self.meta["vocab_size"])
        self._handles: OrderedDict[int, object] = OrderedDict()

    # ------------------------------------------------------------------ building
    @staticmethod
    def fingerprint(target, examples, draft_ids: torch.Tensor) -> dict:
        return {"dataset": dataset_fingerprint(examples), "target": target_fingerprint(target),
                "draft_vocab": vocab_fingerprint(draft_ids)}

    @classmethod
    def build(
        cls,
        directory: str | os.PathLike,
        target,
        examples,
        draft_ids: torch.Tensor,
        examples_per_shard: int = 256,
        rank: int = 0,
        world_size: int = 1,
        fingerprint: dict | None = None,
        barrier: Callable[[], None] = lambda: None,
        progress: bool = False,
        reuse_from: Sequence[str | os.PathLike] = (),
    ) -> FeatureCache:
        """Write the shards this rank owns that are missing; return the cache once all ranks are done.

        ``barrier`` synchronises the ranks (``accelerator.wait_for_everyone``); rank 0 writes
        ``meta.json`` first. A folder with another fingerprint raises :class:`StaleCacheError`. Shards
        that ``reuse_from`` caches hold for the same examples are linked, not computed (see the module).
        """
        return cls.build_many([(directory, draft_ids)], target, examples, examples_per_shard, rank, world_size,
                              [fingerprint], barrier, progress, reuse_from)[0]

    @classmethod
    def build_many(
        cls,
        caches: Sequence[tuple[str | os.PathLike, torch.Tensor]],
        target,
        examples,
        examples_per_shard: int = 256,
        rank: int = 0,
        world_size: int = 1,
        fingerprints: Sequence[dict | None] | None = None,
        barrier: Callable[[], None] = lambda: None,
        progress: bool = False,
        reuse_from: Sequence[str | os.PathLike] = (),
    ) -> list[FeatureCache]:
        """:meth:`build` for several draft vocabularies of one target and dataset, ``caches`` being
        (folder, draft_ids) pairs: each example's target forward runs once and feeds every cache that lacks
        its shard (the forward is the cost; the caches differ only in which logit columns they keep)."""
        fingerprints = list(fingerprints or [None] * len(caches))
        memo: dict[int, list[str]] = {}

        def hashes(per: int) -> list[str]:
            if per not in memo:
                memo[per] = shard_hashes(examples, per)
            return memo[per]

        plans = []  # (directory, sorted ids, t2d, examples per shard, shards this rank writes)
        n = len(examples)
        for (directory, draft_ids), fingerprint in zip(caches, fingerprints, strict=True):
            directory = Path(directory)
            draft_ids = torch.as_tensor(draft_ids).long().sort().values
            fingerprint = fingerprint or cls.fingerprint(target, examples, draft_ids)
            meta = {
                "format": FORMAT_VERSION, "fingerprint": fingerprint, "num_examples": n,
                "examples_per_shard": examples_per_shard, "num_shards": -(-n // examples_per_shard),
                "feature_size": 3 * target.hidden_size, "feature_dtype": str(target.dtype).removeprefix("torch."),
                "vocab_size": target.vocab_size, "draft_ids": draft_ids.tolist(),
            }
            if rank == 0:  # an existing meta.json (and its shard size) wins; every rank checks it below
                directory.mkdir(parents=True, exist_ok=True)
                meta_path = directory / META_NAME
                if not meta_path.is_file():
                    meta["shard_hashes"] = hashes(examples_per_shard)
                    write_bytes(meta_path, (json.dumps(meta, indent=1) + "\n").encode())
                else:  # written before shards had hashes: add them if the cache is this dataset's
                    old = _read_meta(meta_path)
                    if "shard_hashes" not in old and old.get("fingerprint") == fingerprint:
                        old["shard_hashes"] = hashes(old["examples_per_shard"])
                        write_bytes(meta_path, (json.dumps(old, indent=1) + "\n").encode())
            plans.append([directory, draft_ids, fingerprint])
        barrier()
        sources = [_ReuseSource.read(Path(d)) for d in reuse_from]
        reused = 0
        for plan in plans:
            directory, draft_ids, fingerprint = plan
            meta = _read_meta(directory / META_NAME)
            _check_fingerprint(directory, meta, fingerprint)  # all ranks raise together on a stale cache
            t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
            t2d[draft_ids] = True
            per = meta["examples_per_shard"]
            mine = {s for s in range(meta["num_shards"]) if s % world_size == rank
                    and not (directory / _shard_name(s)).is_file()}
            for s in sorted(mine):
                source = next((src for src in sources if src.holds(meta, s)), None)
                if source is not None:
                    _link_or_copy(source.directory / _shard_name(s), directory / _shard_name(s))
                    mine.discard(s)
                    reused += 1
            plan[2:] = [t2d, per, mine]
        if reused:  # said whether or not bars are shown: the log should tell what was not computed
            print(f"[feature cache] rank {rank}: {reused} shards taken from {', '.join(map(str, reuse_from))}",
                  flush=True)
        # caches of one shard size share each shard's forwards; a cache of another size builds on its own
        jobs: dict[tuple[int, int], list] = {}
        for directory, draft_ids, t2d, per, mine in plans:
            for s in mine:
                jobs.setdefault((per, s), []).append((directory / _shard_name(s), draft_ids, t2d))
        bar = None
        if progress and jobs:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(jobs), desc=f"feature cache (rank {rank})", unit="shard")
        for (per, s), outputs in sorted(jobs.items()):
            _write_shards(outputs, target, examples, range(s * per, min((s + 1) * per, n)))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        barrier()
        built = []
        for directory, *_ in plans:
            cache = cls(directory)
            missing = cache.missing_shards()
            if missing:
                raise RuntimeError(f"feature cache {directory} is missing shards {missing[:5]} after building")
            built.append(cache)
        return built

    @classmethod
    def open(cls, directory: str | os.PathLike, fingerprint: dict | None = None) -> FeatureCache:
        """A complete cache; with ``fingerprint``, one built for exactly that data, target and vocabulary."""
        cache = cls(directory)
        if fingerprint is not None:
            _check_fingerprint(cache.directory, cache.meta, fingerprint)
        missing = cache.missing_shards()
        if missing:
            raise RuntimeError(f"feature cache {directory} is incomplete ({len(missing)} shards missing); "
                               "build it again to finish it")
        return cache

    def missing_shards(self) -> list[int]:
        return [s for s in range(self.meta["num_shards"]) if not (self.directory / _shard_name(s)).is_file()]

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return int(self.meta["num_examples"])

    def _shard(self, s: int):
        from safetensors import safe_open

        if s not in self._handles:
            handle = safe_open(str(self.directory / _shard_name(s)), framework="pt")
            self._handles[s] = (handle, handle.get_tensor("offsets"))
            if len(self._handles) > 8:
                self._handles.popitem(last=False)
        self._handles.move_to_end(s)
        return self._handles[s]

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Example ``i``: (features (T, 3H), draft_logits (T, Vd) float32, top_in_draft (T,) bool)."""
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} is outside the cache of {len(self)} examples")
        s, j = divmod(int(i), self.meta["examples_per_shard"])
        handle, offsets = self._shard(s)
        a, b = int(offsets[j]), int(offsets[j + 1])
        return (handle.get_slice("features")[a:b], handle.get_slice("draft_logits")[a:b],
                handle.get_slice("top_in_draft")[a:b])

    def targets(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Example ``i`` as :func:`example_targets` returns it: (features (T, 3H), logits (T, V) float32)."""
        features, draft_logits, top_in_draft = self.get(i)
        return features, expand_logits(draft_logits, top_in_draft, self.draft_ids, self.vocab_size)


class _ReuseSource:
    """A cache whose shards another build may take: its folder and meta.json (None when unreadable)."""

    def __init__(self, directory: Path, meta: dict | None):
        self.directory, self.meta = directory, meta

    @classmethod
    def read(cls, directory: Path) -> _ReuseSource:
        if not (directory / META_NAME).is_file():
            raise InputError(f"features.reuse_from names {directory}, which is not a feature cache (no {META_NAME}); "
                             "give the folder of an earlier cache (its features.cache_dir) or drop it")
        try:
            return cls(directory, _read_meta(directory / META_NAME))
        except StaleCacheError:
            return cls(directory, None)

    def holds(self, meta: dict, s: int) -> bool:
        """Whether shard ``s`` here is byte for byte the shard ``s`` of a cache with ``meta``."""
        mine = self.meta
        if mine is None or mine.get("format") != FORMAT_VERSION:
            return False
        keys = ("examples_per_shard", "feature_size", "feature_dtype", "vocab_size", "draft_ids")
        if any(mine.get(k) != meta.get(k) for k in keys):
            return False
        theirs, ours = mine.get("fingerprint", {}), meta.get("fingerprint", {})
        if any(theirs.get(k) is None or theirs.get(k) != ours.get(k) for k in ("target", "draft_vocab")):
            return False
        a, b = mine.get("shard_hashes") or [], meta.get("shard_hashes") or []
        return s < len(a) and s < len(b) and a[s] == b[s] and (self.directory / _shard_name(s)).is_file()


def _link_or_copy(src: Path, dst: Path) -> None:
    """``src`` at ``dst`` atomically: a hard link where the file system allows, else a copy."""
    with atomic_file(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)


def _shard_name(s: int) -> str:
    return f"shard-{s:05d}.safetensors"


def _check_fingerprint(directory: Path, meta: dict, fingerprint: dict) -> None:
    stored = meta.get("fingerprint", {})
    changed = sorted(k for k in set(stored) | set(fingerprint) if stored.get(k) != fingerprint.get(k))
    if changed:
        raise StaleCacheError(
            f"feature cache {directory} was built for another {', '.join(changed)} (fingerprint mismatch); "
            "delete it or point the cache elsewhere (features.cache_dir=...)"
        )


def _write_shards(outputs: Sequence[tuple[Path, torch.Tensor, torch.Tensor]], target, examples,
                  indices: Sequence[int]) -> None:
    """One shard (examples ``indices``) into every (path, draft_ids, t2d) of ``outputs``, one forward each."""
    from safetensors.torch import save_file

    features, offsets = [], [0]
    columns: list[tuple[list, list]] = [([], []) for _ in outputs]
    for i in indices:
        f, z = example_targets(target, _example_ids(examples, i))
        features.append(f.cpu())
        offsets.append(offsets[-1] + f.shape[0])
        for (_, draft_ids, t2d), (logits, flags) in zip(outputs, columns, strict=True):
            d, top = compress_logits(z, draft_ids, t2d)
            logits.append(d.cpu())
            flags.append(top.cpu())
    shared = {"features": torch.cat(features).contiguous(), "offsets": torch.tensor(offsets, dtype=torch.long),
              "example_ids": torch.tensor(list(indices), dtype=torch.long)}
    for (path, _, _), (logits, flags) in zip(outputs, columns, strict=True):
        tensors = {**shared, "draft_logits": torch.cat(logits).contiguous(),
                   "top_in_draft": torch.cat(flags).contiguous()}
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": str(FORMAT_VERSION)})
