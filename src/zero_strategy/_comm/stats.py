"""What this rank communicated: per-kind counters behind ``zero_strategy.comm_stats``.

[Note: what the byte counters count]
``volume_elements`` counts the full (unsharded) buffer of every collective, the
convention of the ZeRO paper in which DDP's all-reduce moves 2x the parameters and
stage 3 moves 3x. ``sent_bytes`` is what a bandwidth-optimal (ring) algorithm
actually sends from each rank: (N-1)/N of the volume for all-gather and
reduce-scatter, 2(N-1)/N for all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OpCounter:
    calls: int = 0
    volume_elements: int = 0
    volume_bytes: int = 0
    sent_bytes: int = 0


@dataclass
class CommStats:
    """Per-kind counters of what this rank communicated since the last reset."""

    all_gather: OpCounter = field(default_factory=OpCounter)
    reduce_scatter: OpCounter = field(default_factory=OpCounter)
    all_reduce: OpCounter = field(default_factory=OpCounter)
    #: hybrid sharding: the all-reduce of gradient shards across the shard groups
    inter_all_reduce: OpCounter = field(default_factory=OpCounter)

    KINDS = ("all_gather", "reduce_scatter", "all_reduce")

    def reset(self) -> None:
        self.all_gather = OpCounter()
        self.reduce_scatter = OpCounter()
        self.all_reduce = OpCounter()
        self.inter_all_reduce = OpCounter()

    @property
    def volume_elements(self) -> int:
        return sum(getattr(self, k).volume_elements for k in self.KINDS)

    @property
    def sent_bytes(self) -> int:
        """Bytes sent inside the shard group (the whole group when not hybrid)."""
        return sum(getattr(self, k).sent_bytes for k in self.KINDS)

    def as_dict(self) -> dict:
        out = {}
        for kind in self.KINDS + ("inter_all_reduce",):
            c = getattr(self, kind)
            out[kind] = dict(calls=c.calls, volume_elements=c.volume_elements,
                             volume_bytes=c.volume_bytes, sent_bytes=c.sent_bytes)
        out["volume_elements"] = self.volume_elements
        out["sent_bytes"] = self.sent_bytes
        out["intra_group_sent_bytes"] = self.sent_bytes
        out["inter_group_sent_bytes"] = self.inter_all_reduce.sent_bytes
        return out
