"""Where a flat group's shards rest: one storage class per offload policy.

Two things of a flat group can live off the compute device, independently:

* the **parameter shard** (stage 3: the compute-dtype slice each rank keeps between
  uses, the input of the all-gather): :class:`DeviceParamShard` (on the device),
  :class:`HostParamShard` (pinned host memory, uploaded as part of the gather),
  :class:`NVMeParamShard` (the swap file, read when the gather is started);
* the **fp32 master** with the optimizer state and the step: :class:`DeviceMaster`
  (the step runs on the device), :class:`HostMaster` (pinned host memory, the step
  runs on the CPU on a downloaded copy of the gradient shard), :class:`NVMeMaster`
  (the swap file, resident only while the step or a checkpoint touches it).

The group and the optimizer call the same methods whatever the policy, so no
caller asks "is this offloaded?". ``make_storage`` is the one place the config's
policies become classes.

[Note: the master aliases the parameters]
With an fp32 compute dtype the master *is* the resting parameter shard whenever
both rest in the same memory (device step on a device shard, a host step on a host
shard, or any step on a CUDA-less machine, where "device" and "host" are both the
CPU's memory), so fp32 training holds no second copy and a step needs no copy back.
NVMe swaps the two apart. On a CUDA-less machine the offloaded path stays the one
a GPU takes (worker thread, pipelined per group, staging and casts where the dtypes
differ); only copies between two places of the same memory are skipped: they cost
a third of an fp32 AdamW step's memory traffic and moved nothing anywhere.

[Note: host gradients in place]
A ``HostMaster`` steps on a host copy of the reduced gradient shard, downloaded while
backward goes on. The copy keeps the shard's dtype (the reduce dtype: bf16 under
``precision="bf16"``): half the PCIe bytes and half the host memory of an fp32 copy,
and the same values, since the cast to fp32 is exact whenever it happens. When the
shard already is in host memory (a CUDA-less machine) the copy would be byte for byte
the shard: the step reads the shard itself, as ``DeviceMaster`` does.

[Note: fp32 gradients only for the groups being stepped]
The optimizer needs an fp32 ``.grad`` beside the fp32 master. Cast for every group at
once, a low-precision run would hold 4 bytes per parameter of this rank's shard on top of
the reduced gradients (0.5 W at N=2, the largest single piece of an NVMe run's memory).
So the cast happens per step batch (``grad_for_step``: one batch of groups, released
after its optimizer call, _optim/optimizer.py) or per chunk of a streamed group
(``grad_source`` and ``fp32_grad``, _optim/chunked_step.py): what a rank holds in fp32
gradients is bounded by a batch or a chunk, never the model.
"""

from __future__ import annotations

import torch
from torch import nn

from .._config.policies import NVMeOffload, OffloadPolicy
from .._mechanisms import nvme_stream
from .._mechanisms.transfers import HOST, Transfers


def fp32_grad(grad: torch.Tensor | None, dtype: torch.dtype = torch.float32,
              out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``grad`` (or a chunk of it) as the master's dtype: itself when it already is, else a copy
    (into ``out`` when given: See [Note: the step's casts reuse their buffers] in
    _mechanisms/cast_scratch.py). See [Note: fp32 gradients only for the groups being stepped]."""
    if grad is None or grad.dtype == dtype:
        return grad
    if out is None:
        return grad.to(dtype)
    return out.view(grad.shape).copy_(grad)


# ------------------------------------------------------------------ parameter shard
class DeviceParamShard:
    """The resting parameter shard on the compute device (stages 1-2: the own slice of ``full``)."""

    on_host = False

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # [shard] compute dtype

    def prefetch(self) -> None:
        """Start bringing the shard next to the device (only NVMe has anything to start)."""

    @property
    def needs_deferred_gather(self) -> bool:
        return False

    def gather_source(self, own: torch.Tensor, transfers: Transfers) -> torch.Tensor:
        """The tensor to all-gather from; ``own`` is this rank's slot of the full buffer."""
        if self.tensor.untyped_storage().nbytes() == 0:  # a last guard: never read freed memory
            raise RuntimeError("zero_strategy: a gather of parameters that offload_states moved to the host; "
                               "call zero_strategy.reload_states(model) first")
        return self.tensor

    def take_master(self, master: torch.Tensor, transfers: Transfers, start: int = 0):
        """shard[start:start + master.numel()] <- master (cast; ``start``: a chunk of a streamed
        step). Returns an upload event to ``wait()`` or None."""
        dst = self.tensor[start:start + master.numel()]
        if master.device != dst.device:  # host master: cast on the host, half the PCIe bytes
            return transfers.upload_cast(dst, master)
        dst.copy_(master)
        return None


class HostParamShard(DeviceParamShard):
    """The shard rests in (pinned) host memory and is uploaded into its slot as part of the gather."""

    on_host = True

    def gather_source(self, own: torch.Tensor, transfers: Transfers) -> torch.Tensor:
        transfers.upload(own, self.tensor).wait()
        return own

    def take_master(self, master: torch.Tensor, transfers: Transfers, start: int = 0):
        self.tensor[start:start + master.numel()].copy_(master)  # both on the host: cast in place, no upload
        return None


class NVMeParamShard(HostParamShard):
    """The shard rests in the swap file; a gather reads it (started at prefetch), uploads, evicts."""

    def __init__(self, tensor: torch.Tensor, swap, owner):
        super().__init__(tensor)
        self.swap, self.owner = swap, owner
        self.numel = tensor.numel()  # the tensor's .data is empty while evicted
        swap.adopt(owner, "param", {"param": tensor})

    @property
    def needs_deferred_gather(self) -> bool:
        # the disk read starts now; upload and all-gather follow when the unit is waited for,
        # in the same order on every rank
        return True

    def prefetch(self) -> None:
        self.swap.prefetch(self.owner, "param")

    def gather_source(self, own: torch.Tensor, transfers: Transfers) -> torch.Tensor:
        if self.swap.streamed(self.owner, "param"):  # See [Note: bounded staging] in _mechanisms/nvme_stream.py
            chunk = nvme_stream.chunk_elems(self.swap.pool.slot_bytes, own.element_size(), own.numel())
            for a, b, views in nvme_stream.stream(self.swap, self.owner, "param", chunk, write=False):
                transfers.upload(own[a:b], views["param"]).synchronize()  # the slot is reused next
            return own
        self.swap.swap_in(self.owner, "param")
        uploaded = transfers.upload(own, self.tensor)
        uploaded.wait()
        uploaded.synchronize()  # the host slot is reused once evicted
        self.swap.swap_out(self.owner, "param", write=False)
        return own

    def take_master(self, master: torch.Tensor, transfers: Transfers, start: int = 0):
        whole_in_slot = self.swap.in_slot(self.owner, "param")  # inside resident(): written back with it
        if master.numel() != self.numel or (self.swap.streamed(self.owner, "param") and not whole_in_slot):
            # a chunk of a streamed step, or a shard larger than a slot: chunk by chunk, never whole
            nvme_stream.write_from(self.swap, self.owner, "param", "param", master, start)
            return None
        self.swap.swap_in(self.owner, "param", read=False)  # overwritten whole: reading it back is waste
        self.tensor.copy_(master)
        self.swap.swap_out(self.owner, "param", write=True, wait=False)
        return None


# --------------------------------------------------------------------------- master
class DeviceMaster:
    """fp32 master shard next to the gradients; the optimizer steps it on the device."""

    steps_on_host = False
    #: the step may run in one optimizer call with other groups' (see [Note: step batches])
    steps_together = True
    #: the step goes chunk by chunk (a swap set larger than a staging slot: NVMe only)
    streams = False

    def __init__(self, master: nn.Parameter, aliases_params: bool):
        self.master = master
        #: the master shares storage with the parameter shard: no copy after a step
        self.aliases_params = aliases_params

    def on_grad_reduced(self, grad_shard: torch.Tensor, version: int) -> None:
        """A reduce finished (``version`` counts changes to the shard): start moving it if needed."""

    def grad_source(self, grad_shard: torch.Tensor | None, version: int) -> torch.Tensor | None:
        """The reduced gradient next to the master, in the reduce dtype (no fp32 copy yet)."""
        return grad_shard

    def grad_for_step(self, grad_shard: torch.Tensor | None, version: int,
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The fp32 gradient the optimizer sees, next to the master (aliases the shard when it
        can). A cast is a copy of the whole group (into ``out`` when given): See [Note: fp32
        gradients only for the groups being stepped]."""
        return fp32_grad(self.grad_source(grad_shard, version), self.master.dtype, out)

    def drop_grad(self) -> None:
        self.master.grad = None

    def free(self) -> None:
        """Teardown: drop everything besides the master itself."""
        self.drop_grad()

    def prefetch(self) -> None:
        """Start reading the state the next step needs (only NVMe has anything to read)."""

    def cancel_prefetch(self) -> None:
        """A ``prefetch`` whose step will not come (the group got no gradient): give it up."""

    def begin_step(self) -> None:
        """Make master and optimizer state resident for the step."""

    def end_step(self, optimizer_state: dict) -> None:
        """The step is done: keep (or swap out) master and the state the optimizer built."""

    def abort_step(self) -> None:
        """The step raised: release what ``begin_step`` took, writing nothing back."""

    def track_optimizer_state(self, optimizer_state: dict, replace: bool = False) -> None:
        """The optimizer built (``replace``: rebuilt, e.g. by a checkpoint load) its state for
        this master; it rests where the master does."""

    def attach_views(self, views: list[tuple[torch.Tensor, slice, torch.Size]]) -> None:
        """Ownership layout: ``views`` (tensor, where, shape) view the master per parameter."""
        for t, where, shape in views:
            t.data = self.master.data[where].view(shape)

    def held_tensors(self) -> list[tuple[str, bool, torch.Tensor]]:
        return [] if self.aliases_params else [("master", self.steps_on_host, self.master.data)]


class HostMaster(DeviceMaster):
    """fp32 master and optimizer state in (pinned) host memory; the step runs on the CPU.

    Each finished reduce starts downloading the gradient shard into ``host_grad`` on
    the D2H stream while backward goes on (see [Note: the offloaded step overlaps in
    three places] in _mechanisms/transfers.py); the step waits for that download only.
    ``host_grad`` keeps the shard's dtype: See [Note: host gradients in place].
    """

    steps_on_host = True

    def __init__(self, master: nn.Parameter, aliases_params: bool, transfers: Transfers):
        super().__init__(master, aliases_params)
        self.transfers = transfers
        self.host_grad: torch.Tensor | None = None  # [shard] the reduce dtype
        self._download = None
        self._downloaded_version = -1

    @staticmethod
    def _reads_in_place(grad_shard: torch.Tensor) -> bool:
        """See [Note: host gradients in place]."""
        return grad_shard.device.type == HOST.type

    def on_grad_reduced(self, grad_shard: torch.Tensor, version: int) -> None:
        if self._reads_in_place(grad_shard):
            return
        if self.host_grad is None or self.host_grad.dtype != grad_shard.dtype:
            self.host_grad = self.transfers.host_empty(grad_shard.numel(), grad_shard.dtype)
        self._download = self.transfers.download(self.host_grad, grad_shard)
        self._downloaded_version = version

    def grad_source(self, grad_shard: torch.Tensor | None, version: int) -> torch.Tensor | None:
        if grad_shard is None:
            return None
        if self._reads_in_place(grad_shard):  # See [Note: host gradients in place]
            return grad_shard
        if self._downloaded_version != version:  # changed since the last download (or never downloaded)
            self.on_grad_reduced(grad_shard, version)
        self._download.synchronize()
        return self.host_grad

    def drop_grad(self) -> None:
        super().drop_grad()
        self._download, self._downloaded_version = None, -1

    def free(self) -> None:
        self.drop_grad()
        self.host_grad = None

    def held_tensors(self) -> list[tuple[str, bool, torch.Tensor]]:
        out = super().held_tensors()
        if self.host_grad is not None:
            out.append(("grads", True, self.host_grad))
        return out


class NVMeMaster(HostMaster):
    """Master and optimizer state rest in the swap file and visit a host slot for each step."""

    steps_together = False  # a few host slots: groups step one at a time, reading ahead

    def __init__(self, master: nn.Parameter, transfers: Transfers, swap, owner):
        super().__init__(master, aliases_params=False, transfers=transfers)
        self.swap, self.owner = swap, owner
        self.numel = master.numel()  # the master's .data is empty while evicted
        swap.adopt(owner, "opt", {"master": master})

    def prefetch(self) -> None:
        if not self.streams:  # a streamed set is read chunk by chunk in its step, not ahead of it
            self.swap.prefetch(self.owner, "opt")

    @property
    def streams(self) -> bool:
        """Master and state (AdamW's 12 bytes per element, before its state exists) are larger
        than a staging slot: the step streams them. See [Note: bounded staging]."""
        return self.swap.streamed(self.owner, "opt", planned_bytes=12 * self.numel)

    def stream(self, fresh: bool):
        """The chunks of master and optimizer state, as ``nvme_stream.stream`` yields them;
        ``fresh``: the optimizer has no state yet, so only the master is read."""
        chunk = nvme_stream.chunk_elems(self.swap.pool.slot_bytes, 12, self.numel)
        return nvme_stream.stream(self.swap, self.owner, "opt", chunk, read_keys={"master"} if fresh else None)

    def swapped_state(self) -> set[str]:
        """The optimizer state keys that rest in the swap file beside the master."""
        return {k[len("state."):] for k in self.swap.keys(self.owner, "opt") if k.startswith("state.")}

    def keep_state_chunk(self, key: str, tensor: torch.Tensor, start: int, views: dict) -> None:
        """A streamed first step created ``tensor``: elements [start, ...) of state ``key``."""
        name = f"state.{key}"
        nvme_stream.register(self.swap, self.owner, "opt", name, tensor, self.numel)
        if name in views:
            views[name].copy_(tensor)  # written back with the chunk
        else:  # its chunk was read before the key existed
            nvme_stream.write_from(self.swap, self.owner, "opt", name, tensor, start)

    def fail(self, err: BaseException) -> None:
        """A streamed step stopped part way: what the swap file holds is no longer one step's."""
        self.swap.fail(err)

    def cancel_prefetch(self) -> None:
        self.swap.cancel_prefetch(self.owner, "opt")

    def begin_step(self) -> None:
        self.swap.swap_in(self.owner, "opt")

    def abort_step(self) -> None:
        self.swap.swap_out(self.owner, "opt", write=False)

    def end_step(self, optimizer_state: dict) -> None:
        self.track_optimizer_state(optimizer_state)  # first step: the state was just created
        self.swap.swap_out(self.owner, "opt", write=True, wait=False)  # write-back overlaps the next step

    def track_optimizer_state(self, optimizer_state: dict, replace: bool = False) -> None:
        """Flat layout: the elementwise state (tensors of the master's size) is swapped. Ownership
        layout (``optimizer_state`` keyed ``p{slot}.{key}``): every state tensor of at least one
        dimension, of any shape (Muon's momentum, Adafactor's row and column statistics); 0-d
        counts stay in memory as Adam's ``step`` does. See [Note: the ownership layout on NVMe]
        in _optim/owned_runs.py."""
        if self.owner.owned:
            swapped = {f"state.{k}": v for k, v in optimizer_state.items()
                       if isinstance(v, torch.Tensor) and v.dim() >= 1}
        else:
            swapped = {f"state.{k}": v for k, v in optimizer_state.items()
                       if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == self.numel}
        new = swapped if replace else self.swap.needs_adopt(self.owner, "opt", swapped)
        if new:
            self.swap.adopt(self.owner, "opt", new, replace=True)  # a key held with another object: this one

    def attach_views(self, views: list[tuple[torch.Tensor, slice, torch.Size]]) -> None:
        """Ownership layout: the per-parameter views the optimizer steps follow the master in and
        out of the swap file (empty while it is evicted)."""
        self.swap.alias(self.owner, "opt", "master", views)


# -------------------------------------------------------------------------- factory
def uses_swap(*, trainable: bool, shard_params: bool, offload_optimizer, offload_params) -> bool:
    """Whether a group with these policies keeps some state in the NVMe swap file."""
    return ((trainable and isinstance(offload_optimizer, NVMeOffload))
            or (shard_params and isinstance(offload_params, NVMeOffload)))


def make_storage(owner, *, own_slice: torch.Tensor, shard_params: bool, trainable: bool,
                 offload_optimizer: OffloadPolicy, offload_params: OffloadPolicy, transfers: Transfers, swap,
                 device: torch.device, initial_master):
    """The (parameter shard, master) stores of one group, from the config's offload policies.

    ``offload_params`` applies where the group shards its parameters (stage 3, not a
    persistent group), ``offload_optimizer`` where it trains.

    ``own_slice``: this rank's slice of the freshly filled ``full`` buffer.
    ``initial_master(out)``: fills ``out`` [shard] fp32 from the original parameter values
    (so bf16/fp16 compute loses nothing at start).
    """
    params_policy = offload_params if shard_params else None
    master_policy = offload_optimizer if trainable else None
    nvme = isinstance(params_policy, NVMeOffload) or isinstance(master_policy, NVMeOffload)
    if params_policy is not None:
        tensor = transfers.host_empty(own_slice.numel(), own_slice.dtype)
        tensor.copy_(own_slice)
        params = (NVMeParamShard(tensor, swap, owner) if isinstance(params_policy, NVMeOffload)
                  else HostParamShard(tensor))
    else:
        params = DeviceParamShard(own_slice.clone() if shard_params else own_slice)
    if not trainable:
        return params, None
    # See [Note: the master aliases the parameters]
    same_memory = params.on_host == (master_policy is not None) or params.tensor.device.type == HOST.type
    alias = params.tensor.dtype == torch.float32 and same_memory and not nvme
    if alias:
        master = params.tensor
    else:
        master = (transfers.host_empty(own_slice.numel(), torch.float32) if master_policy is not None
                  else torch.empty(own_slice.numel(), dtype=torch.float32, device=device))
        master.zero_()
        initial_master(master)
    master = nn.Parameter(master, requires_grad=True)
    if isinstance(master_policy, NVMeOffload):
        return params, NVMeMaster(master, transfers, swap, owner)
    if master_policy is not None:
        return params, HostMaster(master, alias, transfers)
    return params, DeviceMaster(master, alias)

