"""Generation at stage 3: gather every unit once for a whole ``generate()`` call.

[Note: gathered for generation]
``generate()`` runs one forward per new token, and at stage 3 each forward gathers every
unit before it runs and releases it after: a 64-token completion all-gathers the whole
model 64 times. Training needs that (the working set stays one unit or a few), but
generation runs without gradients, so nothing saved for backward depends on the
placement and the units may as well stay gathered for the whole call:

* on entry every unit with sharded groups is gathered (one all-gather per sharded flat
  group, ``prefetch + 1`` units in flight, as many as the forward keeps), and *held*:
  :meth:`Unit.release` leaves a held unit gathered, so the forward hooks' releases (a
  unit's post-forward, the root's end-of-forward ``release_all``, the gather schedule
  passing units) change nothing,
  and their gathers find the unit gathered and issue no collective. A forward inside
  the block communicates nothing, so ranks may run different numbers of them: a
  ``generate()`` inside leaves ``synced_gpus`` off (See [Note: generate() under stage 3]
  in _model/hf.py), and such forwards are not counted as calls that issue
  collectives (See [Note: naming the rank that failed] in _comm/faults.py);
* on exit, also when the block raised, the hold ends and the units that were sharded
  at entry are released again (those gathered before, inside ``gathered_parameters``,
  stay as they were);
* the block is read-only: a parameter written in place inside it would be lost at the
  release (the masters do not change), so a write is detected (the parameters' version
  counters, which the engine's gathers leave untouched) and raises at exit, naming
  ``gathered_parameters(modifier_rank=...)`` for edits. A forward with gradients enabled
  is refused at its start: its backward would run after the release;
* it is entered between iterations only (the engine idle), so an accumulation in
  progress (gradients waiting in the flat buffers, ``no_sync``) is not touched: the
  block reads parameters and writes nothing the step uses.

Memory: the whole model's parameters in the compute dtype sit on every rank for the
block (what stages 1-2 hold all the time). When that exceeds the budget the block falls
back to per-unit gathering (the forward hooks do as in training), and says so once per
model in the ``zero_strategy`` log. The default budget is the memory this rank has now
less the headroom ``zero_auto`` keeps (a quarter, for the KV cache, logits and
activations): on a GPU the free device memory, on a CPU-only run the host's available
memory shared among the ranks of the host. Every rank must decide alike (a rank that
gathers once while another gathers per unit would pair collectives wrongly), so the
decision is one scalar all-reduce: any rank over its budget makes all fall back.

Stages 1-2 (and units whose groups all stay whole under ``param_persistence_threshold``)
hold every parameter already: the block does nothing there.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from .._logging import rank_zero_logger
from .._mechanisms.available_memory import HEADROOM, host_available_bytes, human_bytes
from .._engine.flat import ShardState
from .offload_states import offloaded_for_generation

logger = rank_zero_logger("zero_strategy")


def gather_bytes(engine) -> int:
    """Bytes the block would add on this rank: the full buffer of every sharded group now sharded."""
    return sum(g.padded_numel * g.full.element_size() for u in engine.units for g in u.sharded_groups
               if g.state is ShardState.SHARDED)


def default_budget(engine) -> int:
    """What this rank may gather now: free device memory, else its share of the host's available memory,
    less ``zero_auto``'s headroom."""
    if engine.device.type == "cuda":
        available = torch.cuda.mem_get_info(engine.device)[0]
    else:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        available = host_available_bytes() // local_ranks
    return int(available * (1 - HEADROOM))


def _all_fit(engine, needed: int, budget_bytes: int | None) -> tuple[bool, int]:
    """Whether the gathered model fits the budget on every rank (one scalar all-reduce), and this rank's budget."""
    budget = default_budget(engine) if budget_bytes is None else int(budget_bytes)
    over = torch.tensor([1.0 if needed > budget else 0.0], device=engine.device)
    engine.comm.all_reduce(over, op="max", label="gathered_for_generation budget")
    return bool(over.item() == 0), budget


def _check_idle(engine) -> None:
    engine._recover_if_abandoned()  # an iteration an exception abandoned: as the next forward would
    if not engine.is_idle:
        raise RuntimeError(
            f"zero_strategy.gathered_for_generation: the model is in the middle of an iteration "
            f"({engine.training_state.value}); enter it between iterations (before the forward or after "
            "backward), e.g. around model.generate(...), not inside a forward")


@contextlib.contextmanager
def gathered_for_generation(engine, budget_bytes: int | None = None):
    """Hold every unit gathered for the block; see [Note: gathered for generation]. Every rank must enter."""
    state = engine.generation
    units = [u for u in engine.units if u.sharded_groups]
    if state.active or not units:  # nested, or nothing is sharded (stages 1-2)
        yield
        return
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"gathered_for_generation: budget_bytes={budget_bytes} must be >= 0 (or None: measured)")
    _check_idle(engine)
    needed = gather_bytes(engine)
    fits, budget = _all_fit(engine, needed, budget_bytes)
    if not fits:
        if not state.fallback_logged:
            state.fallback_logged = True
            logger.info("zero_strategy: gathered_for_generation gathers per unit: the whole model's parameters "
                        "(%s per rank) exceed the budget on at least one rank (rank %d's: %s); pass "
                        "budget_bytes=... to change it", human_bytes(needed), engine.comm.rank, human_bytes(budget))
        yield
        return
    was_sharded = [u for u in units if u.state is ShardState.SHARDED]
    engine.comm.enter("gathered_for_generation")  # See [Note: naming the rank that failed] in _comm/faults.py
    state.depth += 1
    try:
        for u in units:
            u.held = True
        window = engine.config.prefetch + 1  # in flight at once: what the NVMe slot pool is sized for
        for k, u in enumerate(was_sharded):
            with torch.profiler.record_function(f"zero::gather_for_generation::{u.name}"):
                for ahead in was_sharded[k:k + window]:
                    ahead.begin_gather(engine.comm)  # no-op for one already begun
                u.wait_gather()
        versions = [(s, s.param._version) for u in units for g in u.sharded_groups for s in g.slots]
        yield
        written = [s.fqn for s, v in versions if s.param._version != v]
        if written:
            raise RuntimeError(
                f"zero_strategy.gathered_for_generation: parameters of {written[:3]} were written in place inside "
                "the block, which is read-only (the write would be lost when the units are released). To change "
                "weights use zero_strategy.gathered_parameters(model, modifier_rank=0)")
    finally:
        state.depth -= 1
        for u in units:
            u.held = False
        for u in was_sharded:
            u.release()
        logging.getLogger("zero_strategy.engine").debug("gathered_for_generation: released %d units",
                                                         len(was_sharded))


@contextlib.contextmanager
def around_generate(engine):
    """The context every ``generate()`` of the model runs in: the training state the config names
    off the device first (``offload_states_during_generation``, which frees memory for the
    gathers), then the block when the policy says so."""
    with offloaded_for_generation(engine):
        if engine.generation.once_in_generate:
            with gathered_for_generation(engine, engine.generation.budget_bytes):
                yield
        else:
            yield
