"""Hand the compute device's memory back between phases: ``offload_states`` / ``reload_states``.

Online RL alternates phases: the policy generates (needs the parameters, nothing
else), then trains (needs everything). DeepSpeed users free the accelerator for the
rollout with ``engine.offload_states()`` and take it back with ``reload_states()``;
these are the same calls on a set-up model, with DeepSpeed's names for the kinds of
state (see _config/state_kinds.py).

[Note: what offload_states moves]
Only what rests on the compute device, per kind (``include=``):

* ``optim_states``: the optimizer's state tensors (Adam's moments) of masters stepped
  on the device;
* ``hp_params``: the fp32 master shards stepped on the device. With an fp32 compute
  dtype a master that *is* the parameter shard (See [Note: the master aliases the
  parameters] in _engine/storage.py) has no bytes of its own: it moves with ``lp_params``;
* ``lp_params``: the compute-dtype parameters: stages 1-2 the whole replicated flat
  buffer, stage 3 the resting shard (and persistent groups' full buffer); every stage-3
  unit is released first;
* ``lp_grads``: reduced gradient shards (and stage 1's carried slice);
* ``contiguous_grad_buffer``: the full unreduced gradient buffers (stage 1 keeps one
  per group between steps; stages 2-3 only inside ``no_sync`` accumulation). Stage 1's
  reduced shard is a slice of it: a storage is moved whole, under the first kind that
  names it.

What an offload policy already put on the host (``CPUOffload``: masters, optimizer
state; stage-3 ``offload_params``) or on NVMe stays where it is: nothing to move. A
kind asked for still counts as offloaded (the model refuses to train until
``reload_states``), so a script behaves the same whatever preset and machine it runs on.

[Note: moving a storage, not a tensor]
Each storage is copied byte for byte into a (pinned) host buffer and then resized to
zero bytes, so the device memory is freed even though the engine's own tensors (flat
buffers, their views, shards) keep referring to it; ``reload_states`` resizes it back
and copies the bytes in: bit-exact, and every view, alias and identity (optimizer
state keyed by the master, parameters viewing the flat buffer) is as before. Tensors a
user can reach (parameters, masters, their ``.grad``, optimizer state values) are
pointed (``.data``) at the matching view of the host copy while offloaded, so reading
them gives the right values in host memory, never a read of freed memory; the engine's
internal tensors are only reached through calls that refuse while offloaded (forward,
backward, step, zero_grad, gathers, state dicts, checkpoints), each naming
``reload_states``, as DeepSpeed requires an explicit reload too.

On a CUDA-less machine the compute device *is* host memory: the same path runs (the
bytes move into a new host buffer and the original is freed), so the round trip and
the refusals are the ones a GPU run gets, but nothing is freed in net. ``memory_report``
counts the moved bytes as "offloaded" on every machine; the memory a GPU gets back is
``torch.cuda.memory_allocated()`` before minus after.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .._config.state_kinds import parse_kinds
from .._mechanisms.transfers import HOST

#: the memory report category of each kind's bytes
CATEGORY = {"optim_states": "optimizer_state", "hp_params": "master", "lp_params": "params",
            "lp_grads": "grads", "contiguous_grad_buffer": "grads"}


def _key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _host_view(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s elements (same dtype, offset, shape, strides) in the host copy of its storage."""
    return torch.empty(0, dtype=like.dtype, device=HOST).set_(
        host.untyped_storage(), like.storage_offset(), like.size(), like.stride())


@dataclass(eq=False)
class _MovedStorage:
    """One device storage whose bytes rest in ``host`` while it is resized to zero."""

    kind: str
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor  # [nbytes] uint8 on the host
    #: (tensor a user can reach, its own .data on the device storage), restored at reload
    pointed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class OffloadedStates:
    """What ``offload_states`` moved off one engine's compute device (``engine.offloaded``)."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()     # kinds asked for, moved or already on the host
        self.moved: list[_MovedStorage] = []
        self._host_keys: set[tuple[int, int]] = set()
        self._detached_grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master, its .grad)

    def __repr__(self) -> str:
        return f"OffloadedStates({sorted(self.kinds)}, {len(self.moved)} storages, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.moved)

    def bytes_by_category(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.moved:
            out[CATEGORY[m.kind]] = out.get(CATEGORY[m.kind], 0) + m.nbytes
        return out

    def host_copies(self) -> list[tuple[str, torch.Tensor]]:
        """(memory report category, host tensor) of every moved storage."""
        return [(CATEGORY[m.kind], m.host) for m in self.moved]

    def is_host_copy(self, t: torch.Tensor) -> bool:
        return _key(t) in self._host_keys


# ---------------------------------------------------------------------- offload
def refuse_expert_parallel(engine, what: str) -> None:
    """Expert parallelism's rank-local experts and their optimizer are not among the states moved: refused."""
    ep = engine.expert_parallel
    if ep is not None:
        raise NotImplementedError(
            f"{what} does not move expert parallelism's experts (expert_parallel_size={ep.size}: each rank's "
            "experts and their optimizer state stay outside the engine's groups) yet; drop expert_parallel_size "
            "or do not offload states")


def offload(engine, optimizers: list, include, *, pin_memory: bool, non_blocking: bool) -> OffloadedStates:
    """Move the ``include`` kinds of ``engine`` (masters, state and gradients of ``optimizers``'
    groups; parameters of the whole model) to the host. See [Note: what offload_states moves]."""
    kinds = parse_kinds(include, "zero_strategy.offload_states")
    refuse_expert_parallel(engine, "zero_strategy.offload_states")
    if not engine.is_idle:
        raise RuntimeError("zero_strategy.offload_states: the model is in the middle of a forward or "
                           "backward; call it between iterations (after optimizer.step())")
    if any(z.steps_in_flight for z in optimizers):
        raise RuntimeError("zero_strategy.offload_states: overlap_step has optimizer steps running since "
                           "the last backward; call it after optimizer.step()")
    record = engine.offloaded if engine.offloaded is not None else OffloadedStates()
    new = [k for k in kinds if k not in record.kinds]
    if not new:
        return record  # already offloaded: a no-op, as DeepSpeed's
    if "lp_params" in new and engine.plan.shards_parameters:
        engine.release_all()  # stage 3: only the resting shards remain (a local operation)
    pin = pin_memory and engine.device.type == "cuda"
    reachable = _reachable_tensors(engine, optimizers)
    groups = [g for z in optimizers for g in z.groups]
    if any(k in new for k in ("hp_params", "lp_grads", "contiguous_grad_buffer", "lp_params")):
        _detach_master_grads(record, groups)
    engine.offloaded = record
    try:
        for kind in new:
            for t in _resting_on_device(engine, optimizers, groups, kind):
                if t.device != engine.device or t.untyped_storage().nbytes() == 0 or record.is_host_copy(t):
                    continue  # on the host by policy (or already moved): nothing to move
                record.moved.append(_move(kind, t, reachable, pin, non_blocking))
                record._host_keys.add(_key(record.moved[-1].host))
            record.kinds.add(kind)
    except BaseException:  # e.g. no host memory for the next copy: put back what moved, then raise
        reload(engine, non_blocking=False)
        raise
    if engine.device.type == "cuda":
        if not non_blocking:
            torch.cuda.current_stream(engine.device).synchronize()
        torch.cuda.empty_cache()  # hand the freed blocks back, so the rollout engine can have them
    return record


def _resting_on_device(engine, optimizers: list, groups: list, kind: str):
    """The tensors of ``kind`` the engine rests on the compute device (by policy)."""
    if kind == "lp_params":
        for g in engine.groups:
            if not g.shard_params:
                yield g.full
            elif not g.params.on_host:
                yield g.param_shard
    elif kind == "hp_params":
        for g in groups:
            m = g.masters
            if m is not None and not m.steps_on_host and not m.aliases_params:
                yield m.master.data
    elif kind == "optim_states":
        for z in optimizers:
            for g in z.groups:
                if g.masters is not None and not g.masters.steps_on_host:
                    for state in z.group_states(g):
                        for v in state.values():
                            if isinstance(v, torch.Tensor) and v.numel() > 1:  # a step count is a few bytes
                                yield v
    elif kind == "lp_grads":
        for g in groups:
            yield from (t for t in (g.grads.grad_shard, g.grads.carried) if t is not None)
    elif kind == "contiguous_grad_buffer":
        for g in groups:
            if g.grads.full_grad is not None:
                yield g.grads.full_grad


def _reachable_tensors(engine, optimizers: list) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Storage -> the tensors a user can reach that view it (see [Note: moving a storage, not a tensor])."""
    found: dict[tuple[int, int], list[torch.Tensor]] = {}
    seen: set[int] = set()

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and id(t) not in seen and t.untyped_storage().nbytes() > 0:
            seen.add(id(t))
            found.setdefault(_key(t), []).append(t)

    for g in engine.groups:
        for s in g.slots:
            add(s.param)
        if g.master is not None:
            add(g.master)
            add(g.master.grad)
    for z in optimizers:
        for state in z.optimizer.state.values():
            for v in state.values():
                add(v)
    return found


def _detach_master_grads(record: OffloadedStates, groups: list) -> None:
    """A master's ``.grad`` (the step's fp32 gradient, often the shard itself) is set aside while
    masters or gradients move, so no parameter holds data and gradient on different devices."""
    for g in groups:
        if g.master is not None and g.master.grad is not None:
            record._detached_grads.append((g.master, g.master.grad))
            g.master.grad = None


@torch.no_grad()
def _move(kind: str, t: torch.Tensor, reachable, pin: bool, non_blocking: bool) -> _MovedStorage:
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    device_bytes = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (nbytes,), (1,))
    host = torch.empty(nbytes, dtype=torch.uint8, device=HOST, pin_memory=pin)
    host.copy_(device_bytes, non_blocking=non_blocking and pin)
    moved = _MovedStorage(kind, storage, nbytes, host)
    for user in reachable.get(_key(t), []):
        moved.pointed.append((user, user.data))
        user.data = _host_view(host, user)
    del device_bytes
    storage.resize_(0)  # See [Note: moving a storage, not a tensor]
    return moved


# ----------------------------------------------------------------------- reload
@torch.no_grad()
def reload(engine, *, non_blocking: bool) -> None:
    """Bring back everything ``offload`` moved, bit for bit, and end the offloaded state."""
    record = engine.offloaded
    if record is None:
        return  # nothing offloaded: a no-op, as DeepSpeed's
    for m in record.moved:
        m.storage.resize_(m.nbytes)
        device_bytes = torch.empty(0, dtype=torch.uint8, device=engine.device).set_(
            m.storage, 0, (m.nbytes,), (1,))
        device_bytes.copy_(m.host, non_blocking=non_blocking and m.host.is_pinned())
        for user, own in m.pointed:
            user.data = own
    for master, grad in record._detached_grads:
        master.grad = grad
    if engine.device.type == "cuda" and not non_blocking:
        torch.cuda.current_stream(engine.device).synchronize()
    engine.offloaded = None  # the host copies go with the record (pinned blocks wait for their copies)


@contextlib.contextmanager
def offloaded(engine, optimizers: list, include, *, pin_memory: bool, non_blocking: bool):
    """:func:`offload` on entry, :func:`reload` on exit (also when the block raises). When states
    were offloaded before the block, it leaves them, and what it added, offloaded."""
    before = engine.offloaded is not None
    offload(engine, optimizers, include, pin_memory=pin_memory, non_blocking=non_blocking)
    try:
        yield
    finally:
        if not before:
            reload(engine, non_blocking=non_blocking)


def offloaded_for_generation(engine) -> contextlib.AbstractContextManager:
    """Around a generation phase: :func:`offloaded` with the kinds of
    ``ZeroConfig(offload_states_during_generation=...)``, nothing when the knob is off."""
    kinds = engine.config.offload_states_during_generation
    if not kinds:
        return contextlib.nullcontext()
    refuse_expert_parallel(engine, "ZeroConfig(offload_states_during_generation=...)")
    return offloaded(engine, engine.optimizers(), kinds, pin_memory=True, non_blocking=False)
