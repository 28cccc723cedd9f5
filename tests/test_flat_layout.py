"""Flat buffers: layout, padding to equal shards, views, and release/gather state."""

import math

import pytest
import torch
from torch import nn

from zero_strategy._comm.collectives import Collectives
from zero_strategy._engine.flat import FlatGroup, ShardState
from zero_strategy._engine.units import begin_gather_groups


def make_group(shapes, world_size, rank, shard_params=False, dtype=torch.float32):
    params = [(f"p{i}", nn.Parameter(torch.randn(*s))) for i, s in enumerate(shapes)]
    originals = [p.detach().clone() for _, p in params]
    g = FlatGroup("g", params, trainable=True, optimizer_group=0, shard_params=shard_params,
                  compute_dtype=dtype, grad_dtype=dtype, rank=rank, world_size=world_size,
                  device=torch.device("cpu"))
    return g, params, originals


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shapes", [[(3, 5), (7,), (1,)], [(1,)], [(4, 4), (2, 3, 2)]])
def test_padding_gives_equal_shards_covering_everything(world_size, shapes):
    total = sum(math.prod(s) for s in shapes)
    for rank in range(world_size):
        g, _, _ = make_group(shapes, world_size, rank)
        assert g.numel == total
        assert g.padded_numel % world_size == 0 and g.padded_numel - total < world_size
        assert g.shard_numel * world_size == g.padded_numel
        assert g.shard_start == rank * g.shard_numel


def test_parameters_are_views_into_the_flat_buffer():
    g, params, originals = make_group([(3, 5), (7,)], world_size=2, rank=0)
    for (_, p), orig in zip(params, originals):
        assert torch.equal(p, orig)
        assert p.untyped_storage().data_ptr() == g.full.untyped_storage().data_ptr()
    with torch.no_grad():
        params[1][1].fill_(3.0)
    assert torch.equal(g.full[15:22], torch.full((7,), 3.0))


def test_master_shard_holds_this_ranks_slice_of_the_originals():
    shapes = [(3, 5), (7,), (1,)]
    for rank in range(3):
        g, params, originals = make_group(shapes, world_size=3, rank=rank)
        flat = torch.cat([o.reshape(-1) for o in originals] + [torch.zeros(g.padded_numel - g.numel)])
        assert torch.equal(g.master.detach(), flat[g.shard_start:g.shard_start + g.shard_numel])


def test_bf16_compute_keeps_fp32_master_from_the_original_values():
    g, params, originals = make_group([(64,)], world_size=1, rank=0, dtype=torch.bfloat16)
    assert params[0][1].dtype == torch.bfloat16
    assert g.master.dtype == torch.float32
    assert torch.equal(g.master.detach()[:64], originals[0])  # not rounded through bf16


def test_stage3_release_frees_parameters_and_gather_restores_them():
    g, params, originals = make_group([(3, 5), (7,)], world_size=1, rank=0, shard_params=True)
    assert g.state is ShardState.SHARDED
    for (_, p), orig in zip(params, originals):  # true shape, no memory, NaN if read
        assert p.shape == orig.shape and p.numel() == orig.numel()
        assert p.untyped_storage().nbytes() <= p.element_size()
        assert torch.isnan(p).all()
    assert g.full.untyped_storage().nbytes() == 0
    handle = begin_gather_groups([g], Collectives(), g.name)
    assert handle is not None
    handle.wait()
    g.finish_gather()
    assert g.state is ShardState.GATHERED
    for (_, p), orig in zip(params, originals):
        assert torch.equal(p, orig)
    g.release()
    assert g.full.untyped_storage().nbytes() == 0


def test_gradients_move_into_the_flat_buffer_and_are_dropped():
    g, params, _ = make_group([(2, 2), (3,)], world_size=2, rank=1)
    for _, p in params:
        p.grad = torch.ones_like(p)
    for slot in g.slots:
        g.grads.accumulate(slot)
    for _, p in params:  # a zero-memory marker stands in for the moved gradient: reading it raises
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad.device == p.device
        with pytest.raises(RuntimeError, match="the gradient lives in the flat group's shard"):
            p.grad.sum()
    assert torch.equal(g.grads.full_grad[:7], torch.ones(7))
    assert g.grads.complete and g.grads.has_unreduced


def test_a_second_gradient_adds_and_unwritten_slots_reduce_as_zeros():
    g, params, _ = make_group([(2, 2), (3,)], world_size=1, rank=0)
    for _ in range(2):
        g.grads.before_accumulate(g.slots[0], keep_full=False)  # what the pre-accumulate hook does
        params[0][1].grad = torch.full((2, 2), 2.0)
        g.grads.accumulate(g.slots[0])     # slot 1 never gets a gradient
    handle, out = g.grads.begin_reduce(Collectives(), in_place=False)  # world of one: a copy
    handle.wait()
    assert torch.equal(g.grads.full_grad, torch.tensor([4.0, 4, 4, 4, 0, 0, 0]))
    assert torch.equal(out, g.grads.full_grad)


def test_clearing_every_marker_frees_the_buffer_when_the_next_gradient_arrives():
    """As ``set_to_none`` frees ``.grad`` on a plain model: ``model.zero_grad()`` after backward
    leaves the held gradients droppable, and the next arrival resets the whole group."""
    g, params, _ = make_group([(2, 2), (3,)], world_size=1, rank=0)
    for slot, (_, p) in zip(g.slots, params):
        p.grad = torch.ones_like(p)
        g.grads.accumulate(slot)
    for _, p in params:  # model.zero_grad()
        p.grad = None
    g.grads.before_accumulate(g.slots[0], keep_full=False)
    assert g.grads.full_grad is None and g.grads.grad_shard is None
    params[0][1].grad = torch.full((2, 2), 3.0)
    g.grads.accumulate(g.slots[0])
    assert torch.equal(g.grads.full_grad[:4], torch.full((4,), 3.0))  # nothing of the cleared one


def test_a_coalesced_gather_of_several_dtypes_moves_every_value_bit_for_bit():
    """See [Note: coalesced gathers of several dtypes]: packed in the first output's dtype, fp32 values were
    rounded to bf16 (and a bf16 buffer's raw bit patterns, a 4-bit base's packed codes, read as numbers)."""
    bf16 = torch.randn(6).to(torch.bfloat16)
    bits = torch.tensor([0x7FC1, -1, 0x7F81, 0x0001], dtype=torch.int16).view(torch.bfloat16)  # NaN payloads
    fp32 = torch.randn(5) / 3
    sources = [torch.cat([bf16, bits]), fp32]
    outputs = [torch.empty(10, dtype=torch.bfloat16), torch.empty(5)]
    Collectives().all_gather_coalesced(outputs, sources).wait()
    assert torch.equal(outputs[0].view(torch.int16), sources[0].view(torch.int16))
    assert torch.equal(outputs[1], fp32)


def test_a_coalesced_reduce_scatter_refuses_several_dtypes():
    with pytest.raises(ValueError, match="several dtypes"):
        Collectives().reduce_scatter_coalesced([torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)])
