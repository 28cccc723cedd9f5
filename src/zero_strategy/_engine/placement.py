"""Where an engine's state goes: the compute device, the host-copy machinery and this rank's
NVMe store (how big its swap file gets, how many staging slots it needs)."""

from __future__ import annotations

import torch
from torch import nn

from .._comm.collectives import Collectives
from .._config.policies import NVMeOffload
from .._mechanisms.nvme import NVMeStore
from .._mechanisms.transfers import Transfers


def offload_services(model: nn.Module, config, comm: Collectives, device: torch.device
                     ) -> tuple[Transfers, NVMeStore | None]:
    """The host<->device copies (pinned unless a policy says otherwise), and this rank's NVMe
    store when a policy puts state on NVMe (its swap space reserved now: a small disk fails here)."""
    policies = [p for p in (config.offload_optimizer, config.offload_params) if p is not None]
    transfers = Transfers(device, pin_memory=all(p.pin_memory for p in policies))
    nvme = next((p for p in policies if isinstance(p, NVMeOffload)), None)
    if nvme is None:
        return transfers, None
    return transfers, NVMeStore(nvme, comm.rank, pin=transfers.pin,
                                needed_bytes=swap_bytes(model, config, comm.world_size),
                                working_set=transfers.working_set)


def size_swap_pool(swap: NVMeStore, units, prefetch: int) -> None:
    """Every unit whose gather is in flight (this one, ``prefetch`` ahead, the root) holds a
    staging slot per NVMe group until its upload, beside the step's read-ahead and write-backs:
    with fewer slots than that the gathering thread waits on itself."""
    per_unit = max((len(u.sharded_groups) for u in units), default=0)
    swap.pool.grow_to((prefetch + 2) * per_unit + swap.policy.read_ahead + 4)


def swap_bytes(model: nn.Module, config, world_size: int) -> int:
    """Bytes this rank's swap file will hold: fp32 master + up to two fp32 moments per trainable
    element (Adam), and the compute-dtype parameter shard; checked against free space up front."""
    unique = {id(p): p for p in model.parameters() if p.is_floating_point()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    everything = sum(p.numel() for p in unique)
    total = 0
    if isinstance(config.offload_optimizer, NVMeOffload):
        total += 12 * trainable
    if isinstance(config.offload_params, NVMeOffload):
        total += config.compute_dtype.itemsize * everything
    return total // world_size + 64 * 2**20  # + alignment and per-region rounding


def single_device(model: nn.Module, requested: torch.device | None) -> torch.device:
    """The compute device: the parameters' (one), or for a meta-device model the requested
    device, else the current CUDA device, else the CPU."""
    devices = {p.device for p in model.parameters() if not p.is_meta}
    has_meta = any(p.is_meta for p in model.parameters())
    if not devices and not has_meta:
        raise ValueError("zero_strategy.setup: the model has no parameters to shard")
    if len(devices) > 1:
        raise ValueError(
            f"zero_strategy.setup: the model's parameters are on several devices {sorted(map(str, devices))}; "
            "move the whole model to one device (model.to(device)) before setup")
    if devices:
        device = devices.pop()
        if requested is not None and torch.device(requested) != device:
            raise ValueError(f"zero_strategy.setup: device={requested} but the model's parameters are on "
                             f"{device}; move the model or drop the device argument")
        return device
    if requested is not None:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
