"""``zero_strategy.transformers.from_pretrained`` loads what transformers' ``from_pretrained`` loads.

The reference is transformers itself on the same directory: every parameter equal, bit
for bit, once the model is set up (at stage 1 and 3); the same dtype ("auto": the
config's, else the checkpoint's; an explicit one wins); the same key handling (a base
model's checkpoint into a model with a head: the base-model prefix); the same missing and
unused keys (``output_loading_info``), named in warnings, and a new head initialized by
the model's own ``_init_weights``. Before ``setup`` the parameters are on the meta device
(no rank holds the weights), buffers are real, the model is in eval mode. What it cannot
read in slices is refused by name: ``.bin``-only checkpoints, unknown keywords, a
per-module dtype dict. Parameters transformers merges from several checkpoint tensors
(mixture-of-experts layers) and their refusals: tests/test_moe_pretrained.py. Two ranks, and Accelerate's ``prepare``: tests/test_sharded_pretrained_loading.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import zero_strategy as zs  # noqa: E402
from zero_strategy.checkpoint import CheckpointError  # noqa: E402
from zero_strategy.transformers import from_pretrained  # noqa: E402
from _models import tiny_llama_config  # noqa: E402

from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig,  # noqa: E402
                          LlamaModel)


@pytest.fixture
def front_end_process_state():
    """Lightning's Trainer and Accelerate start a world of one in this process and export
    MASTER_PORT, RANK and the like; later tests (and the ranks they launch, which inherit the
    environment) must not find them: put both back as they were."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _untied():
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _save(tmp_path, config, model_class=transformers.LlamaForCausalLM, dtype=torch.float32, seed=3):
    torch.manual_seed(seed)
    model_class(config).to(dtype).save_pretrained(tmp_path)
    return tmp_path


def _set_up(model, stage):
    model, _ = zs.setup(model, None, zs.ZeroConfig(stage=stage, param_persistence_threshold=0))
    return zs.full_state_dict(model)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("case", ["tied_fp32", "untied_bf16_auto", "bf16_checkpoint_as_fp32"])
def test_equals_transformers_from_pretrained(tmp_path, stage, case):
    config = tiny_llama_config() if case == "tied_fp32" else _untied()
    saved = _save(tmp_path, config, dtype=torch.float32 if case == "tied_fp32" else torch.bfloat16)
    kwargs = {"dtype": torch.float32} if case == "bf16_checkpoint_as_fp32" else {}
    ref = AutoModelForCausalLM.from_pretrained(saved, **kwargs)
    model = from_pretrained(AutoModelForCausalLM, saved, **kwargs)
    assert type(model) is type(ref) and not model.training
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in ref.parameters()}
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings
    full = _set_up(model, stage)
    for key, want in ref.state_dict().items():
        assert torch.equal(full[key].to(want.dtype), want), key
    if case != "untied_bf16_auto":  # (a bf16 model set up with the default precision computes in fp32)
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref.eval()(ids).logits, rtol=0, atol=0)


def test_a_base_model_checkpoint_gets_the_prefix_and_the_same_missing_keys(tmp_path, caplog):
    saved = _save(tmp_path, _untied(), model_class=LlamaModel)  # keys without "model."
    ref, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    with caplog.at_level(logging.WARNING, logger="zero_strategy.transformers._pretrained"):
        full = _set_up(from_pretrained(AutoModelForCausalLM, saved), stage=3)
    assert set(info["missing_keys"]) == {"lm_head.weight"}
    assert "newly initialized: ['lm_head.weight']" in caplog.text
    for key, want in ref.state_dict().items():
        if key not in info["missing_keys"]:
            assert torch.equal(full[key], want), key


def test_a_new_head_is_initialized_by_the_model_and_unused_keys_are_named(tmp_path, caplog):
    saved = _save(tmp_path, _untied())
    ref, info = AutoModelForSequenceClassification.from_pretrained(saved, num_labels=3, output_loading_info=True)
    with caplog.at_level(logging.WARNING, logger="zero_strategy.transformers._pretrained"):
        model = from_pretrained(AutoModelForSequenceClassification, saved, num_labels=3)
        full = _set_up(model, stage=2)
    assert model.config.num_labels == 3 and full["score.weight"].shape == (3, 32)
    assert set(info["missing_keys"]) == {"score.weight"} and set(info["unexpected_keys"]) == {"lm_head.weight"}
    assert "newly initialized: ['score.weight']" in caplog.text and "were not used" in caplog.text
    assert "lm_head.weight" in caplog.text
    # the model's _init_weights: normal(0, initializer_range), as transformers initializes it
    assert abs(full["score.weight"].std().item() - ref.config.initializer_range) < 0.01
    for key, want in ref.state_dict().items():
        if key != "score.weight":
            assert torch.equal(full[key], want), key


def test_what_cannot_be_read_in_slices_is_refused_by_name(tmp_path):
    binary = tmp_path / "bin"
    binary.mkdir()
    _untied().save_pretrained(binary)
    torch.save({}, binary / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only pytorch_model\*\.bin weights.*save_pretrained"):
        from_pretrained(AutoModelForCausalLM, binary)
    saved = _save(tmp_path / "llama", _untied())
    with pytest.raises(TypeError, match="not_a_config_attribute"):
        from_pretrained(AutoModelForCausalLM, saved, not_a_config_attribute=1)
    with pytest.raises(ValueError, match="per-module dict"):
        from_pretrained(AutoModelForCausalLM, saved, dtype={"": torch.float32})
    with pytest.raises(CheckpointError, match="not a local directory"):
        from_pretrained(AutoModelForCausalLM, tmp_path / "nowhere")


def test_zero_trainer_trains_it_as_the_transformers_loaded_model(tmp_path, front_end_process_state):
    """The HF Trainer moves its model to the device in ``__init__``; a meta model is left to
    the engine, which materializes it sharded when the trainer prepares it."""
    from transformers import TrainingArguments

    from zero_strategy.transformers import ZeroTrainer

    saved = _save(tmp_path / "llama", _untied())
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 96, (8,), generator=g), "labels": torch.randint(0, 96, (8,), generator=g)}
            for _ in range(8)]

    def losses(model, run):
        args = TrainingArguments(output_dir=str(tmp_path / run), per_device_train_batch_size=2, max_steps=3,
                                 use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", learning_rate=1e-3)
        trainer = ZeroTrainer(model=model, args=args, train_dataset=data, zero_config="zero3")
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ours = losses(from_pretrained(AutoModelForCausalLM, saved), "ours")
    theirs = losses(AutoModelForCausalLM.from_pretrained(saved), "theirs")
    assert len(ours) == 3 and ours == theirs


def test_lightning_configure_model_loads_it_one_level_down(tmp_path, front_end_process_state):
    """Lightning's idiom: the LightningModule is what the strategy sets up; its Hugging Face
    model, built in ``configure_model``, is a submodule whose names carry ``model.``."""
    lightning = pytest.importorskip("lightning")
    import zero_strategy.lightning  # noqa: F401  (registers the strategies)

    saved = _save(tmp_path / "llama", tiny_llama_config())
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))

    class Module(lightning.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = from_pretrained(AutoModelForCausalLM, saved)

        def training_step(self, batch, _):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # no change: the loaded weights stay

    module = Module()
    trainer = lightning.Trainer(accelerator="cpu", devices=1, strategy="zero3", max_steps=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(ids, batch_size=2))
    full = zs.full_state_dict(module)
    ref = AutoModelForCausalLM.from_pretrained(saved)
    for key, want in ref.state_dict().items():
        assert torch.equal(full[f"model.{key}"], want), key
    zs.teardown(module, keep_weights=False)


def test_a_loaded_model_nobody_sets_up_is_collected(tmp_path):
    """The record of its checkpoint sits in a weak table: it must not keep the model alive."""
    import gc
    import weakref

    saved = _save(tmp_path, _untied())
    ref = weakref.ref(from_pretrained(AutoModelForCausalLM, saved))
    gc.collect()
    assert ref() is None
