"""Online trainers with use_vllm=True through ``zero_trainer``: vLLM receives the real, current weights, unit by unit.

One ``accelerate launch`` with 2 CPU processes (tests/workers/trl_vllm_sync.py) trains a tiny
Llama for 2 steps per case (GRPO; RLOO and OnlineDPO once each) with TRL's own code
(``VLLMGeneration``, OnlineDPOTrainer's push) talking to a fake vLLM engine (vLLM needs a
GPU) that records every tensor it is sent: before each generation and once more by hand
after training. Each case is compared with the stock
``GRPOTrainer`` on DDP fed the same completions, and the last sync with
``zs.full_state_dict(model)``. At stage 3 ``param_persistence_threshold=0``, so every
weight really is sharded and TRL's own iterator would read NaN placeholders.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from _accelerate_launch import accelerate_launch  # noqa: E402

CASES = ["zero3_server", "zero3_colocate", "zero2_server", "zero3_lora_server", "zero3_rloo_colocate",
         "zero3_odpo_colocate"]


@pytest.fixture(scope="module")
def reports():
    reps, log = accelerate_launch("trl_vllm_sync.py", {"cases": CASES}, timeout=300)
    for r in reps:
        for case in CASES:
            assert "error" not in r.get(case, {}), r.get(case, {}).get("error", f"{case} missing:\n{log[-3000:]}")
    return reps


def _receivers(reports, case):
    """Server mode: only the main process holds a client; colocate: every process loads weights."""
    got = [r[case] for r in reports if r[case]["receives"]]
    assert len(got) == (2 if "colocate" in case else 1)
    return got


def _sent_what_ddp_sends(rep: dict) -> None:
    assert rep["ref_wrapped"] == "DistributedDataParallel"  # the reference really is the stock trainer on DDP
    assert rep["n_syncs"] == [3, 3]  # before each of the 2 generations, then by hand
    assert rep["names_equal"] and len(rep["names"]) == 21  # every Llama weight, under vLLM's names
    assert not rep["any_nan"]
    assert max(rep["vs_ddp_rel"]) < 1e-5  # fp32 rounding of the two reductions
    assert rep["weights_moved"] > 1e-3  # the syncs carried new weights, not the initial ones again
    assert rep["changed_after_handover"][0] == []  # copies: valid after their unit is released
    assert rep["rewards"][1] and rep["losses"][1]  # the reference logged them: empty lists on both sides compare nothing
    assert rep["rewards"][0] == pytest.approx(rep["rewards"][1])
    assert rep["losses"][0] == pytest.approx(rep["losses"][1], rel=1e-5, abs=1e-7)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero3_server", "zero3_colocate"])
def test_stage_3_sends_the_full_current_weights_one_unit_at_a_time(reports, case):
    for rep in _receivers(reports, case):
        assert (rep["trainer"], rep["generation"], rep["stage"], rep["sharded"]) == (
            "ZeroGRPOTrainer", "ZeroVLLMGeneration", 3, True)
        assert rep["stock_iterator_nan"]  # TRL's own iterator would have sent the placeholders
        _sent_what_ddp_sends(rep)
        assert rep["last_vs_full_state_dict"] == 0.0 and rep["covers_every_weight"]
        assert rep["max_gathered_units"] == 1  # streamed while gathered, never more than one unit


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stage_2_sends_the_replicated_weights_through_trls_own_path(reports):
    for rep in _receivers(reports, "zero2_server"):
        assert (rep["stage"], rep["sharded"], rep["stock_iterator_nan"]) == (2, False, False)
        _sent_what_ddp_sends(rep)
        assert rep["last_vs_full_state_dict"] == 0.0 and rep["covers_every_weight"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lora_at_stage_3_sends_the_merged_base_weights_as_trl_names_them(reports):
    for rep in _receivers(reports, "zero3_lora_server"):
        assert rep["sharded"] and rep["stock_iterator_nan"]
        _sent_what_ddp_sends(rep)  # no lora_A/lora_B, no base_layer in the names; merged values equal DDP's
        assert not any("lora_" in n or "base_layer" in n for n in rep["names"])
        assert rep["max_gathered_units"] == 1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_online_dpo_trainers_own_push_streams_the_same_way(reports):
    """OnlineDPOTrainer pushes weights with its own _move_model_to_vllm_inner, which zero_trainer overrides."""
    for rep in _receivers(reports, "zero3_odpo_colocate"):
        assert (rep["trainer"], rep["sharded"], rep["stock_iterator_nan"]) == ("ZeroOnlineDPOTrainer", True, True)
        _sent_what_ddp_sends(rep)
        assert rep["last_vs_full_state_dict"] == 0.0 and rep["max_gathered_units"] == 1


def _trainer_stub(stage: int, generation=None, model=None):
    """What adopt_vllm_weight_sync reads of a trainer: its arguments, stage, model and generation backend."""
    from zero_strategy import ZeroConfig

    return types.SimpleNamespace(args=types.SimpleNamespace(use_vllm=True), model=model, vllm_generation=generation,
                                 accelerator=types.SimpleNamespace(zero_config=ZeroConfig(stage=stage)))


def test_a_trainer_with_its_own_weight_push_is_refused_at_stage_3_only():
    """The asynchronous trainers (and a trainer class not built by zero_trainer) push weights with their own
    code: no VLLMGeneration, no streaming _move_model_to_vllm_inner."""
    from zero_strategy.transformers._vllm_sync import adopt_vllm_weight_sync

    with pytest.raises(NotImplementedError, match=r"zero_config='zero2'.*use_vllm=False"):
        adopt_vllm_weight_sync(_trainer_stub(3))
    adopt_vllm_weight_sync(_trainer_stub(2))  # replicated parameters: their own code reads real weights


def test_a_non_lora_adapter_is_refused_at_stage_3():
    from peft import IA3Config, get_peft_model
    from trl.generation.vllm_generation import VLLMGeneration

    from zero_strategy.transformers._vllm_sync import adopt_vllm_weight_sync

    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                           IA3Config(target_modules=["0"], feedforward_modules=[]))
    generation = object.__new__(VLLMGeneration)  # built without vLLM: only its class matters here
    with pytest.raises(NotImplementedError, match=r"merges LoRA adapters.*IA3"):
        adopt_vllm_weight_sync(_trainer_stub(3, generation, model))
    adopt_vllm_weight_sync(_trainer_stub(2, generation, model))
    assert type(generation).__name__ == "ZeroVLLMGeneration" and isinstance(generation, VLLMGeneration)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rloo_trainer_streams_the_same_way(reports):
    """RLOOTrainer generates through the same VLLMGeneration (as do the distillation and experimental trainers)."""
    for rep in _receivers(reports, "zero3_rloo_colocate"):
        assert (rep["trainer"], rep["generation"], rep["sharded"]) == ("ZeroRLOOTrainer", "ZeroVLLMGeneration", True)
        _sent_what_ddp_sends(rep)
        assert rep["last_vs_full_state_dict"] == 0.0 and rep["max_gathered_units"] == 1
