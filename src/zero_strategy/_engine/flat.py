"""Flat buffers: layout, padding, views and the gather state machine of one flat group.

A :class:`FlatGroup` owns the parameters of one unit that share ``requires_grad``
and the optimizer param group. Their values are laid end to end in one 1-D
buffer, padded to a multiple of the world size, and each rank owns one contiguous
slice (its *shard*). It composes two collaborators:

* ``grads`` (:class:`~._grad_buffer.GradBuffer`): gradients, with their own states;
* ``params`` / ``masters`` (``_engine/storage.py``): where the resting parameter shard and
  the fp32 master live, one class per offload policy.

This module does no communication of its own: callers pass a ``Collectives`` into
the few methods that need one and get handles back.

[Note: parameter storage and aliasing]
* ``full`` [padded] in the compute dtype holds the whole group. The module's
  ``nn.Parameter`` objects are views into it (``param.data = view``), so tied
  parameters (one object registered under two names) need no special care and the
  user's references to parameters stay valid.
* Sharded parameters (stage 3) free ``full`` by resizing its *storage* to zero
  bytes. Resizing the storage (not dropping the tensor) matters: autograd may have
  saved views of ``full`` (e.g. ``weight.t()`` for a linear layer); they see the
  re-gathered values when the storage is refilled before backward.
* A released parameter points at its *placeholder*: a zero-memory tensor with the
  parameter's true shape, dtype and device whose every element is NaN (one element,
  stride 0). ``p.shape``, ``p.numel()``, ``p.device`` and ``model.device`` stay true;
  a value read outside forward/backward and outside ``gathered_parameters`` is NaN
  (never a plausible zero, as an empty tensor summed would give), and an in-place
  write raises. ``model.state_dict()`` gathers for real (``_model/state_dict.py``).
  Never a view of the zero-byte ``full``: reading one crashes the process.

[Note: the ownership layout]
An optimizer that is not elementwise (``torch.optim.Muon`` orthogonalizes each gradient
matrix, ``Adafactor`` keeps per-row and per-column statistics) needs each parameter whole,
and a contiguous 1/N slice cuts matrices in pieces. An *owned* group assigns each parameter
whole to one rank (largest first onto the least-loaded rank, :func:`ownership_layout`) and
lays the buffer out as rank 0's parameters, padding up to the common shard size, rank 1's,
padding, and so on. The shard is still one equal-sized contiguous slice per rank, so the
reduce-scatter, the all-gathers, offload and checkpoints move it exactly as a flat group's;
only the offsets differ, and everything reads parameters through their ``ParamSlot``.
What this rank's shard holds is whole parameters (:meth:`FlatGroup.owned_slots`), which the
user's own optimizer steps as views of the master shaped like the parameters. The price is
the padding: every rank's shard is as large as the most loaded rank's, which costs that
much memory and communication beyond the flat layout (``comm_stats`` counts it), and a
parameter larger than an even share makes the padding large. Padding is zero in gradients
(``padding()``), so global-norm clipping over shards stays exact.

[Note: opaque groups]
A frozen group may hold values that are not numbers in their dtype: a 4-bit base's packed codes
stored as bf16 (See [Note: packed 4-bit parameters under ZeRO] in _model/quantized.py). They move
as they are (gathers, offload, checkpoints move bytes), but anything that converts values must
leave them alone: ``full_state_dict``'s fp32 default, the streamed ``save_pretrained``'s dtype,
teardown's return to the compute dtype. Such a group is marked ``opaque``, kept apart from other
groups of the same dtype, and every conversion of a group's values reads its own dtype instead.
Only an opaque group may hold a non-floating dtype (the packed codes in bitsandbytes' default
uint8 storage): it is never stepped, summed nor cast, only moved.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from .._comm.collectives import Collectives, Handle
from .._config.policies import OffloadPolicy
from .._mechanisms.transfers import Transfers
from .gradients import GradBuffer, nan_placeholder
from .storage import make_storage, uses_swap


class ShardState(enum.Enum):
    SHARDED = "sharded"    # only the shard exists; parameters are placeholders
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


def ownership_layout(numels: list[int], world_size: int,
                     owner_load: list[int] | None = None) -> tuple[list[int], list[int], int]:
    """Offsets, owner rank per parameter and shard size of an ownership layout.

    See [Note: the ownership layout]. Largest parameter first onto the rank owning the fewest
    elements of this group, ties broken by what each rank owns over the groups built before
    (``owner_load``, updated in place) and then by rank, so every rank computes the same.
    """
    load = [0] * world_size
    carried = owner_load if owner_load is not None else [0] * world_size
    owner_of = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], carried[r], r))
        owner_of[i] = r
        load[r] += numels[i]
    shard_numel = max(1, max(load, default=0))
    offsets, at = [0] * len(numels), [r * shard_numel for r in range(world_size)]
    for i, n in enumerate(numels):  # each rank's parameters in registration order
        offsets[i], at[owner_of[i]] = at[owner_of[i]], at[owner_of[i]] + n
    if owner_load is not None:
        for r in range(world_size):
            owner_load[r] += load[r]
    return offsets, owner_of, shard_numel


def _gaps(slots: list[ParamSlot], padded_numel: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for s in sorted(slots, key=lambda s: s.offset):
        if s.offset > at:
            out.append((at, s.offset))
        at = max(at, s.offset + s.numel)
    if at < padded_numel:
        out.append((at, padded_numel))
    return out


def preserve_version(t: torch.Tensor):
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
        offload_optimizer: OffloadPolicy = None,
        offload_params: OffloadPolicy = None,
        transfers: Transfers | None = None,
        swap=None,
        owned: bool = False,
        owner_load: list[int] | None = None,
        opaque: bool = False,
    ):
        """``owned``: lay the buffer out by owner (See [Note: the ownership layout]);
        ``owner_load``: elements each rank owns in the groups built so far (updated here);
        ``opaque``: its values are bit patterns, never cast (See [Note: opaque groups])."""
        assert not (opaque and trainable), "an opaque group is frozen: nothing steps bit patterns"
        #: See [Note: opaque groups]
        self.opaque = opaque
        self.name = name
        self.trainable = trainable
        #: which of setup()'s optimizers steps this group, and which of its param groups
        self.optimizer_index = optimizer_index if optimizer_index is not None else (0 if trainable else None)
        self.optimizer_group = optimizer_group
        self.shard_params = shard_params
        self.compute_dtype = compute_dtype
        self.rank, self.world_size, self.device = rank, world_size, device
        self.transfers = transfers if transfers is not None else Transfers(device, pin_memory=False)
        #: the NVMe store when some of this group's state rests in the swap file (_mechanisms/nvme.py)
        self.swap = swap if uses_swap(trainable=trainable, shard_params=shard_params, offload_optimizer=offload_optimizer,
                                      offload_params=offload_params) else None

        #: See [Note: the ownership layout]: each parameter whole in one rank's shard
        self.owned = owned
        numels = [p.numel() for _, p in named_params]
        if owned:
            offsets, self.owner_of, self.shard_numel = ownership_layout(numels, world_size, owner_load)
        else:
            offsets = [0, *itertools.accumulate(numels)][:len(numels)]
            self.shard_numel = max(1, math.ceil(sum(numels) / world_size))
            self.owner_of = None  # a parameter may span ranks
        self.slots: list[ParamSlot] = [ParamSlot(i, fqn, p, p.shape, offsets[i], numels[i])
                                       for i, (fqn, p) in enumerate(named_params)]
        self.numel = sum(numels)                                           # real elements
        self.padded_numel = self.shard_numel * world_size
        self.shard_start = rank * self.shard_numel
        self._padding = _gaps(self.slots, self.padded_numel)

        self.full = torch.zeros(self.padded_numel, dtype=compute_dtype, device=device)
        self._copy_params_into(self.full, 0, self.padded_numel)
        self._views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]
        self._placeholders = ([nan_placeholder(s.shape, compute_dtype, device) for s in self.slots]
                              if shard_params else [])
        self.params, self.masters = make_storage(
            self, own_slice=self.own(self.full), shard_params=shard_params, trainable=trainable,
            offload_optimizer=offload_optimizer, offload_params=offload_params, transfers=self.transfers, swap=self.swap, device=device,
            initial_master=lambda out: self._copy_params_into(out, self.shard_start, self.shard_numel))
        self.grads = GradBuffer(self, grad_dtype, device)
        #: slots kept out of a step while a count their state shares advanced (see _engine/gradients.py)
        self.kept_behind: frozenset[int] = frozenset()
        self.warned_kept_behind = False

        self.state = ShardState.GATHERED
        self._attach_views()
        if shard_params:
            self.transfers.working_set.add("gathered", self.full.untyped_storage().nbytes())
            self.release()

    def __repr__(self) -> str:
        return (f"FlatGroup({self.name}, {len(self.slots)} params, {self.numel} elements, "
                f"{self.state.value}, {type(self.params).__name__}, {type(self.masters).__name__})")

    # ------------------------------------------------------------ what rests where
    @property
    def master(self) -> nn.Parameter | None:
        """The fp32 master shard the optimizer steps (None for frozen groups)."""
        return self.masters.master if self.masters is not None else None

    @property
    def param_shard(self) -> torch.Tensor:
        """The resting compute-dtype shard (stages 1-2: the own slice of ``full``)."""
        return self.params.tensor

    @property
    def weight_shard(self) -> torch.Tensor:
        """This rank's authoritative slice of the weights: the fp32 master where the group
        trains, else the resting parameter shard. Checkpoints, ``full_state_dict`` and
        sharded loading read and write this one tensor, so they agree on which it is."""
        return self.master.data if self.master is not None else self.param_shard

    @property
    def master_aliases_params(self) -> bool:
        return self.masters is not None and self.masters.aliases_params

    @property
    def master_streams(self) -> bool:
        """A training flat-shard group whose master and optimizer state are larger than an NVMe
        staging slot: the step, a checkpoint save and a gather read them piece by piece, never
        whole (See [Note: bounded staging] in _mechanisms/nvme_stream.py)."""
        return self.trainable and not self.owned and self.masters.streams

    def resident(self, write_back: bool):
        """Context: this group's swapped state (NVMe) in host memory inside the block."""
        if self.swap is None:
            return contextlib.nullcontext()
        return self.swap.resident(self, write_back)

    # ----------------------------------------------------------------- layout
    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat tensor."""
        return flat[self.shard_start:self.shard_start + self.shard_numel]

    def _copy_params_into(self, dst: torch.Tensor, start: int, length: int) -> None:
        """dst[i] <- element (start + i) of the flat layout, taken from the live parameters."""
        end = start + length
        with torch.no_grad():
            if self.owned:
                dst[:length].zero_()  # padding sits between owners' parameters: never garbage
            for s in self.slots:
                lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
                if lo < hi:
                    src = s.param.detach().reshape(-1)[lo - s.offset:hi - s.offset]
                    dst[lo - start:hi - start].copy_(src)

    def padding(self) -> list[tuple[int, int]]:
        """The [start, stop) ranges of the flat buffer that hold no parameter (kept zero in gradients)."""
        return self._padding

    def owned_slots(self):
        """Ownership layout: yield (slot, where) for each parameter whole in this rank's shard,
        ``where`` its elements in a shard-sized tensor (master, gradient shard)."""
        for s in self.slots:
            if self.owner_of[s.index] == self.rank:
                lo = s.offset - self.shard_start
                yield s, slice(lo, lo + s.numel)

    def slot_ranges_in_shard(self, rank: int | None = None):
        """Yield (slot, lo, hi, where): the part [lo, hi) of each slot's flattened elements this
        rank (or group rank ``rank``) holds, and ``where`` those elements sit in a shard-sized
        tensor (master, state)."""
        start = self.shard_start if rank is None else rank * self.shard_numel
        for s in self.slots:
            lo = max(start, s.offset)
            hi = min(start + self.shard_numel, s.offset + s.numel)
            if lo < hi:
                yield s, lo - s.offset, hi - s.offset, slice(lo - start, hi - start)

    # ----------------------------------------------------------- gather/release
    def _attach_views(self) -> None:
        for s, v in zip(self.slots, self._views):
            s.param.data = v

    def adopt_replaced_data(self) -> None:
        """Take back parameters whose ``.data`` was replaced while gathered.

        ``p.data = new_tensor`` (PEFT's ``merge(safe_merge=True)``, custom weight surgery) leaves
        the parameter outside the flat buffer, so a write-back would keep the old values and the
        next gather would silently undo the change. The new values are copied into the buffer
        and the parameter views it again. A changed shape cannot fit the layout fixed at setup.
        """
        if self.state is not ShardState.GATHERED:
            return
        with torch.no_grad():
            for s, v in zip(self.slots, self._views):
                data = s.param.data
                if data.data_ptr() == v.data_ptr() and data.shape == v.shape and data.stride() == v.stride():
                    continue
                if data.shape != v.shape:
                    raise ValueError(
                        f"zero_strategy: parameter {s.fqn!r} changed shape after setup, from {tuple(v.shape)} "
                        f"to {tuple(data.shape)}; its flat buffer, shards, master and optimizer state were "
                        "laid out at setup. Change shapes (resize_token_embeddings, pruning) before "
                        "zero_strategy.setup / accelerator.prepare / Trainer(...), or teardown and set up again.")
                v.copy_(data)
                s.param.data = v

    def open_for_gather(self) -> bool:
        """Make room for ``full`` and start reading the shard (NVMe: the read runs under the
        previous unit's compute). False when gathered already."""
        if self.state is ShardState.GATHERED:
            return False
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded_numel * self.full.element_size())
            self.transfers.working_set.add("gathered", storage.nbytes())  # See [Note: the working set]
        if self.params.needs_deferred_gather:
            self.params.prefetch()
        return True

    def gather_source(self) -> torch.Tensor:
        """This rank's shard, next to the device, to all-gather from (after ``open_for_gather``)."""
        with preserve_version(self.full):
            return self.params.gather_source(self.own(self.full), self.transfers)

    def finish_gather(self) -> None:
        if self.state is ShardState.SHARDED:
            self._attach_views()
            self.state = ShardState.GATHERED

    def release(self) -> None:
        """Free ``full`` (stage 3): parameters become placeholders until the next gather."""
        if not self.shard_params or self.state is ShardState.SHARDED:
            return
        for s, placeholder in zip(self.slots, self._placeholders):
            s.param.data = placeholder
        self.transfers.working_set.remove("gathered", self.full.untyped_storage().nbytes())
        self.full.untyped_storage().resize_(0)  # counted when open_for_gather (or __init__) allocated it
        self.state = ShardState.SHARDED

    # ------------------------------------------------------------------ step
    def master_grad(self, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The fp32 gradient the optimizer sees, next to the master (host when offloaded): a copy
        of the whole group when the reduce dtype is lower, into ``out`` when given (``out``:
        :attr:`master_grad_cast_numel` elements). See [Note: fp32 gradients only for the groups
        being stepped] in storage.py."""
        return self.masters.grad_for_step(self.grads.grad_shard, self.grads.version, out)

    @property
    def master_grad_cast_numel(self) -> int:
        """Elements :meth:`master_grad` copies to the master's dtype (0: the gradient is used as it is)."""
        shard = self.grads.grad_shard
        return 0 if shard is None or self.master is None or shard.dtype == self.master.dtype else shard.numel()

    def master_grad_source(self) -> torch.Tensor | None:
        """The reduced gradient next to the master, still in the reduce dtype (a streamed step
        casts it chunk by chunk)."""
        return self.masters.grad_source(self.grads.grad_shard, self.grads.version)

    def finish_reduce(self, out: torch.Tensor, comm: Collectives, in_place: bool) -> None:
        self.grads.finish_reduce(out, comm, in_place)
        if self.masters is not None:
            self.masters.on_grad_reduced(self.grads.grad_shard, self.grads.version)

    def zero_grad(self, keep_full: bool) -> None:
        if self.masters is not None:
            self.masters.drop_grad()  # first: a master's .grad may be the shard, which the pool then keeps
        self.grads.reset(keep_full)

    def publish_master(self, comm: Collectives) -> Handle | None:
        """Rebuild the compute-dtype parameters from the master (after a step or a load).

        The master goes into the resting shard; where parameters are materialized (stages
        1-2, persistent groups, or a stage-3 group gathered right now) this rank's slice
        of ``full`` takes the shard and is all-gathered. Frozen groups (no master) just
        re-gather from their shard.
        """
        own = self.publish_local()
        if own is None:
            return None
        with torch.no_grad(), preserve_version(self.full):
            return comm.all_gather(self.full, own, async_op=True, label=self.name)

    def publish_local(self) -> torch.Tensor | None:
        """:meth:`publish_master` without its all-gather: the master into the resting shard,
        and where ``full`` is materialized, the shard into this rank's slice of it, which is
        returned (the one to all-gather); None where nothing is to be gathered."""
        with torch.no_grad():
            if self.masters is not None and not self.masters.aliases_params:
                uploaded = self.params.take_master(self.master.detach(), self.transfers)
                if uploaded is not None:
                    uploaded.wait()
        return self._shard_into_full()

    def publish_shard(self, comm: Collectives) -> Handle | None:
        """:meth:`publish_master` for a resting shard already written from the master (a streamed
        load wrote it chunk by chunk): only the all-gather where parameters are materialized."""
        own = self._shard_into_full()
        if own is None:
            return None
        with torch.no_grad(), preserve_version(self.full):
            return comm.all_gather(self.full, own, async_op=True, label=self.name)

    def _shard_into_full(self) -> torch.Tensor | None:
        """Where ``full`` is materialized, the resting shard into this rank's slice of it, which is
        returned (the one to all-gather); None where nothing is to be gathered."""
        if self.shard_params and self.state is ShardState.SHARDED:
            return None
        with torch.no_grad():
            own = self.own(self.full)
            with preserve_version(self.full):
                if own.data_ptr() != self.param_shard.data_ptr():  # the shard rests elsewhere (offload)
                    own.copy_(self.param_shard)
            return own

    def stage_master_upload(self):
        """Offloaded step, on the CPU worker: master -> compute-dtype parameter shard.

        Returns the upload's event (``wait()`` it before using the parameters) or None.
        """
        with torch.no_grad():
            if self.masters.aliases_params:
                return None
            return self.params.take_master(self.master.detach(), self.transfers)

    def write_back_gathered(self, loaded: Mapping[int, torch.Tensor] | None = None) -> None:
        """The gathered ``full`` was changed (a load, a modification inside ``gathered_parameters``):
        write this rank's slice into the resting shard and the fp32 master.

        ``loaded=None`` (anything may have changed): the whole master takes the gathered
        values. ``loaded``: id(parameter) -> a tensor with that parameter's new elements
        (``load_state_dict``, _model/state_dict.py): only those parameters' master elements
        change, to the tensors' own values, so an fp32 state dict loaded into a bf16 model
        keeps fp32 masters and the parameters it lacks keep theirs.
        """
        own = self.own(self.full)
        with torch.no_grad(), self.resident(write_back=True):
            if self.shard_params:
                self.param_shard.copy_(own)
            if self.master is None or self.master_aliases_params:
                return
            master = self.master.data
            if loaded is None:
                master.copy_(own)
                return
            for slot, lo, hi, where in self.slot_ranges_in_shard():
                values = loaded.get(id(slot.param))
                if values is not None:
                    master[where].copy_(values.reshape(-1)[lo:hi])

    def free(self) -> None:
        """Teardown: drop gradients and host copies (the masters go with the optimizer state)."""
        self.zero_grad(keep_full=False)
        if self.masters is not None:
            self.masters.free()

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
            out.append(("params", self.params.on_host, self.param_shard))
            if self.state is ShardState.GATHERED:
                out.append(("params", False, self.full))
        if self.masters is not None:
            out.extend(self.masters.held_tensors())
        out.extend(self.grads.held_tensors())
        return out
