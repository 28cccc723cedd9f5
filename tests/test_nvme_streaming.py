"""A flat group larger than an NVMe staging buffer streams through the buffers in chunks.

Before, every staging slot grew to the largest group's master and optimizer state (a
language model's root group, embeddings and LM head, is often half the model), and the
pipeline held several: NVMe offload then saved almost nothing. Now the staging holds at
most its slots of ``buffer_size`` bytes (See [Note: bounded staging] in
_mechanisms/nvme_stream.py), and a larger group's step, gather and shard write go chunk
by chunk.

* The step in chunks is the step (See [Note: a step in chunks is the step]): equal,
  bit for bit, to the same run whose groups step whole (CPU offload: one optimizer call
  per group on the same engine), for fused, foreach and for-loop AdamW, Adam with
  amsgrad, SGD with Nesterov momentum and RMSprop, weights and optimizer state; and
  close to a plain torch model with the same optimizer (the independent oracle). Also
  with the smallest buffer the config allows (4096 bytes: smaller than one chunk of a
  parameter, which still trains, by chunks of ``ALIGN_ELEMS`` elements).
* Parameters of a streamed group that no rank used keep their values and state, as with
  the whole-group step (the untouched rule, applied per chunk).
* The staging never exceeds its configured slots, read from the engine's working-set peak
  (``memory_report``) across setup, forward, backward, the step, ``state_dict`` and a
  checkpoint round trip, on a model whose largest group is many buffers.
* A checkpoint save writes a streamed group piece by piece through the slots, and loads back
  exactly into a run whose groups rest whole; a full state dict reads its master that way.
* A streamed step that fails part way marks the store failed (the swap file holds half a
  step) instead of resuming from it.

One process (world size 1: the same code path, communication skipped); the two-rank run
and the process's own memory are in tests/test_nvme_streaming_ranks.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy._mechanisms.nvme import NVMeError
from zero_strategy._mechanisms.nvme_stream import ALIGN_ELEMS
from _habits import train
from _models import TinyLM, param_groups

pytestmark = pytest.mark.timeout(180, method="thread")  # a regression can hang in a slot wait

BUFFER = 64 * 1024  # bytes per staging slot: the root group (98k elements, 1.2 MB of AdamW state) is 18 of them

OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=3e-3, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=True),
    "adamw_loop": lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=False),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=3e-3, amsgrad=True, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=3e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
}


def _model():
    torch.manual_seed(0)
    return TinyLM(layers=2, dim=48, vocab=2048)


def _setup(model, make_opt, offload, stage=3):
    return zs.setup(model, make_opt(param_groups(model)),
                    zs.ZeroConfig(stage=stage, param_persistence_threshold=0, offload_optimizer=offload,
                                  offload_params=offload if stage == 3 else None))


def _nvme(tmp_path, buffer=BUFFER):
    return {"device": "nvme", "path": str(tmp_path), "buffer_size": buffer}


def _largest_state_bytes(model) -> int:
    return max(12 * g.shard_numel for g in zs.api._engine_of(model).trainable_groups)


def _slot_bound(model) -> tuple[int, int]:
    """(slots, bytes per slot): the most staging the store may hold."""
    pool = zs.api._engine_of(model).swap.pool
    return pool.count, max(pool.slot_bytes, ALIGN_ELEMS * 12)


def _assert_equal_state(got, want):
    got, want = got.state_dict()["optimizer"]["state"], want.state_dict()["optimizer"]["state"]
    assert got.keys() == want.keys()
    for i in want:
        for k, v in want[i].items():
            torch.testing.assert_close(got[i][k], v, rtol=0, atol=0, msg=f"state {i}.{k}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_streamed_step_equals_the_whole_group_step(tmp_path, name):
    make = OPTIMIZERS[name]
    plain = _model()
    whole, whole_opt = _setup(copy.deepcopy(plain), make, "cpu")
    streamed, streamed_opt = _setup(copy.deepcopy(plain), make, _nvme(tmp_path))
    assert all(g.masters.streams for g in zs.api._engine_of(streamed).trainable_groups if g.shard_numel > 4096)
    assert _largest_state_bytes(streamed) > 16 * BUFFER
    plain_opt = make(param_groups(plain))
    for m, o in ((plain, plain_opt), (whole, whole_opt), (streamed, streamed_opt)):
        train(m, o, range(3))
    mine, ref = zs.full_state_dict(streamed), zs.full_state_dict(whole)
    for key in ref:
        torch.testing.assert_close(mine[key], ref[key], rtol=0, atol=0, msg=key)
    _assert_equal_state(streamed_opt, whole_opt)
    for key, ref in plain.state_dict().items():  # the independent oracle: torch on the plain model
        torch.testing.assert_close(mine[key], ref, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_smallest_buffer_still_trains_by_chunks(tmp_path, stage):
    """buffer_size=4096 holds fewer elements than one chunk of AdamW's state: a slot then holds one
    chunk of ALIGN_ELEMS elements (no error, no whole-group slot)."""
    make = OPTIMIZERS["adamw_fused"]
    plain = _model()
    streamed, opt = _setup(copy.deepcopy(plain), make, _nvme(tmp_path, buffer=4096), stage=stage)
    train(streamed, opt, range(2))
    train(plain, make(param_groups(plain)), range(2))
    buffers = zs.api._engine_of(streamed).swap.pool.buffers()  # (before full_state_dict, which drops idle ones)
    assert buffers and max(b.numel() for b in buffers) <= ALIGN_ELEMS * 12
    full = zs.full_state_dict(streamed)
    for key, ref in plain.state_dict().items():
        torch.testing.assert_close(full[key], ref, rtol=1e-5, atol=1e-6, msg=key)


class TwoHeads(nn.Module):
    """Two output heads in the root group; each step uses one, so the other is untouched there."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(2048, 32)
        self.head_a = nn.Linear(32, 2048)
        self.head_b = nn.Linear(32, 2048)
        self.use_b = False

    def forward(self, tokens):
        return (self.head_b if self.use_b else self.head_a)(self.embed(tokens))


def test_untouched_parameters_of_a_streamed_group_keep_their_values_and_state(tmp_path):
    """Oracle: DDP's rule (a parameter no rank has a gradient for keeps its value, weight decay
    included), and the same run with whole-group steps, bit for bit."""
    from _models import batch, loss_fn

    def run(offload):
        torch.manual_seed(0)
        model = TwoHeads()
        initial_b = model.head_b.weight.detach().clone()
        model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                              zs.ZeroConfig(stage=3, param_persistence_threshold=0, offload_optimizer=offload,
                                            offload_params=offload))
        for step, use_b in enumerate([False, False, True, False]):
            if step == 2:  # head_b had no gradient so far: untouched, decay included
                torch.testing.assert_close(zs.full_state_dict(model)["head_b.weight"], initial_b, rtol=0, atol=0)
            model.use_b = use_b
            tokens, targets = batch(0, step, 0)
            loss_fn(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one unit (no repeated blocks), heads kept behind: both said
        whole, whole_opt = run("cpu")
        streamed, streamed_opt = run(_nvme(tmp_path))
    assert any(g.masters.streams and g.shard_numel > 8 * ALIGN_ELEMS for g in zs.api._engine_of(streamed).trainable_groups)
    mine, ref = zs.full_state_dict(streamed), zs.full_state_dict(whole)
    for key in ref:
        torch.testing.assert_close(mine[key], ref[key], rtol=0, atol=0, msg=key)
    _assert_equal_state(streamed_opt, whole_opt)


def test_staging_never_exceeds_its_slots(tmp_path):
    model, opt = _setup(_model(), OPTIMIZERS["adamw_fused"], _nvme(tmp_path, buffer=BUFFER // 2))
    slots, per_slot = _slot_bound(model)
    largest = _largest_state_bytes(model)
    assert largest > 2 * slots * per_slot, "the model could not tell a whole-group slot from the bound"
    train(model, opt, range(2))
    model.state_dict()
    saved = copy.deepcopy(opt.state_dict())  # brings every group in (whole, outside the slots) and out
    opt.load_state_dict(saved)
    train(model, opt, range(2, 3))
    report = zs.memory_report(model)
    buffers = zs.api._engine_of(model).swap.pool.buffers()
    assert max(b.numel() for b in buffers) <= per_slot
    # the slots the store keeps, and at the worst moment of each phase (a whole set brought in
    # for the optimizer's state dict is counted too, and is gone once it is written back)
    assert report.by_category["staging"] <= slots * per_slot
    assert report.working_set["staging"] <= slots * per_slot
    # a checkpoint brings one group in whole: its optimizer set and (stage 3) its parameter
    # shard, each tensor 4096-aligned as the store lays them out
    store, whole_group = zs.api._engine_of(model).swap, {}
    for key in store._meta:
        whole_group[key[0]] = whole_group.get(key[0], 0) + store._slot_bytes(key)
    largest_group = max(whole_group.values())
    assert largest < largest_group < 2 * largest
    assert report.peak_working_set["staging"] <= slots * per_slot + largest_group
    zs.memory_report(model, reset_peak=True)
    train(model, opt, range(3, 4))
    report = zs.memory_report(model)
    assert report.peak_working_set["staging"] <= slots * per_slot, report
    assert 0 < report.peak_working_set["gathered"] <= 4 * sum(g.padded_numel for g in zs.api._engine_of(model).groups)
    assert report.peak_working_set["grad_buckets"] > 0
    assert report.peak_working_set_bytes >= max(report.peak_working_set.values())


def test_a_checkpoint_streams_a_group_larger_than_a_slot_and_loads_back_exactly(tmp_path):
    """``save_checkpoint`` writes a streamed group's master and state piece by piece through the
    slots, and ``full_state_dict`` reads its master alone that way (before, both brought the
    group in whole, outside them); the checkpoint loads into a run whose groups rest whole in
    host memory (CPU offload) as the same weights and state."""
    model, opt = _setup(_model(), OPTIMIZERS["adamw_fused"], _nvme(tmp_path / "swap", buffer=BUFFER // 2))
    slots, per_slot = _slot_bound(model)
    assert _largest_state_bytes(model) > 2 * slots * per_slot, "the model could not tell a whole group from the slots"
    train(model, opt, range(2))
    zs.memory_report(model, reset_peak=True)
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert zs.memory_report(model).peak_working_set["staging"] <= slots * per_slot
    zs.memory_report(model, reset_peak=True)
    ref = zs.full_state_dict(model)
    assert zs.memory_report(model).peak_working_set["staging"] <= slots * per_slot
    whole, whole_opt = _setup(_model(), OPTIMIZERS["adamw_fused"], "cpu")
    zs.load_checkpoint(tmp_path / "ckpt", whole, whole_opt)
    mine = zs.full_state_dict(whole)
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], rtol=0, atol=0, msg=k)
    _assert_equal_state(whole_opt, opt)


@pytest.mark.parametrize("stage", [3, 2])
def test_a_resume_streams_a_group_larger_than_a_slot_and_continues_exactly(tmp_path, stage):
    """``load_checkpoint`` into a run whose largest group streams reads master and state into the
    slots chunk by chunk and writes the parameter shard the same way (before, the group came in
    whole, twice: to load, then to publish); the resumed run then trains as the run that never
    stopped, bit for bit (See [Note: a streamed resume] in checkpoint/_load.py)."""
    buffer = BUFFER // 2
    model, opt = _setup(_model(), OPTIMIZERS["adamw_fused"], _nvme(tmp_path / "swap", buffer=buffer), stage)
    slots, per_slot = _slot_bound(model)
    assert _largest_state_bytes(model) > 2 * slots * per_slot, "the model could not tell a whole group from the slots"
    train(model, opt, range(2))
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    train(model, opt, range(2, 4))
    torch.manual_seed(1)  # other initial weights: the load must overwrite every one
    resumed, resumed_opt = _setup(TinyLM(layers=2, dim=48, vocab=2048), OPTIMIZERS["adamw_fused"],
                                  _nvme(tmp_path / "swap2", buffer=buffer), stage)
    zs.memory_report(resumed, reset_peak=True)
    zs.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    assert zs.memory_report(resumed).peak_working_set["staging"] <= slots * per_slot
    train(resumed, resumed_opt, range(2, 4))
    ref, mine = zs.full_state_dict(model), zs.full_state_dict(resumed)
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], rtol=0, atol=0, msg=k)
    _assert_equal_state(resumed_opt, opt)


def test_a_streamed_step_that_fails_part_way_is_not_resumed(tmp_path):
    model, opt = _setup(_model(), OPTIMIZERS["adamw_fused"], _nvme(tmp_path))
    train(model, opt, range(1))
    step_masters = opt.offloaded._step_masters
    calls = []

    def failing(groups, window=None):
        calls.append(window)
        if window is not None and window[0] > 0:
            raise RuntimeError("simulated failure in the optimizer")
        step_masters(groups, window)

    opt.offloaded._step_masters = failing
    with pytest.raises(NVMeError, match=r"streamed in chunks .* stopped part way \(RuntimeError: simulated "
                                        r"failure in the optimizer\); the swap file holds part of a step"):
        train(model, opt, range(1, 2))
    opt.offloaded._step_masters = step_masters
    with pytest.raises(NVMeError, match="an earlier NVMe operation .* failed"):
        train(model, opt, range(2, 3))
    zs.teardown(model, keep_weights=False)
