"""What the disk does in one NVMe-offloaded training step.

* The step reads each group's optimizer state (master and moments) once and writes it
  once; it writes the new parameter shard without first reading the old one it
  overwrites (it used to: a whole wasted read of every shard per step).
* A synced backward starts reading the state the step needs first, after backward's
  own parameter reads have all been issued; a ``no_sync`` backward (no step follows)
  reads none.
* Several optimizers over one model each read ahead on slots of their own: none waits
  on a slot that only another's step gives back (it did, for the slot timeout).
* A read started in backward is dropped when a checkpoint load writes new state before
  the step: the step uses the loaded state, and the loaded state rests in the swap file
  (it used to stay in host memory: the check compared with the evicted, empty master).
  Oracle: the same run with the optimizer state in host memory (CPU offload), which has
  no reads to go stale.

One process, TinyLM with every parameter sharded (threshold 0), swap files in the
test's temporary directory; the swap file's requests are recorded by key. Staging slots of
64 KiB hold each group's whole state here (the largest is 28 KB), the pipeline these
tests pin; a group larger than a slot streams in chunks (tests/test_nvme_streaming.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_strategy as zs
from zero_strategy._mechanisms.nvme import Residency
from _habits import train
from _models import TinyLM, batch, loss_fn, param_groups

pytestmark = pytest.mark.timeout(120, method="thread")  # a regression can hang in a slot wait


def _setup(tmp_path, offload="nvme", layers=2):
    torch.manual_seed(0)
    model = TinyLM(layers=layers)
    policy = {"device": "nvme", "path": str(tmp_path), "buffer_size": 4096 * 16} if offload == "nvme" else offload
    return zs.setup(model, torch.optim.AdamW(param_groups(model)),
                    zs.ZeroConfig(stage=3, param_persistence_threshold=0,
                                  offload_optimizer=policy, offload_params=policy))


class Requests:
    """Every request the swap file is given: ("read"|"write", group name, "opt"|"param", key),
    in submission order (one entry per request, however many chunks it is split into)."""

    def __init__(self, model):
        self.file = zs.api._engine_of(model).swap.file
        self.log: list[tuple[str, str, str, str]] = []
        submit = self.file.submit

        def recording(write, key, buf, start=0):
            group, kind, name = key.rsplit(":", 2)
            self.log.append(("write" if write else "read", group, kind, name))
            return submit(write, key, buf, start)

        self.file.submit = recording

    def take(self) -> list[tuple[str, str, str, str]]:
        out, self.log = self.log, []
        return out


def _backward(model, step, micro=0):
    tokens, targets = batch(0, step, micro)
    loss_fn(model(tokens), targets).backward()


def test_a_step_reads_its_state_once_and_never_the_shard_it_overwrites(tmp_path):
    model, zopt = _setup(tmp_path)
    train(model, zopt, range(1))  # the first step creates the optimizer state
    requests = Requests(model)
    _backward(model, 1)
    in_backward = requests.take()
    zopt.step()
    in_step = requests.take()
    log = in_backward + in_step
    opt_keys = {(g, n) for _, g, k, n in log if k == "opt"}
    assert {n for _, n in opt_keys} == {"master", "state.exp_avg", "state.exp_avg_sq"}
    assert {g for g, _ in opt_keys} == {g.name for g in zopt.groups}
    for g, n in opt_keys:
        assert [op for op, gg, k, nn in log if (gg, nn) == (g, n) and k == "opt"] == ["read", "write"], (g, n)
    # every trainable group's new shard is written once and never read back by the step
    assert sorted(g for op, g, k, _ in in_step if op == "write" and k == "param") == sorted(
        g.name for g in zopt.groups)
    assert [r for r in in_step if r[0] == "read" and r[2] == "param"] == []
    zopt.zero_grad()


def test_a_synced_backward_starts_the_steps_reads_after_its_own(tmp_path):
    model, zopt = _setup(tmp_path, layers=3)
    train(model, zopt, range(1))
    requests = Requests(model)
    engine = zs.api._engine_of(model)
    read_ahead = engine.swap.policy.read_ahead

    with zs.no_sync(model):  # a micro-batch that no step follows: nothing of the step is read
        _backward(model, 1, micro=0)
    assert [r for r in requests.take() if r[2] == "opt"] == []

    _backward(model, 1, micro=1)
    log = requests.take()
    opt_reads = [i for i, (op, _, k, _) in enumerate(log) if op == "read" and k == "opt"]
    param_reads = [i for i, (op, _, k, _) in enumerate(log) if op == "read" and k == "param"]
    first_groups = [g.name for g in zopt.groups][:read_ahead + 1]
    assert {log[i][1] for i in opt_reads} == set(first_groups)
    assert param_reads and min(opt_reads) > max(param_reads), log
    # the slots those reads fill are reported as staging memory, not hidden
    held = sum(s.slot.numel() for s in engine.swap._sets.values() if s.residency is Residency.READING)
    assert held > 0 and zs.memory_report(model).by_category["staging"] >= held

    zopt.step()  # the step uses them: each of those groups' state is not read a second time
    again = [(g, n) for op, g, k, n in requests.take() if op == "read" and k == "opt"]
    assert not set(first_groups) & {g for g, _ in again}
    zopt.zero_grad()


def test_a_checkpoint_loaded_between_backward_and_step_is_what_the_step_uses(tmp_path):
    runs = {}
    for offload in ("nvme", "cpu"):
        model, zopt = _setup(tmp_path, offload=offload)
        train(model, zopt, range(2))
        saved = copy.deepcopy(zopt.state_dict())  # torch's state dict holds live tensors
        train(model, zopt, range(2, 3))  # moves the state on from what was saved
        _backward(model, 3)  # NVMe: starts reading the step-3 state back
        zopt.load_state_dict(saved)
        if offload == "nvme":  # the loaded state went to the swap file, not into host memory
            assert zs.memory_report(model).by_category["optimizer_state"] == 0
        zopt.step()
        zopt.zero_grad()
        runs[offload] = zs.full_state_dict(model)
    for key, ref in runs["cpu"].items():
        torch.testing.assert_close(runs["nvme"][key], ref, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("stage", [2, 3])
def test_several_optimizers_each_read_ahead_without_waiting_on_each_others_slots(tmp_path, monkeypatch, stage):
    """Three optimizers over one model (a GAN's or a multi-head fine-tune's layout), stepped in
    the reverse of their setup order: every one starts its reads in backward, and none may wait
    on a slot that only another one's step gives back. Oracle: the plain model with the same
    three torch optimizers."""
    from zero_strategy._mechanisms import nvme as _nvme
    monkeypatch.setattr(_nvme, "SLOT_TIMEOUT_S", 20.0)  # a regression fails here instead of hanging

    def optimizers(model):
        return [torch.optim.AdamW([*model.embed.parameters(), *model.layers[0].parameters()], lr=3e-3),
                torch.optim.AdamW(model.layers[1:3].parameters(), lr=2e-3),
                torch.optim.AdamW([*model.layers[3:].parameters(), *model.final_norm.parameters()], lr=1e-3)]

    torch.manual_seed(0)
    plain = TinyLM(layers=5)  # two or more flat groups per optimizer: each reads two ahead
    model = copy.deepcopy(plain)
    nvme = {"device": "nvme", "path": str(tmp_path), "buffer_size": 4096 * 4}
    config = zs.ZeroConfig(stage=stage, param_persistence_threshold=0, offload_optimizer=nvme,
                           offload_params=nvme if stage == 3 else None)
    model, zopts = zs.setup(model, optimizers(model), config)
    ref_opts = optimizers(plain)
    for step in range(3):
        for m, opts in ((model, zopts), (plain, ref_opts)):
            _backward(m, step)
            for opt in reversed(opts):
                opt.step()
            for opt in opts:
                opt.zero_grad()
    full = zs.full_state_dict(model)
    for key, ref in plain.state_dict().items():
        torch.testing.assert_close(full[key], ref, rtol=1e-5, atol=1e-7, msg=key)
