"""A pretrained Hugging Face directory loads sharded: each rank reads only the elements
of its own shards, the result equals unsharded loading, and generate() with different
lengths per rank returns (synced_gpus). Three ways: the documented three calls (meta
build, ``setup(param_init_fn=...)``, ``load_sharded_weights``), the one-call
``zero_strategy.transformers.from_pretrained`` then ``setup``, and the same model given
to ``ZeroAccelerator.prepare`` with its optimizer. The one-call loader's own rules (key
renamings, dtype, new heads, refusals) are in tests/test_pretrained_loader.py."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from _launch import launch  # noqa: E402


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    import torch
    from transformers import LlamaForCausalLM

    from _models import tiny_llama_config
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage, loader", [(2, "three_calls"), pytest.param(3, "three_calls", marks=pytest.mark.slow),
                                           (3, "one_call"), (1, "accelerate")])
def test_sharded_loading_equals_unsharded(pretrained_dir, stage, loader):
    reports = launch("sharded_weights.py", 2, {"dir": pretrained_dir, "stage": stage, "loader": loader}, timeout=180)
    for rank, rep in enumerate(reports):
        assert rep["logit_diff"] < 1e-5, rep
        assert rep["generated"] == 5 + 3 + 2 * rank
    # together the ranks read each element once (tied embedding once), none reads it all
    assert sum(r["elements_read"] for r in reports) <= reports[0]["total"] + 2 * 16
    assert all(r["elements_read"] < 0.75 * r["total"] for r in reports)
