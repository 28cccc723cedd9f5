"""``offload_states`` / ``reload_states``: training state leaves the compute device between phases
and comes back bit for bit (DeepSpeed's ``engine.offload_states()`` / ``reload_states()``).

Oracle: the same run without the round trip (weights from ``zs.full_state_dict`` and every
optimizer state tensor equal bitwise, losses equal), and for the memory figures the layout's
own formula (Adam: two fp32 moments per master element of this rank's shards, 8 bytes per
element; fp32 masters 4; bf16 parameters 2). On this CUDA-less machine the compute device is
host memory: the bytes move into new host buffers and the originals are freed, so the
mechanics are the GPU's; the memory a GPU gets back is checked in test_gpu_smoke.py.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _launch import launch
from _models import TinyLM, batch, loss_fn, param_groups
from _rollout import same, train

BF16_STAGE3 = zs.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0)
CONFIGS = {
    "zero1": "zero1", "zero2": "zero2", "zero3": zs.ZeroConfig(stage=3, param_persistence_threshold=0),
    "zero1_bf16": zs.ZeroConfig(stage=1, precision="bf16"), "zero3_bf16": BF16_STAGE3,
    "zero2_offload": "zero2_offload", "zero3_offload": "zero3_offload",
}
TRAINING_ONLY = ["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer"]


@pytest.fixture(scope="module")
def references():
    """The runs without a round trip, once per config."""
    return {name: train(cfg) for name, cfg in CONFIGS.items()}


@pytest.mark.parametrize("at", ["after_step", "before_step"])
@pytest.mark.parametrize("include", [None, TRAINING_ONLY, ["optim_states"], ["lp_params"]],
                         ids=["all", "training_only", "optim_states", "lp_params"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_continues_bit_for_bit_after_a_round_trip(references, name, include, at):
    run = train(CONFIGS[name], include=include, at=at)
    assert run["losses"] == references[name]["losses"]
    assert same(run, references[name])
    report = run["reports"]
    assert report["reloaded"].by_placement == report["before"].by_placement  # everything is back
    if include in (None, TRAINING_ONLY) and name not in ("zero2_offload", "zero3_offload"):
        assert report["offloaded"].offloaded_bytes > 0


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_bf16"])
def test_generation_while_training_state_is_offloaded_gives_the_same_logits(name):
    """The rollout phase: forward under no_grad with everything but the parameters on the host."""
    plain = train(CONFIGS[name], include=TRAINING_ONLY, at="after_step", generate=True)
    torch.manual_seed(0)
    model = TinyLM(layers=3)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), CONFIGS[name])
    for step in range(3):
        tokens, targets = batch(0, step, 0)
        loss_fn(model(tokens), targets).backward()
        zopt.step()
        zopt.zero_grad()
        with torch.no_grad():
            assert torch.equal(model(batch(0, step, 7)[0]), plain["rollout_logits"][step])
    zs.teardown(model, keep_weights=False)


def _setup(config, **kw):
    torch.manual_seed(0)
    model = TinyLM(layers=3)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), config, **kw)
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    zopt.zero_grad()
    return model, zopt


def _dropped(model, zopt, include) -> tuple[int, int]:
    """(device bytes freed by offloading ``include``, bytes the report counts as offloaded)."""
    before = zs.memory_report(model).device_bytes
    zs.offload_states(model, zopt, include=include)
    report = zs.memory_report(model)
    zs.reload_states(model)
    return before - report.device_bytes, report.offloaded_bytes


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_bf16"])
def test_memory_report_drops_by_the_bytes_the_layout_predicts(name):
    model, zopt = _setup(CONFIGS[name])
    groups = zs.api._engine_of(model).trainable_groups
    every = zs.api._engine_of(model).groups
    adam = sum(8 * g.shard_numel for g in groups)  # exp_avg + exp_avg_sq, fp32
    assert _dropped(model, zopt, ["optim_states"]) == (adam, adam)
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    assert adam == pytest.approx(8 * trainable, rel=0.01)  # 8 bytes per parameter over N=1 ranks
    if name == "zero3_bf16":  # fp32 masters of their own, bf16 parameter shards
        assert _dropped(model, zopt, ["hp_params"]) == (4 * sum(g.shard_numel for g in groups),) * 2
        assert _dropped(model, zopt, ["lp_params"]) == (2 * sum(g.shard_numel for g in every),) * 2
    else:  # fp32: the master is the parameter (shard) itself, it moves with lp_params
        assert _dropped(model, zopt, ["hp_params"]) == (0, 0)
    if name == "zero1":  # stage 1 keeps its full gradient buffers between steps
        assert _dropped(model, zopt, ["grads"]) == (4 * sum(g.padded_numel for g in groups),) * 2
    else:
        assert _dropped(model, zopt, ["grads"]) == (0, 0)  # freed by zero_grad already
    all_freed, counted = _dropped(model, zopt, None)
    assert all_freed == counted == zs.memory_report(model).device_bytes  # nothing stays on the device
    zs.teardown(model, keep_weights=False)


@pytest.mark.parametrize("name", ["zero2_offload", "zero3_offload"])
def test_what_an_offload_preset_keeps_on_the_host_is_not_moved_but_still_needs_a_reload(name):
    model, zopt = _setup(CONFIGS[name])
    assert _dropped(model, zopt, ["optim_states", "hp_params"]) == (0, 0)
    zs.offload_states(model, zopt, include=["optim_states"])
    with pytest.raises(RuntimeError, match=r"optim_states are offloaded.*reload_states\(model\)"):
        zopt.step()
    zs.reload_states(model)
    zs.teardown(model, keep_weights=False)


def test_nvme_held_state_is_not_moved(tmp_path):
    config = zs.ZeroConfig.preset("zero3_offload_nvme", offload_optimizer=zs.NVMeOffload(str(tmp_path)),
                                  offload_params=zs.NVMeOffload(str(tmp_path)))
    ref = train(config)
    run = train(config, include=None, at="after_step")
    assert same(run, ref)
    assert run["reports"]["offloaded"].offloaded_bytes == run["reports"]["before"].device_bytes


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_training_calls_refuse_while_offloaded_and_name_reload_states(name, tmp_path):
    model, zopt = _setup(CONFIGS[name])
    tokens, targets = batch(0, 1, 0)
    zs.offload_states(model, zopt, include=["lp_params"])
    with pytest.raises(RuntimeError, match=r"forward \(or generate\) while lp_params are offloaded.*reload_states"):
        model(tokens)
    with pytest.raises(RuntimeError, match="full_state_dict.*reload_states"):
        zs.full_state_dict(model)
    with pytest.raises(RuntimeError, match="save_checkpoint.*reload_states"):
        zs.save_checkpoint(tmp_path / "ckpt", model, zopt)
    with pytest.raises(RuntimeError, match="reload_states"):
        with zs.gathered_parameters(model):
            pass
    if name == "zero3":  # a state dict gathers the shards
        with pytest.raises(RuntimeError, match=r"model.state_dict\(\).*reload_states"):
            model.state_dict()
    else:  # stages 1-2: the parameters read their host copies, values intact
        assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    zs.reload_states(model)
    zs.offload_states(model, zopt, include=["optim_states"])
    loss = loss_fn(model(tokens), targets)  # the parameters are here: forward and backward run
    loss.backward()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\).*optim_states are offloaded.*reload_states"):
        zopt.step()
    zs.offload_states(model, zopt, include=["grads"])
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) while lp_grads, contiguous_grad_buffer"):
        zopt.zero_grad()
    with pytest.raises(RuntimeError, match="backward while.*reload_states"):
        loss_fn(model(tokens), targets).backward()
    zs.reload_states(model)
    zopt.step()  # and the model trains again
    zs.save_checkpoint(tmp_path / "ckpt", model, zopt)
    zs.teardown(model, keep_weights=False)


def test_user_visible_tensors_read_their_values_while_offloaded():
    model, zopt = _setup("zero2")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in s.items()} for s in zopt.optimizer.state.values()]
    saved_shard = zopt.state_dict()
    zs.offload_states(model, zopt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    for state, saved in zip(zopt.optimizer.state.values(), moments):
        assert all(torch.equal(state[k], v) for k, v in saved.items())
    shard = zopt.state_dict()["optimizer"]["state"]  # this rank's optimizer shard reads the host copies
    assert all(torch.equal(shard[i][k], v) for i, s in saved_shard["optimizer"]["state"].items()
               for k, v in s.items())
    with pytest.raises(RuntimeError, match=r"optimizer.load_state_dict\(\) while optim_states"):
        zopt.load_state_dict(saved_shard)
    with pytest.raises(RuntimeError, match=r"model.load_state_dict\(\) while hp_params, lp_params"):
        model.load_state_dict(weights)
    zs.reload_states(model)
    zs.teardown(model, keep_weights=False)


def test_a_model_set_up_without_optimizer_offloads_its_parameters():
    """A frozen reference model (DPO, GRPO with beta > 0) between its uses."""
    torch.manual_seed(0)
    model, _ = zs.setup(TinyLM(layers=2), None, BF16_STAGE3)
    tokens = batch(0, 0, 0)[0]
    with torch.no_grad():
        expected = model(tokens)
    held = zs.memory_report(model).device_bytes
    zs.offload_states(model)
    assert zs.memory_report(model).device_bytes == 0 and zs.memory_report(model).offloaded_bytes == held
    zs.reload_states(model)
    with torch.no_grad():
        assert torch.equal(model(tokens), expected)
    zs.teardown(model, keep_weights=False)


def test_double_offload_and_reload_without_offload_are_no_ops():
    model, zopt = _setup(BF16_STAGE3)
    zs.reload_states(model)  # nothing offloaded: nothing happens
    zs.offload_states(model, zopt, include=["optim_states"])
    once = zs.memory_report(model)
    zs.offload_states(model, zopt, include="optim_states")
    assert zs.memory_report(model).by_placement == once.by_placement
    zs.offload_states(model, zopt)  # adds the kinds not yet offloaded
    assert zs.memory_report(model).device_bytes == 0
    zs.reload_states(model)
    zs.reload_states(model)
    zopt.step()
    zs.teardown(model, keep_weights=False)


def test_kinds_by_deepspeed_enum_members_strings_and_our_names():
    class OffloadStateTypeEnum(str, __import__("enum").Enum):  # DeepSpeed's, as it is defined there
        optim_states = "optim_states"
        hp_params = "hp_params"

    model, zopt = _setup(BF16_STAGE3)
    by_enum = _dropped(model, zopt, [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params])
    assert by_enum == _dropped(model, zopt, ["optimizer_state", "master"]) == _dropped(
        model, zopt, ("optim_states", "hp_params"))
    with pytest.raises(ValueError, match="unknown state kind 'moments'.*optim_states, hp_params, lp_params"):
        zs.offload_states(model, zopt, include=["moments"])
    with pytest.raises(ValueError, match="device='nvme' is not supported"):
        zs.offload_states(model, zopt, device="nvme")
    other = torch.optim.AdamW(TinyLM(layers=1).parameters())
    with pytest.raises(ValueError, match="not an optimizer setup\\(\\) returned for this model"):
        zs.offload_states(model, other)
    zs.teardown(model, keep_weights=False)


def test_one_of_several_optimizers_moves_only_its_own_state():
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    blocks = [p for n, p in model.named_parameters() if n.startswith("layers.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.") and p.requires_grad]
    model, (a, b) = zs.setup(model, [torch.optim.AdamW(blocks), torch.optim.AdamW(rest)], BF16_STAGE3)
    loss_fn(model(batch(0, 0, 0)[0]), batch(0, 0, 0)[1]).backward()
    a.step(), b.step(), a.zero_grad(), b.zero_grad()
    expected = sum(8 * g.shard_numel for g in a.groups)
    before = zs.memory_report(model).device_bytes
    zs.offload_states(model, a, include=["optim_states"])
    assert before - zs.memory_report(model).device_bytes == expected
    with pytest.raises(RuntimeError, match="reload_states"):
        b.step()  # the offloaded state is the model's: every optimizer waits for the reload
    zs.reload_states(model, b)
    zs.teardown(model, keep_weights=False)


def test_states_offloaded_reloads_on_exit_also_when_the_block_raises():
    model, zopt = _setup(BF16_STAGE3)
    with pytest.raises(KeyError):
        with zs.states_offloaded(model, zopt, include=TRAINING_ONLY):
            assert zs.memory_report(model).offloaded_bytes > 0
            raise KeyError("reward function failed")
    assert zs.memory_report(model).offloaded_bytes == 0
    zopt.step()
    zs.teardown(model, keep_weights=False)


def test_the_config_knob_says_what_the_generation_phase_offloads():
    assert zs.ZeroConfig(offload_states_during_generation=True).offload_states_during_generation == tuple(
        TRAINING_ONLY)
    assert zs.ZeroConfig().offload_states_during_generation == ()
    with pytest.raises(zs.ZeroConfigError, match="lp_params .*cannot be offloaded during generation"):
        zs.ZeroConfig(offload_states_during_generation=["params"])
    with pytest.raises(zs.ZeroConfigError, match="unknown state kind 'nope'"):
        zs.ZeroConfig(offload_states_during_generation=["nope"])
    model, zopt = _setup(BF16_STAGE3.replace(offload_states_during_generation=["optim_states"]))
    with zs.states_offloaded_for_generation(model):
        with torch.no_grad():
            model(batch(0, 1, 0)[0])
        offloaded = zs.memory_report(model).by_placement["offloaded"]
    assert offloaded["optimizer_state"] == sum(8 * g.shard_numel for g in zopt.groups)
    assert zs.memory_report(model).offloaded_bytes == 0


@pytest.mark.multiprocess
def test_two_ranks_every_stage_round_trip_exact_and_memory_at_the_formula():
    for rank, rep in enumerate(launch("offload_states.py", 2, {}, timeout=240)):
        assert "error" not in rep, rep.get("error")
        for name, case in rep["cases"].items():
            assert case["same"], (rank, name)
            assert case["optim_dropped"] == case["adam_formula"], (rank, name, case)
            assert case["adam_formula"] == pytest.approx(8 * case["trainable"] / 2, rel=0.05), (rank, name)
            assert case["all_dropped"] == case["device_before"], (rank, name, case)


def test_with_overlap_step_backward_refuses_because_it_steps():
    model, zopt = _setup(zs.ZeroConfig.preset("zero2_offload", overlap_step=True))
    tokens, targets = batch(0, 1, 0)
    zs.offload_states(model, zopt, include=["optim_states"])
    with pytest.raises(RuntimeError, match="backward while optim_states are offloaded.*reload_states"):
        loss_fn(model(tokens), targets).backward()
    zs.reload_states(model)
    zs.reset_iter_state(model)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    zs.teardown(model, keep_weights=False)


def test_an_offload_that_fails_half_way_puts_back_what_it_moved(monkeypatch):
    from zero_strategy._model import offload_states as _offload_states
    model, zopt = _setup(BF16_STAGE3)
    before = zs.full_state_dict(model)
    moves = []
    real_move = _offload_states._move

    def run_out_of_host_memory(*args, **kwargs):
        if len(moves) == 3:
            raise MemoryError("no host memory left")
        moves.append(1)
        return real_move(*args, **kwargs)

    monkeypatch.setattr(_offload_states, "_move", run_out_of_host_memory)
    with pytest.raises(MemoryError):
        zs.offload_states(model, zopt)
    assert zs.memory_report(model).offloaded_bytes == 0
    after = zs.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    zopt.step()  # nothing is left offloaded
    zs.teardown(model, keep_weights=False)
