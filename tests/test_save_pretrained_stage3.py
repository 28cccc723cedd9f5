"""``save_pretrained`` of a stage-3 model writes the trained weights, every tensor whole.

Issue #11: with every parameter sharded, ``accelerator.unwrap_model(model).save_pretrained(d)``
wrote 8 of a tiny Llama's 21 tensors with 0 elements, silently. One ``accelerate launch``
with 2 CPU processes (tests/workers/accelerate_save_pretrained.py) trains a tiny
LlamaForCausalLM, tied and untied embeddings, with a ZeroAccelerator at stage 3
(``param_persistence_threshold=0``) and with DDP, then saves it through Accelerate's
documented call and through a plain ``model.save_pretrained(d)`` on all ranks. Here, in
a plain process: the files hold the same tensors as the DDP model's ``save_pretrained``
(same names, shapes, none empty), and ``from_pretrained`` gives DDP's trained weights.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _accelerate_launch import accelerate_launch  # noqa: E402

SAVES = ["accelerate", "plain"]
TIES = ["tied", "untied"]
TOL = 1e-5  # fp32, absolute on weights of magnitude ~1 (as tests/test_transformers_llama.py)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate_save_pretrained")
    return out, accelerate_launch("accelerate_save_pretrained.py", {}, timeout=240, out=out, use_cpu=False)[0]


def tensors_in(directory) -> dict:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors file in {directory}"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.mark.multiprocess
def test_the_launch_trained_stage3_like_ddp(launched):
    _, reports = launched
    for r in reports:
        assert (r["num_processes"], r["stage"], r["threshold"]) == (2, 3, 0)
        for tie in TIES:
            assert r[tie]["same_object"]
            for lz, lr in r[tie]["losses"]:
                assert lz == pytest.approx(lr, rel=1e-5)
            assert r[tie]["trained_vs_ddp"] < TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("tie", TIES)
def test_saved_file_holds_every_tensor_whole(launched, tie, save):
    out, _ = launched
    got, want = tensors_in(out / f"{tie}_{save}"), tensors_in(out / f"{tie}_ddp")
    empty = sorted(k for k, t in got.items() if t.numel() == 0)
    assert not empty, f"{len(empty)} of {len(got)} tensors saved with 0 elements: {empty}"
    assert {k: tuple(t.shape) for k, t in got.items()} == {k: tuple(t.shape) for k, t in want.items()}
    for k, t in want.items():
        assert (got[k] - t).abs().max().item() < TOL, k


@pytest.mark.multiprocess
@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("tie", TIES)
def test_from_pretrained_gives_the_ddp_trained_model(launched, tie, save):
    from transformers import LlamaForCausalLM

    out, _ = launched
    model = LlamaForCausalLM.from_pretrained(out / f"{tie}_{save}")
    ref = LlamaForCausalLM.from_pretrained(out / f"{tie}_ddp")
    assert model.config.tie_word_embeddings == (tie == "tied")
    got, want = model.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for k, t in want.items():
        assert got[k].shape == t.shape and (got[k] - t).abs().max().item() < TOL, k
    if tie == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
