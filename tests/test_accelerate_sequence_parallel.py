"""Accelerate's sequence-parallel idiom on ZeroAccelerator: ``ParallelismConfig(sp_backend="deepspeed",
sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(...))``, or the launch config's
``parallelism_config_sp_size``, with Accelerate's own ALST test loop, trains exactly like one
process on the whole sequences; what cannot be honoured is refused by name.

Issue 40. The worker (tests/workers/accelerate_sequence_parallel.py) runs the loop of
accelerate/test_utils/scripts/external_deps/test_ds_alst_ulysses_sp.py with its two
DeepSpeed-only lines replaced by the generic ones (``.to(device)``,
``accelerator.torch_device_mesh["sp"].get_group()``) and compares every step's loss and the
final weights with the same model trained in one process by ``model(input_ids, labels).loss``.
"""

from __future__ import annotations

import functools

import pytest

from _accelerate_launch import accelerate_launch, launch_env

TOL = 1e-5


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("ZERO_STRATEGY_CONFIG", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "WORLD_SIZE",
                "ACCELERATE_USE_PARALLELISM_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch

CASES = {
    "constructor-zero3-sdpa": (dict(preset="zero3"), {}),
    "launch-config-zero2-eager-masked-prompt": (
        dict(preset="zero2", attn="eager", masked_prompt=20, from_launch_config=True),
        {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}),
}


@functools.lru_cache(maxsize=None)
def run(name: str) -> list[dict]:
    args, env = CASES[name]
    reports, _ = accelerate_launch("accelerate_sequence_parallel.py", args, env=launch_env(**env), timeout=300)
    return reports


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_the_alst_loop_trains_like_one_process(name):
    for rank, rep in enumerate(run(name)):
        assert rep["sp_group_ranks"] == [0, 1] and rep["engine_sp"] == 2, rep
        # both ranks read every sample, each half of it: 4 steps of 32/2 tokens
        assert rep["dl_len"] == 4 and rep["seqlens"] == [16, 16, 16, 16], rep
        assert rep["adapter_is_identity"], "DeepSpeed's adapter hook: the prepared loader is already sharded"
        # skip_first_batches (a resumed epoch) still yields this rank's shards of the samples after the skip
        assert rep["skipped_first_tokens"] == rep["expected_first_tokens"], rep
        for step, (got, want) in enumerate(zip(rep["losses"], rep["ref_losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank} step {step}: {got} vs one process {want}"
        assert rep["weight_rel_diff"][0] <= TOL, rep["weight_rel_diff"]
    assert rep["ref_losses"][0] != rep["ref_losses"][-1]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_sp_attention_other_than_the_models_is_refused():
    reports, _ = accelerate_launch("accelerate_sequence_parallel.py",
                                   dict(preset="zero2", attn="eager", sp_attn="sdpa", refuse=True), timeout=300)
    for rep in reports:
        assert "sp_attn_implementation='sdpa'" in rep["refused"] and "'eager'" in rep["refused"], rep


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_data_parallel_sizes_the_launch_does_not_have_are_refused():
    reports, _ = accelerate_launch("accelerate_sequence_parallel.py", dict(preset="zero2", dp_shard_size=2, refuse=True),
                                   timeout=300)
    for rep in reports:
        assert "asks for 2 data-parallel ranks" in rep["refused"] and "leave 1" in rep["refused"], rep


def test_sequence_parallelism_in_one_process_is_refused_by_name(clean_env):
    from accelerate.parallelism_config import ParallelismConfig

    from zero_strategy.accelerate import ZeroAccelerator

    with pytest.raises(ValueError, match="multiple of 2 processes, but 1 were launched"):
        ZeroAccelerator("zero2", parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))


def test_a_zero_config_asking_for_another_sequence_parallel_size_is_refused(clean_env):
    from accelerate.parallelism_config import ParallelismConfig

    from zero_strategy.accelerate import ZeroAccelerator

    with pytest.raises(ValueError, match="sp_size=2.*sequence_parallel_size=4 differ"):
        ZeroAccelerator({"preset": "zero2", "sequence_parallel_size": 4},
                        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))


def test_tensor_parallelism_beside_sequence_parallelism_is_refused(clean_env):
    from accelerate.parallelism_config import ParallelismConfig

    from zero_strategy.accelerate import ZeroAccelerator

    with pytest.raises(ValueError, match="tensor parallelism .*tp_size to 1"):
        ZeroAccelerator("zero2", parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, tp_size=2))
