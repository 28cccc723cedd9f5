"""The working set of an estimate: what a rank holds beyond its resting model states.

[Note: the estimated working set]
The ZeRO formula counts what rests (shards, masters, optimizer state); a rank runs out of
memory at the worst moment of a step, when it also holds the working set the engine
measures in ``memory_report(...).peak_working_set`` (See [Note: the working set] in
_mechanisms/memory.py). The estimate counts the same three categories, each as the
engine allocates it, with P and G the bytes of a compute-dtype and a gradient element,
Ψ trainable and Ψf frozen parameters, N ranks, and the units of ``unit_sizes``:

* **gathered** (stage 3, device): the root (outside every unit: gathered from the start
  of forward to the end of backward), the unit in use and ``prefetch`` units gathered
  ahead: P·(root + (1 + prefetch)·largest), at most P·(Ψ + Ψf). Parameters under
  ``param_persistence_threshold`` rest whole and are not gathered; counting them here
  too overestimates by their (small) size.
* **grad_buckets** (device): stage 1 keeps each group's full gradient from backward to
  the step (reduced in place there): GΨ, which the ZeRO formula already counts as its
  resting gradients (stage 1's (P + G)Ψ), so the peak holds it once. Stages 2-3
  reduce-scatter each unit's bucket once its gradients are in, with up to
  ``MAX_IN_FLIGHT`` (4; 1 with ``overlap_step``) reduce-scatters in flight while the
  unit in backward fills one more and the root's waits for the end of backward:
  G·min(Ψ, root + (MAX_IN_FLIGHT + 1)·largest).
* **staging** (host, pinned): with the optimizer offloaded, updated parameters are
  uploaded cast on the host through a ring of 2 slots of at most ``STAGING_SLOT_BYTES``
  (64 MiB; the largest parameter shard in the compute dtype when smaller), on a GPU only
  (a CPU-only machine copies in place). NVMe offload adds its slot pool:
  max(buffer_count, read_ahead + 4) slots, at stage 3 at least (prefetch + 2)·g +
  read_ahead + 4 (g: sharded flat groups of the largest unit), as ``size_swap_pool`` grows
  it; a slot grows to the largest set it is asked for, at most ``buffer_size``: a group's
  optimizer set (fp32 master + optimizer state, 4 + S bytes per element of its shard) or
  its parameter shard (P), each tensor rounded up to 4096 bytes. The resting ``host_staging`` counts
  buffer_count·buffer_size per NVMe policy; the peak counts the pool once, at the larger
  of the two figures.

Padding: each flat group is padded to a multiple of N elements, up to N - 1 more each,
allowed for 8 groups per unit (sharded and persistent, trainable and frozen, two
optimizer parameter groups). The "owned" optimizer layout pads more and is not covered.

Without a model (a parameter count only) the unit sizes are unknown: the gathered window
and the stage 2-3 buckets are ``None`` (reported as "n/a"), never guessed; stage 1's
full gradient and the staging caps need no unit sizes and are given (the NVMe pool at
stage 3 then assumes one sharded group per unit). DDP (stage 0) is
the reference, not this engine: its working set is ``None`` too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._config.policies import NVMeOffload
from ._engine.reduce import MAX_IN_FLIGHT
from ._mechanisms.transfers import STAGING_SLOT_BYTES, STAGING_SLOTS

#: NVMe I/O rounds each tensor of a set up to this many bytes (_mechanisms/nvme_stream.py)
_ALIGN_BYTES = 4096
#: flat groups per unit the padding allowance covers (see the Note)
_GROUPS_PER_UNIT = 8


@dataclass(frozen=True)
class UnitSizes:
    """Parameter elements of the stage-3 units of a model (see [Note: choosing units] in _engine/units.py).

    ``root``: elements outside every unit (embeddings, final norm, head), gathered from the
    start of forward to the end of backward; ``largest``: the largest unit; ``count``: units;
    ``sharded_groups``: flat groups of sharded parameters in the unit that has most (one per
    dtype and trainability among parameters at or above the persistence threshold).
    """

    root: int
    largest: int
    count: int
    sharded_groups: int = 1

    def live_bytes(self, param_bytes: int, grad_bytes: int, prefetch: int = 1) -> int:
        """Stage-3 parameters materialised at the peak (the root, the unit in use and ``prefetch``
        units ahead) and one unit's full gradient. Kept for existing callers; the estimate's
        working set (``estimate_memory(model, ...).working_set_device``) counts the gradient
        buckets the engine really keeps in flight."""
        return param_bytes * (self.root + (1 + prefetch) * self.largest) + grad_bytes * self.largest


def unit_sizes(model: torch.nn.Module, unit_classes: Sequence[str] = (),
               persistence_threshold: int = 100_000) -> UnitSizes:
    """Units as setup would choose them; reads only ``numel`` (works on the meta device)."""
    from ._engine.units import find_unit_modules

    units = find_unit_modules(model, tuple(unit_classes))
    seen: set[int] = set()
    sizes, groups = [], [0]
    for _, module in units:
        n, kinds = 0, set()
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
                if p.numel() >= persistence_threshold:
                    kinds.add((p.dtype, p.requires_grad))
        sizes.append(n)
        groups.append(len(kinds))
    total = sum(p.numel() for p in model.parameters())
    return UnitSizes(root=total - sum(sizes), largest=max(sizes, default=0), count=len(sizes),
                     sharded_groups=max(1, max(groups)))


@dataclass(frozen=True)
class WorkingSetTerms:
    """The three categories of [Note: the estimated working set], bytes per rank (None: unknown)."""

    gathered: int | None
    grad_buckets: int | None
    staging: int


def working_set_terms(units: UnitSizes | None, *, stage: int, world_size: int, psi: int, psi_f: int, p: int,
                      g: int, opt, par, prefetch: int = 1, overlap_step: bool = False,
                      one_memory: bool = False, state_bytes: int = 8) -> WorkingSetTerms | None:
    """Apply [Note: the estimated working set] to one setup; None for DDP (stage 0).
    ``state_bytes``: optimizer-state bytes per parameter (S; Adam 8)."""
    if stage == 0:
        return None
    n = world_size
    pad = 0 if units is None else (units.count + 1) * _GROUPS_PER_UNIT * (n - 1)
    gathered: int | None = 0
    if stage == 3:
        gathered = None if units is None else p * min(psi + psi_f, units.root + (1 + prefetch) * units.largest + pad)
    if stage == 1:
        grad_buckets: int | None = g * (psi + (0 if units is None else pad))
    elif units is None:
        grad_buckets = None
    else:
        in_flight = 1 if overlap_step else MAX_IN_FLIGHT
        grad_buckets = g * min(psi + pad, units.root + (in_flight + 1) * units.largest + pad)
    staging = _staging(units, stage, n, p, opt, par, prefetch, one_memory, state_bytes)
    return WorkingSetTerms(gathered, grad_buckets, staging)


def _staging(units: UnitSizes | None, stage: int, n: int, p: int, opt, par, prefetch: int, one_memory: bool,
             state_bytes: int) -> int:
    """Host staging buffers at their largest: the cast-upload ring and the NVMe slot pool."""
    # the largest flat group's shard, in elements (None: no model)
    shard = None if units is None else math.ceil(max(units.root, units.largest) / n)
    ring = 0
    if opt is not None and not one_memory:
        slot = STAGING_SLOT_BYTES if shard is None else min(STAGING_SLOT_BYTES, p * shard)
        ring = STAGING_SLOTS * slot
    nvme = next((q for q in (opt, par) if isinstance(q, NVMeOffload)), None)
    if nvme is None:
        return ring
    slots = max(nvme.buffer_count, nvme.read_ahead + 4)
    if stage == 3:
        per_unit = 1 if units is None else units.sharded_groups
        slots = max(slots, (prefetch + 2) * per_unit + nvme.read_ahead + 4)
    slot = nvme.buffer_size
    if shard is not None:
        tensors = 1 + math.ceil(state_bytes / 4)  # the master and each fp32 state tensor
        largest_set = max((4 + state_bytes) * shard if isinstance(opt, NVMeOffload) else 0,
                          p * shard if isinstance(par, NVMeOffload) else 0)
        slot = min(slot, largest_set + tensors * _ALIGN_BYTES)
    return ring + slots * slot
