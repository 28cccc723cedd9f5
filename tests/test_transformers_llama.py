"""A Hugging Face LlamaForCausalLM (tiny config, tied embeddings) trains like DDP
under every stage, its decoder layers are found as units automatically, and
``generate()`` works under stage 3 and returns DDP's tokens."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from _launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def results():
    reps = launch("hf_llama.py", 2, {"stages": [1, 2, 3]}, timeout=240)
    return [{r["stage"]: r for r in rep["results"]} for rep in reps]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_llama_matches_ddp(stage):
    for rank, per_stage in enumerate(results()):
        res = per_stage[stage]
        for zero, ref in res["losses"]:
            assert zero == pytest.approx(ref, rel=1e-5), (rank, res["losses"])
        assert res["weight_diff"] < 1e-5


@pytest.mark.multiprocess
def test_decoder_layers_are_units():
    units = results()[0][3]["units"]
    assert units == ["<root>", "model.layers.0", "model.layers.1"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_generate_matches_ddp(stage):
    for per_stage in results():
        res = per_stage[stage]
        assert res["generated"] == res["generated_ref"]
        assert len(res["generated"][0]) == 4 + 6
