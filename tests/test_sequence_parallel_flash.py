"""Sequence parallelism around flash attention: every function transformers' attention registry holds is
wrapped or refused by name, and the flash path trains exactly like one process on whole sequences.

flash_attn does not run here, so the training cases (tests/workers/sequence_parallel.py, 2 ranks,
``flash=...``) run transformers' own flash path (``flash_attention_forward``, ``_flash_attention_forward``,
the kernel imported by the name in ``config._attn_implementation``) over a ``flash_attn_func`` made of
torch's SDPA; the reference is the same model in one process on the whole sequence. The kernel must be
imported by the name the model was loaded with, never by the name the SP wrapper is registered under
(transformers would then look for a Hub kernel of that name and fail), and never through its varlen
entry point (the shard's global positions are one sequence, not packed ones).
"""

from __future__ import annotations

import functools

import pytest

transformers = pytest.importorskip("transformers")

from _compare import rel  # noqa: E402
from _launch import launch_cases  # noqa: E402

from zero_strategy._model.hf import attention_kind  # noqa: E402

TOL = 1e-5
CASES = [dict(name="flash-attention-2-gqa", sp=2, stage=3, flash="flash_attention_2"),
         dict(name="hub-flash-kernel-one-kv-head", sp=2, stage=2, flash="kernels-community/flash-attn2", kv_heads=1)]

#: what the SP wrapper claims: the registry's names it wraps, by kind
WRAPPED = {"sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash", "flash_attention_4": "flash"}


def test_every_registered_attention_function_is_wrapped_or_refused_by_name():
    from transformers import AttentionInterface

    registry = dict(AttentionInterface._global_mapping)
    assert set(WRAPPED) <= set(registry), sorted(registry)  # what the issue names is there to wrap
    for name, function in registry.items():
        if name in WRAPPED:
            assert attention_kind(function, name, 2) == WRAPPED[name], name
        else:  # flex attention, paged eager, and whatever a later transformers adds
            with pytest.raises(ValueError, match=f"attn_implementation={name!r} is not supported under sequence "
                                                 "parallelism"):
                attention_kind(function, name, 2)


def test_a_hub_kernel_is_wrapped_by_its_function_not_its_name():
    """transformers registers a Hub kernel that has ``flash_attn_varlen_func`` with its own flash wrapper
    (``load_and_register_attn_kernel``): wrapped as flash; one with an entry point of its own: refused."""
    from transformers.integrations.flash_attention import flash_attention_forward

    assert attention_kind(flash_attention_forward, "kernels-community/vllm-flash-attn3", 2) == "flash"

    def kernel_forward(module, query, key, value, attention_mask, **kwargs):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="'kernels-community/flash-mla' is not supported.*kernel_forward"):
        attention_kind(kernel_forward, "kernels-community/flash-mla", 2)


@functools.lru_cache(maxsize=None)
def results():
    return launch_cases("sequence_parallel.py", 2, CASES, key=lambda r: r["case"]["name"], timeout=300)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_flash_attention_under_sequence_parallelism_matches_one_process(name):
    per_rank = results().of(name)
    for rank, res in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(res["losses"], res["ref_losses"])):
            assert rel(got, want) <= TOL, f"rank {rank} step {step}: loss {got} vs one process {want}"
        assert res["weight_rel_diff"] <= TOL, (rank, res["weight_rel_diff"], res["worst_tensor"])
        assert res["flash_imported"] == [res["case"]["flash"]], res["flash_imported"]
        assert res["attn_after_teardown"] == res["case"]["flash"]
    assert per_rank[0]["ref_losses"][0] != per_rank[0]["ref_losses"][-1], "the reference did not train"
