"""Agreement between ranks for checkpointing, over the engine's ``Collectives``.

Its object collectives (``comm.broadcast_object``, ``comm.all_gather_object``) go through
:class:`zero_strategy._comm.collectives.Collectives` like every other collective, so a
subgroup ``process_group`` is honoured in one place (group ranks, ``src`` translated to a
global rank). A world of one skips them.

Checkpoint code must never leave one rank waiting in a collective while another
raised: every phase that can fail locally ends in :func:`agree`, which turns any
rank's error into the same ``CheckpointError`` on every rank.
"""

from __future__ import annotations

from ._layout import CheckpointError


def agree(comm, error: str | None) -> None:
    """Raise the same CheckpointError on every rank if any rank reports an error."""
    errors = [(r, e) for r, e in enumerate(comm.all_gather_object(error)) if e]
    if errors:
        if len(errors) == 1 or len({e for _, e in errors}) == 1:
            raise CheckpointError(errors[0][1])
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in errors))


def describe(err: BaseException) -> str:
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
