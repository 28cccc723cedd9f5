"""``zs.gathered_for_generation(model)``: a stage-3 ``generate()`` that gathers each unit once.

Oracle: an unsharded copy of the same tiny Llama generating the same prompts (greedy, and
sampled from one seed), per rank on 2 gloo ranks with prompts of different lengths; for
training, torch DDP on the same batches without generating. The gather count is read from
the engine's all-gather counter: inside the block one (coalesced) all-gather per unit with
sharded groups for the whole generate(); without it one per unit per new token
(tests/workers/generation_gather.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _launch import launch  # noqa: E402

CASES = [
    {"name": "zero3", "kind": "generate", "config": "zero3"},
    {"name": "zero3_offload", "kind": "generate", "config": "zero3_offload"},
    {"name": "zero3_offload_nvme", "kind": "generate", "config": "zero3_offload_nvme"},
    {"name": "zero2", "kind": "generate", "config": "zero2"},
    {"name": "tiny_budget", "kind": "generate", "config": "zero3", "budget": 1024},
    {"name": "training", "kind": "training", "config": "zero3"},
    {"name": "refusals", "kind": "refusals", "config": "zero3"},
]


@pytest.fixture(scope="module")
def reports():
    reps = launch("generation_gather.py", 2, {"cases": CASES}, timeout=150)
    for r in reps:
        for case in CASES:
            assert "error" not in r[case["name"]], r[case["name"]].get("trace", r[case["name"]])
    return reps


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zero3", "zero3_offload", "zero3_offload_nvme"])
def test_stage_3_generates_what_the_plain_model_does_gathering_each_unit_once(reports, name):
    for r in reports:
        case = r[name]
        assert case["greedy_equal"] and case["sampled_equal"] and case["per_unit_equal"]
        assert case["uneven_equal"]  # ranks that stop at different steps (no synced_gpus needed inside)
        assert case["sharded_groups"] > case["sharded_units"] > 2  # root parts and blocks, every parameter sharded
        assert case["gathers_in_block"] == case["sharded_units"]  # once per unit (coalesced) for the whole call
        assert case["gathers_without_block"] >= 6 * case["sharded_units"]  # 6 new tokens, each gathering all
        assert case["states_after"] == ["sharded"]  # released at exit
        assert case["log"] == []


@pytest.mark.multiprocess
def test_stage_2_is_untouched(reports):
    for r in reports:
        case = r["zero2"]
        assert case["stage"] == 2 and case["sharded_groups"] == 0
        assert case["greedy_equal"] and case["sampled_equal"]
        assert case["gathers_in_block"] == 0 == case["gathers_without_block"]


@pytest.mark.multiprocess
def test_a_budget_the_model_exceeds_falls_back_to_per_unit_gathers_with_one_log_line(reports):
    rank0, rank1 = reports
    for r in reports:
        case = r["tiny_budget"]
        assert case["greedy_equal"] and case["sampled_equal"] and case["uneven_equal"]  # synced_gpus again
        assert case["gathers_in_block"] == case["gathers_without_block"]  # per unit, as without the block
    assert len(rank0["tiny_budget"]["log"]) == 1 and "per unit" in rank0["tiny_budget"]["log"][0]
    assert rank1["tiny_budget"]["log"] == []  # a rank-0 line (the decision is the same on every rank)


@pytest.mark.multiprocess
def test_generating_between_micro_batches_and_steps_leaves_training_equal_to_ddp(reports):
    for r in reports:
        case = r["training"]
        assert case["losses"] == pytest.approx(case["ref_losses"], rel=1e-5)
        assert case["weights_rel"] < 1e-5, case["worst"]
        assert case["states_after"] == ["sharded"]


@pytest.mark.multiprocess
def test_writes_and_grad_forwards_are_refused_and_an_exception_still_releases(reports):
    for r in reports:
        case = r["refusals"]
        assert "read-only" in case["raised"]["write"] and "gathered_parameters" in case["raised"]["write"]
        assert "torch.no_grad()" in case["raised"]["grad_forward"]
        assert case["raised"]["exception"] == "'inside'"
        assert case["states"] == {"write": ["sharded"], "grad_forward": ["sharded"], "exception": ["sharded"]}
        # the write was discarded and nothing else moved: the next step equals DDP's first
        assert case["losses"] == pytest.approx(case["ref_losses"], rel=1e-5)
        assert case["weights_rel"] < 1e-5


# ---- one process (a world of one): the argument checks and the block's bookkeeping ----------------------------


def _one_rank_model(stage: int = 3):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero_strategy as zs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    zs.setup(model, torch.optim.AdamW(model.parameters()), {"stage": stage, "param_persistence_threshold": 0})
    return model


def test_a_negative_budget_and_a_model_not_set_up_are_refused():
    import torch

    import zero_strategy as zs

    model = _one_rank_model()
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        with zs.gathered_for_generation(model, budget_bytes=-1):
            pass
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        zs.gather_once_in_generate(model, budget_bytes=-1)
    with pytest.raises(ValueError, match="not set up"):
        with zs.gathered_for_generation(torch.nn.Linear(2, 2)):
            pass


def test_a_nested_block_holds_until_the_outer_one_ends():
    import torch

    import zero_strategy as zs

    model = _one_rank_model()
    engine = zs.api._engine_of(model)
    states = lambda: {u.state.value for u in engine.units if u.sharded_groups}  # noqa: E731
    with zs.gathered_for_generation(model):
        with torch.no_grad(), zs.gathered_for_generation(model):
            model(input_ids=torch.tensor([[1, 2, 3]]))
        assert states() == {"gathered"}  # the inner exit released nothing
    assert states() == {"sharded"}


def test_inside_a_forward_the_block_is_refused():
    import torch

    import zero_strategy as zs

    model = _one_rank_model()
    raised = []

    def enter_inside(module, args):
        try:
            with zs.gathered_for_generation(model):
                pass
        except RuntimeError as e:
            raised.append(str(e))

    handle = model.model.layers[0].register_forward_pre_hook(enter_inside)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    handle.remove()
    assert raised and "between iterations" in raised[0]


def test_gather_once_in_generate_makes_generate_gather_once():
    import torch

    import zero_strategy as zs

    model = _one_rank_model()
    engine = zs.api._engine_of(model)
    seen = []
    original = engine.units[1].release

    ids = torch.tensor([[1, 2, 3]])
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    per_unit = model.generate(input_ids=ids, **kwargs)
    zs.gather_once_in_generate(model)
    engine.units[1].release = lambda: (seen.append(engine.units[1].held), original())
    once = model.generate(input_ids=ids, **kwargs)
    assert torch.equal(per_unit, once)
    assert seen and all(seen[:-1]) and seen[-1] is False  # held during the call, released at its end
