"""Files written with ``torch.save`` (training states, optimiser shards, the reference builder's
checkpoints), read without running code: ``torch.load(weights_only=True)`` builds tensors, numbers,
strings, lists, tuples and dicts only. Checkpoints of earlier versions hold numpy's RNG state as an
array, so numpy's array reconstruction (which builds arrays, nothing else) is allowed too. Anything
else in a file (a pickled object whose reduction would call a function) is refused unread."""

from __future__ import annotations

from pathlib import Path

from eagle_tree.utils.checks import InputError

__all__ = ["StateFileError", "read_state"]


class StateFileError(InputError):
    """A state file that cannot be read safely: foreign objects, truncated, or not a state dict."""


def _numpy_array_globals() -> list:
    """What numpy's array pickles reference: the reconstruction function, ndarray and dtypes (no code)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    import numpy as np

    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64)]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


TRAINING_FIX = ("resume from a checkpoint written by eagle-tree train (resume=PATH), or start a new run "
                "(model.init_from=FOLDER loads a head's safetensors weights only)")


def read_state(path: Path, what: str = "training state", fix: str = TRAINING_FIX) -> dict:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and containers only (and numpy
    arrays, which checkpoints of earlier versions hold). Anything else, a file torch cannot read, or a
    file that is not a dict raises :class:`StateFileError` naming the file and ``fix``; nothing in it runs."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        detail = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), "")
        raise StateFileError(
            f"{path} holds objects a {what} never contains ({detail or 'a foreign pickle'}); it was refused "
            f"unread, since loading it could run code: {fix}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        reason = str(exc).split(". ")[0].splitlines()[0] if str(exc) else exc.__class__.__name__
        raise StateFileError(
            f"{path} cannot be read as a {what} ({reason}): it is truncated or not such a file; {fix}") from None
    if not isinstance(state, dict):
        raise StateFileError(f"{path} holds a {type(state).__name__}, not a {what}: {fix}")
    return state
