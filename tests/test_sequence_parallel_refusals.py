"""What sequence parallelism cannot split is refused by name, with the fix, never trained as
something else; and its batch shard is what one process would compute on the whole sequence.

Issue 40. The multi-process cases run on 2 ranks (tests/workers/sequence_parallel_cases.py):
a size that does not divide the world, a model outside transformers, a sliding-window model,
head counts the group does not divide, flex attention, packed sequences, left padding,
``generate()`` on a model set up with it. A
refused setup leaves the model's attention as it was. The one-process tests check the config
field, the DeepSpeed key and ``shard_batch`` against slices of the whole-sequence tensors.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _launch import launch

import zero_strategy as zs
from zero_strategy._comm.sequence_parallel import SequenceParallelGroup
from zero_strategy._model.sequence_parallel import shard_batch

REFUSALS = {
    "size-not-dividing-world": "size 4 must divide the number of processes, 2",
    "not-a-transformers-model": "Sequential is not one and holds none. Use a transformers model",
    "sliding-window": "MistralConfig has sliding-window",
    "heads-not-divisible": "must divide the number of attention heads (3",
    "kv-heads-not-divisible": "3 key/value heads",
    "flex-attention": "attn_implementation='flex_attention' is not supported",
    "packed-sequences": "no packing",
    "left-padding": "padding at the end of each row",
    "generate": "generate() is not supported on a model set up with sequence_parallel_size=2",
}


@functools.lru_cache(maxsize=None)
def refusals() -> dict:
    reports = launch("sequence_parallel_cases.py", 2, {"mode": "refusals", "cases": list(REFUSALS)}, timeout=300)
    return {r["case"]: r for r in reports[0]["results"]}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_be_split_is_refused_by_name(case):
    got = refusals().get(case)
    assert got is not None, "the case did not run"
    assert got["type"] == "ValueError" and REFUSALS[case] in got["message"], got
    if case not in ("packed-sequences", "left-padding", "generate"):  # refused at setup: the model is as it was
        assert got["attn_after"] == got["attn_before"], got
    if case == "generate":
        assert got["generated_after_teardown"] == 5, got  # teardown gives the model its generate() back


def test_the_config_field_takes_sizes_of_one_and_more():
    assert zs.ZeroConfig().sequence_parallel_size == 1
    assert zs.ZeroConfig(sequence_parallel_size=4).to_dict()["sequence_parallel_size"] == 4
    assert zs.ZeroConfig.from_dict(zs.ZeroConfig(sequence_parallel_size=2).to_dict()).sequence_parallel_size == 2
    for bad in (0, -2, "two", 1.5):
        with pytest.raises(zs.ZeroConfigError, match="sequence_parallel_size"):
            zs.ZeroConfig(sequence_parallel_size=bad)


def test_deepspeeds_sequence_parallel_size_is_translated():
    cfg = zs.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}, "sequence_parallel_size": 2})
    assert cfg.sequence_parallel_size == 2


def test_sequence_parallelism_without_torch_distributed_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), {"preset": "zero1", "sequence_parallel_size": 2})


def test_the_shards_are_slices_of_the_whole_sequence_with_its_shifted_labels():
    ids = torch.arange(10, 17).unsqueeze(0)           # 7 tokens: padded to 8 for 2 ranks
    labels = ids.clone()
    labels[:, :5] = -100                               # shard 0's shifted labels: all -100
    whole = dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), note="kept")
    shards = [shard_batch(whole, SequenceParallelGroup(None, r, 2), pad_token_id=0) for r in range(2)]
    assert [s["input_ids"].tolist() for s in shards] == [[[10, 11, 12, 13]], [[14, 15, 16, 0]]]
    assert [s["position_ids"].tolist() for s in shards] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # the label of a shard's last token is the next shard's first token; the pad has none
    assert [s["shift_labels"].tolist() for s in shards] == [[[-100, -100, -100, -100]], [[15, 16, -100, -100]]]
    assert all("labels" not in s and "attention_mask" not in s and s["note"] == "kept" for s in shards)
