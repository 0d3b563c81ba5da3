"""Data-parallel plumbing of the training loop: the device, the process group of a ``torchrun`` launch,
collectives that keep the ranks in step, DDP/FSDP2 wrapping and full (unsharded) state dicts."""

from __future__ import annotations

import warnings

import math
import os
from dataclasses import dataclass

import torch

from fastweights.core.errors import UserError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but CUDA is not available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}") from None


@dataclass
class Dist:
    """Where this process sits in a ``torchrun`` launch (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """Join the process group that ``torchrun`` describes in the environment (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), resolve_device(device_name)
    import torch.distributed as td

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not td.is_initialized():
        td.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world, local_rank), device


def close_distributed(dist: Dist) -> None:
    """Leave the process group. Exiting without this can abort a rank at interpreter shutdown (gloo's
    threads are torn down under it: "terminate called without an active exception", exit -6)."""
    if dist.world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def barrier(dist: Dist) -> None:
    if dist.world > 1:
        torch.distributed.barrier()


def all_mean(value: float, dist: Dist, device) -> float:
    if dist.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.item() / dist.world


def wrap_model(model, dist: Dist, device, fsdp: bool):
    """DDP, or FSDP2 (``fully_shard`` per block, then the root) with ``fsdp``; the plain model on one process."""
    if dist.world == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        # FSDP2 warns once per process that a wrapped module "returned a view tensor": the returned state (KV-cache
        # slices, last RNN steps) and the FWL head's logits are views; training back-propagates only the loss and
        # drops or detaches the state, so the warning never applies here (docs/huggingface-and-scale.md)
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def full_state(model, optimizer):
    """Unsharded model and optimizer state dicts on the CPU (same format for 1 process, DDP and FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model, optimizer, model_sd, optim_sd) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))


def from_rank0(flags: list[bool], dist: Dist, device) -> list[bool]:
    """Rank 0's flags on every rank (ranks agree on when a time budget ends or a signal stops the run)."""
    return [bool(v) for v in values_from_rank0([1.0 if f else 0.0 for f in flags], dist, device)]


def values_from_rank0(values: list[float], dist: Dist, device) -> list[float]:
    """Rank 0's numbers on every rank (the learning rate of a step that a time budget schedules, in float64)."""
    if dist.world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.broadcast(t, src=0)
    return t.tolist()


def all_finite(params, dist: Dist, device) -> bool:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    ok = bool(torch.stack(torch._foreach_norm([t.detach() for t in local], ord=math.inf)).isfinite().all())
    if dist.world > 1:
        t = torch.tensor([0.0 if ok else 1.0], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        ok = t.item() == 0
    return ok
