"""Flat buffers and shards: layout, padding, views and the per-buffer state machine.

A :class:`FlatGroup` owns the parameters of one unit that share ``requires_grad``
and the optimizer param group. Their values are laid end to end in one 1-D
buffer, padded to a multiple of the world size, and each rank owns one contiguous
slice (its *shard*). This module does no communication: callers pass a
``Collectives`` into the few methods that need one and get handles back.

[Note: parameter storage and aliasing]
* ``full`` [padded] in the compute dtype holds the whole group. The module's
  ``nn.Parameter`` objects are views into it (``param.data = view``), so tied
  parameters (one object registered under two names) need no special care and the
  user's references to parameters stay valid.
* Sharded parameters (stage 3) free ``full`` by resizing its *storage* to zero
  bytes and point each parameter at an empty tensor. Resizing the storage (not
  dropping the tensor) matters: autograd may have saved views of ``full`` (e.g.
  ``weight.t()`` for a linear layer); they see the re-gathered values when the
  storage is refilled before backward. Pointing the parameters at an empty tensor
  matters too: reading a view of a zero-byte storage crashes the process instead
  of raising, so a released parameter is visibly empty rather than a trap.
* ``master`` [shard] is the fp32 copy the optimizer steps. With an fp32 compute
  dtype it aliases the parameter storage (the own slice of ``full`` for stages 1-2,
  ``param_shard`` for stage 3), so fp32 training holds no second copy.
* ``param_shard`` [shard] (stage 3 only) is the resting copy in the compute dtype,
  the input of the all-gather.
* ``full_grad`` [padded] collects this rank's unreduced gradients (reduce dtype);
  ``grad_shard`` [shard] holds the reduced, averaged gradients of this rank's slice.
"""

from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass

import torch
from torch import nn

from ._collectives import Collectives, Handle
from ._offload import OffloadPlan, Transfers


class ShardState(enum.Enum):
    SHARDED = "sharded"    # only the shard exists; parameters are empty
    GATHERED = "gathered"  # the full buffer exists; parameters are views into it


@dataclass(frozen=True, eq=False)
class ParamSlot:
    """Where one parameter's elements sit in its group's flat buffer."""

    index: int
    fqn: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    numel: int


class _DeferredHandle:
    """A gather whose collective is issued at ``wait()`` (its disk read is already running)."""

    __slots__ = ("_start",)

    def __init__(self, start):
        self._start = start

    def wait(self) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            start().wait()


def _preserve_version(t: torch.Tensor):
    """Writes into ``full`` must not bump the version autograd checks for saved views."""
    return torch.autograd._unsafe_preserve_version_counter(t)


class FlatGroup:
    """One flat buffer of a unit: parameters with the same requires_grad and optimizer group."""

    def __init__(
        self,
        name: str,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        trainable: bool,
        optimizer_group: int | None,
        optimizer_index: int | None = None,
        shard_params: bool,
        compute_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        rank: int,
        world_size: int,
        device: torch.device,
        offload: OffloadPlan = OffloadPlan(),
        transfers: Transfers | None = None,
        swap=None,
    ):
        self.name = name
        self.trainable = trainable
        #: which of setup()'s optimizers steps this group, and which of its param groups
        self.optimizer_index = optimizer_index if optimizer_index is not None else (0 if trainable else None)
        self.optimizer_group = optimizer_group
        self.shard_params = shard_params
        self.compute_dtype = compute_dtype
        self.grad_dtype = grad_dtype
        self.master_dtype = torch.float32
        self.rank, self.world_size, self.device = rank, world_size, device
        self.offload = offload
        self.transfers = transfers if transfers is not None else Transfers(device, pin_memory=False)
        #: the NVMe store when some of this group's state rests in the swap file (_nvme.py)
        self.swap = swap if (offload.nvme_optimizer or offload.nvme_params) else None

        self.slots: list[ParamSlot] = []
        offset = 0
        for fqn, p in named_params:
            self.slots.append(ParamSlot(len(self.slots), fqn, p, p.shape, offset, p.numel()))
            offset += p.numel()
        self.numel = offset                                                # real elements
        self.padded_numel = max(1, math.ceil(offset / world_size)) * world_size
        self.shard_numel = self.padded_numel // world_size
        self.shard_start = rank * self.shard_numel

        self.full = torch.zeros(self.padded_numel, dtype=compute_dtype, device=device)
        self._copy_params_into(self.full, 0, self.padded_numel)
        self._views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]
        self.master: nn.Parameter | None = None
        if shard_params and offload.params:
            self.param_shard = self.transfers.host_empty(self.shard_numel, compute_dtype)
            self.param_shard.copy_(self.own(self.full))
        elif shard_params:
            self.param_shard = self.own(self.full).clone()
        else:
            self.param_shard = self.own(self.full)
        if trainable:
            # alias, no second copy: only where the parameters rest next to the master by design
            # (not merely because device and host are both the CPU on a CUDA-less machine, so
            # that offloading takes the same path there as on a GPU); NVMe swaps them apart
            if (self.param_shard.dtype == self.master_dtype and (offload.params or not offload.optimizer)
                    and not (offload.nvme_params or offload.nvme_optimizer)):
                master = self.param_shard  # (master_aliases_params below)
            else:
                master = (self.transfers.host_empty(self.shard_numel, self.master_dtype) if offload.optimizer
                          else torch.empty(self.shard_numel, dtype=self.master_dtype, device=device))
                master.zero_()
                # from the original values, so bf16/fp16 compute loses nothing at start
                self._copy_params_into(master, self.shard_start, self.shard_numel)
            self.master = nn.Parameter(master, requires_grad=True)
        #: the master shares storage with the parameters (fp32 compute): no copy after a step
        self.master_aliases_params = self.master is not None and master is self.param_shard
        #: offload: the fp32 host copy of grad_shard the CPU step reads, and its download
        self.host_grad: torch.Tensor | None = None
        self._download = None

        self.full_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.grads_this_backward = 0
        self.reduced_this_backward = False
        #: full_grad holds gradients not yet reduced (e.g. accumulated inside no_sync)
        self.has_unreduced = False
        #: which slots of full_grad hold data since it was last consumed; the rest is
        #: zeroed only at reduce time (saves a full memset per backward)
        self._written = [False] * len(self.slots)
        #: grad_shard is this rank's slice of full_grad, reduced in place (stage 1)
        self._reduced_in_place = False
        #: stage 1: reduced gradients to add back at the next reduce (see accumulate_param_grad)
        self._carry: torch.Tensor | None = None

        self.state = ShardState.GATHERED
        self._attach_views()
        if shard_params:
            self.release()
        if self.swap is not None:  # from here on they rest in the swap file
            if offload.nvme_optimizer and self.master is not None:
                self.swap.adopt(self, "opt", {"master": self.master})
            if offload.nvme_params:
                self.swap.adopt(self, "param", {"param": self.param_shard})

    # ----------------------------------------------------------------- layout
    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat tensor."""
        return flat[self.shard_start:self.shard_start + self.shard_numel]

    def _copy_params_into(self, dst: torch.Tensor, start: int, length: int) -> None:
        """dst[i] <- element (start + i) of the flat layout, taken from the live parameters."""
        end = start + length
        with torch.no_grad():
            for s in self.slots:
                lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
                if lo < hi:
                    src = s.param.detach().reshape(-1)[lo - s.offset:hi - s.offset]
                    dst[lo - start:hi - start].copy_(src)

    def slot_ranges_in_shard(self):
        """Yield (slot, lo, hi, where): the part [lo, hi) of each slot's flattened elements this
        rank holds, and ``where`` those elements sit in a shard-sized tensor (master, state)."""
        for s in self.slots:
            lo = max(self.shard_start, s.offset)
            hi = min(self.shard_start + self.shard_numel, s.offset + s.numel)
            if lo < hi:
                yield s, lo - s.offset, hi - s.offset, slice(lo - self.shard_start, hi - self.shard_start)

    # ----------------------------------------------------------- gather/release
    def _attach_views(self) -> None:
        for s, v in zip(self.slots, self._views):
            s.param.data = v

    def begin_gather(self, comm: Collectives) -> Handle | None:
        """Start materializing ``full`` from the shards; ``finish_gather`` after the handle."""
        if self.state is ShardState.GATHERED:
            return None
        storage = self.full.untyped_storage()
        storage.resize_(self.padded_numel * self.full.element_size())
        if self.offload.nvme_params:
            # The disk read starts now (a prefetch runs it under the previous unit's compute);
            # upload and all-gather follow when the unit is waited for, in the same order on
            # every rank.
            self.swap.prefetch(self, "param")
            return _DeferredHandle(lambda: self._upload_and_gather(comm))
        return self._upload_and_gather(comm)

    def _upload_and_gather(self, comm: Collectives) -> Handle:
        with _preserve_version(self.full):
            if self.offload.params:  # upload this rank's shard into its slot, gather in place
                own = self.own(self.full)
                if self.offload.nvme_params:
                    self.swap.swap_in(self, "param")
                uploaded = self.transfers.upload(own, self.param_shard)
                uploaded.wait()
                if self.offload.nvme_params:
                    uploaded.synchronize()  # the host slot is reused once evicted
                    self.swap.swap_out(self, "param", write=False)
                return comm.all_gather(self.full, own, async_op=True)
            return comm.all_gather(self.full, self.param_shard, async_op=True)

    def finish_gather(self) -> None:
        if self.state is ShardState.SHARDED:
            self._attach_views()
            self.state = ShardState.GATHERED

    def release(self) -> None:
        """Free ``full`` (stage 3): parameters become empty until the next gather."""
        if not self.shard_params or self.state is ShardState.SHARDED:
            return
        empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for s in self.slots:
            s.param.data = empty
        self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    # ------------------------------------------------------------------ grads
    def accumulate_param_grad(self, slot: ParamSlot) -> None:
        """Move ``param.grad`` into ``full_grad`` (copy or add) and drop it, freeing memory early."""
        grad = slot.param.grad
        if grad is None:
            return
        if self._reduced_in_place:
            # Gradients accumulate onto reduced ones (no zero_grad since the last reduce, e.g.
            # another optimizer stepped): keep this rank's reduced slice aside and start a
            # fresh local sum; the next reduce adds it back, as torch would accumulate.
            self._carry = self.grad_shard.clone()
            self.grad_shard = None
            self._reduced_in_place = False
            self._written = [False] * len(self.slots)
        if self.full_grad is None:
            self.full_grad = torch.empty(self.padded_numel, dtype=self.grad_dtype, device=self.device)
        view = self.full_grad[slot.offset:slot.offset + slot.numel]
        if self._written[slot.index]:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self._written[slot.index] = True
        slot.param.grad = None
        self.grads_this_backward += 1
        self.has_unreduced = True

    @property
    def grads_complete(self) -> bool:
        return self.grads_this_backward >= len(self.slots)

    def begin_reduce(self, comm: Collectives, in_place: bool) -> tuple[Handle, torch.Tensor]:
        """Start summing ``full_grad`` over ranks into this rank's slice; ``finish_reduce`` averages.

        ``in_place``: the slice is reduced into ``full_grad`` itself (stage 1, whose full
        buffer persists anyway), so stepping needs no extra gradient memory.
        """
        if self.full_grad is None:  # unused on this backward: contribute zeros, stay in lock-step
            self.full_grad = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.device)
        else:
            for s in self.slots:
                if not self._written[s.index]:
                    self.full_grad[s.offset:s.offset + s.numel].zero_()
            self.full_grad[self.numel:].zero_()
        full = self.full_grad
        if comm.world_size > 1 and full.dtype == torch.float16:
            full.div_(comm.world_size)  # fp16: divide before summing so the sum cannot overflow
        out = self.own(full) if in_place else torch.empty(self.shard_numel, dtype=self.grad_dtype,
                                                          device=self.device)
        handle = comm.reduce_scatter(out, full, async_op=True)
        self.reduced_this_backward = True
        self.has_unreduced = False
        return handle, out

    def finish_reduce(self, out: torch.Tensor, comm: Collectives, in_place: bool) -> None:
        """Average the reduced slice into ``grad_shard``; free ``full_grad`` unless it persists."""
        if comm.world_size > 1 and out.dtype != torch.float16:
            out.div_(comm.world_size)  # on the shard: 1/N of the work of dividing the full buffer
        self._written = [False] * len(self.slots)
        if in_place:
            if self._carry is not None:
                out.add_(self._carry)
                self._carry = None
            self.grad_shard = out
            self._reduced_in_place = True
        else:
            if self.grad_shard is None:
                self.grad_shard = out
            else:
                self.grad_shard.add_(out)
            self.full_grad = None
        if self.offload.optimizer:
            self.begin_grad_download()

    def begin_grad_download(self) -> None:
        """Start copying the (accumulated) gradient shard to host_grad; overlaps what follows."""
        if self.host_grad is None:
            self.host_grad = self.transfers.host_empty(self.shard_numel, self.master_dtype)
        self._download = self.transfers.download(self.host_grad, self.grad_shard)

    def reset_backward_counters(self) -> None:
        self.grads_this_backward = 0
        self.reduced_this_backward = False

    def zero_grad(self, keep_full: bool) -> None:
        self.grad_shard = None
        self._carry = None
        self._download = None
        self._reduced_in_place = False
        self._written = [False] * len(self.slots)
        if not keep_full:
            self.full_grad = None
        self.has_unreduced = False
        if self.master is not None:
            self.master.grad = None
        self.reset_backward_counters()

    # ------------------------------------------------------------------ step
    def master_grad(self) -> torch.Tensor | None:
        """The fp32 gradient the optimizer sees, next to the master (host when offloaded).

        Aliases ``grad_shard`` when dtype and device already match.
        """
        if self.grad_shard is None:
            return None
        if self.offload.optimizer:
            if self._download is None:
                self.begin_grad_download()
            self._download.synchronize()
            return self.host_grad
        if self.grad_shard.dtype == self.master_dtype:
            return self.grad_shard
        return self.grad_shard.to(self.master_dtype)

    def publish_master(self, comm: Collectives) -> Handle | None:
        """Rebuild the compute-dtype parameters from the master (after a step or a load).

        The master goes into the resting shard; where parameters are materialized (stages
        1-2, persistent groups, or a stage-3 group gathered right now) this rank's slice
        of ``full`` takes the shard and is all-gathered. Frozen groups (no master) just
        re-gather from their shard.
        """
        with torch.no_grad():
            if self.master is not None and not self.master_aliases_params:
                self.param_shard.copy_(self.master)
            if self.shard_params and self.state is ShardState.SHARDED:
                return None
            own = self.own(self.full)
            with _preserve_version(self.full):
                if own.data_ptr() != self.param_shard.data_ptr():  # the shard rests elsewhere (offload)
                    own.copy_(self.param_shard)
                return comm.all_gather(self.full, own, async_op=True)

    def stage_master_upload(self):
        """Offloaded step, on the CPU worker: master -> compute-dtype parameter shard.

        Parameters resting on the host (param offload) take the cast directly; otherwise
        the cast goes to a pinned staging buffer and is uploaded on the H2D stream.
        Returns the upload's event (``wait()`` it before using the parameters).
        """
        with torch.no_grad():
            if self.master_aliases_params:
                return None
            if self.offload.params:  # parameters rest on the host: cast in place, no upload
                if self.offload.nvme_params:
                    self.swap.swap_in(self, "param")
                self.param_shard.copy_(self.master)
                if self.offload.nvme_params:
                    self.swap.swap_out(self, "param", write=True, wait=False)
                return None
            return self.transfers.upload_cast(self.param_shard, self.master.detach())

    def resident(self, write_back: bool):
        """Context: this group's swapped state (NVMe) in host memory inside the block."""
        if self.swap is None:
            return contextlib.nullcontext()
        return self.swap.resident(self, write_back)

    def gather_replicated(self, comm: Collectives) -> Handle | None:
        """Stages 1-2 (and persistent stage-3 groups): all-gather ``full`` from the own slice."""
        if self.shard_params:
            return None
        with _preserve_version(self.full):
            return comm.all_gather(self.full, self.own(self.full), async_op=True)

    # ---------------------------------------------------------------- reporting
    def held_tensors(self) -> list[tuple[str, bool, torch.Tensor]]:
        """Model-state tensors held now as (category, offloaded, tensor), for the memory report.

        ``offloaded`` says the engine placed the tensor in host memory on purpose, which
        the report shows as "host" even on a CPU-only machine where both are the CPU.
        """
        out: list[tuple[str, bool, torch.Tensor]] = []
        if not self.shard_params:
            out.append(("params", False, self.full))
        else:
            out.append(("params", self.offload.params, self.param_shard))
            if self.state is ShardState.GATHERED:
                out.append(("params", False, self.full))
        if self.master is not None and not self.master_aliases_params:
            out.append(("master", self.offload.optimizer, self.master.data))
        for g in (self.full_grad, self.grad_shard):
            if g is not None:
                out.append(("grads", False, g))
        if self.host_grad is not None:
            out.append(("grads", True, self.host_grad))
        return out
