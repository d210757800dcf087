"""FSDP on CPU processes: torch's ``fully_shard`` where accelerate would quietly use DDP instead.

accelerate 1.15 applies an FSDP request (``accelerate launch --use_fsdp``, i.e. ``ACCELERATE_USE_FSDP=true``)
only on accelerators; with several CPU processes (gloo) it keeps ``MULTI_CPU`` and wraps the module in
DDP. torch's FSDP2, ``torch.distributed.fsdp.fully_shard``, runs on CPU with gloo (torch 2.13), so when
FSDP is requested and accelerate's state is multi-CPU the training loop shards the head itself
(:func:`shard`, before the optimiser sees the parameters) instead of ``accelerate.prepare``. The rest of
the loop is unchanged: the full state dict for checkpoints, evaluation and the final head comes from
:func:`full_state_dict` (gathered on the main process), and a sharded run keeps one optimiser shard per
rank in each checkpoint (:func:`is_sharded`), as accelerate's FSDP does on GPUs.
"""

from __future__ import annotations

import os

from torch import nn

__all__ = ["cpu_fsdp_requested", "shard", "is_sharded", "full_state_dict"]


def cpu_fsdp_requested(acc) -> bool:
    """FSDP was asked for, the processes run on CPU, and there are several of them."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return asked and acc.distributed_type.name == "MULTI_CPU" and acc.num_processes > 1


def shard(module: nn.Module) -> nn.Module:
    """Shard every parameter of ``module`` across the processes (FSDP2, one group: the head is one
    decoder layer), in place; frozen parameters (the token embedding) are sharded too."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module)
    return module


def _is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule  # public from torch 2.6 on
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def is_sharded(acc, module: nn.Module) -> bool:
    """Whether parameters and optimiser state are split across processes (accelerate's FSDP or :func:`shard`)."""
    return acc.distributed_type.name == "FSDP" or _is_fsdp2(module)


def full_state_dict(acc, module: nn.Module) -> dict:
    """The full state dict of the training module on the main process (every process must call it:
    sharded parameters are gathered); other processes get an empty or partial dict."""
    if not _is_fsdp2(module):
        return acc.get_state_dict(module)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
