"""A Hugging Face LlamaForCausalLM (tiny config, tied and untied embeddings) trains like DDP
under every stage, its decoder layers are found as units automatically (and, untied, its
embeddings and head too: See [Note: large modules outside the blocks] in _engine/units.py),
and ``generate()`` works under stage 3 and returns DDP's tokens."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from _launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def results(tied: bool = True):
    reps = launch("hf_llama.py", 2, {"stages": [1, 2, 3], "tied": tied}, timeout=240)
    return [{r["stage"]: r for r in rep["results"]} for rep in reps]


@pytest.mark.multiprocess
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_llama_matches_ddp(stage, tied):
    for rank, per_stage in enumerate(results(tied)):
        res = per_stage[stage]
        for zero, ref in res["losses"]:
            assert zero == pytest.approx(ref, rel=1e-5), (rank, res["losses"])
        assert res["weight_diff"] < 1e-5


@pytest.mark.multiprocess
def test_decoder_layers_are_units():
    units = results()[0][3]["units"]
    assert units == ["<root>", "model.layers.0", "model.layers.1"]  # tied: embeddings and head stay in the root


@pytest.mark.multiprocess
def test_untied_embeddings_and_head_are_units_of_their_own():
    units = results(False)[0][3]["units"]
    assert units == ["<root>", "model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_generate_matches_ddp(stage, tied):
    for per_stage in results(tied):
        res = per_stage[stage]
        assert res["generated"] == res["generated_ref"]
        assert len(res["generated"][0]) == 4 + 6
