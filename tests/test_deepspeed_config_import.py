"""A DeepSpeed ds_config translates to the ZeroConfig that does the same thing.

Reference values are DeepSpeed's documented meanings (docs "DeepSpeed Configuration
JSON"): loss_scale 0 = dynamic, initial scale 2**initial_scale_power, hysteresis
default 2, offload_param.buffer_size counted in elements.
"""

import json
import logging

import pytest

from zero_strategy._config.deepspeed import translate_deepspeed
from zero_strategy.config import CPUOffload, LossScaleConfig, NVMeOffload, ZeroConfig, ZeroConfigError

# The ZeRO-3 offload config of the Hugging Face Trainer docs, "auto" values resolved
# where we need them and left as "auto" where they are tuning knobs.
HF_ZERO3 = {
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def ds(zero=None, **top):
    return {"zero_optimization": {"stage": 3, **(zero or {})}, **top}


def test_hf_zero3_offload_config():
    cfg = ZeroConfig.from_deepspeed(HF_ZERO3)
    assert cfg == ZeroConfig(
        stage=3,
        offload_optimizer=CPUOffload(pin_memory=True),
        offload_params=CPUOffload(pin_memory=True),
        precision="fp16",
        gradient_clipping=1.0,
        loss_scale=LossScaleConfig(initial_scale=65536.0, growth_interval=1000, hysteresis=2, min_scale=1.0),
    )


def test_ignored_keys_are_reported_not_silently_dropped(caplog):
    with caplog.at_level(logging.INFO, logger="zero_strategy._config.deepspeed"):
        result = translate_deepspeed(HF_ZERO3)
    for key in ("optimizer", "scheduler", "train_batch_size", "zero_optimization.overlap_comm",
                "zero_optimization.stage3_max_live_parameters", "zero_optimization.reduce_bucket_size"):
        assert key in result.ignored
    assert "zero_optimization.offload_optimizer.pin_memory" not in result.ignored  # mapped, not ignored
    assert "zero_optimization.stage3_param_persistence_threshold" in result.ignored  # it was "auto"
    assert "train_batch_size" in caplog.text


def test_file_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_ZERO3))
    assert ZeroConfig.from_deepspeed(path) == ZeroConfig.from_deepspeed(HF_ZERO3)
    assert ZeroConfig.from_deepspeed(str(path)) == ZeroConfig.from_file(path)


def test_no_precision_section_means_fp32_and_no_clipping():
    cfg = ZeroConfig.from_deepspeed(ds())
    assert (cfg.precision, cfg.gradient_clipping, cfg.loss_scale) == ("fp32", None, LossScaleConfig())


@pytest.mark.parametrize("section", ["bf16", "bfloat16"])
def test_bf16(section):
    assert ZeroConfig.from_deepspeed(ds(**{section: {"enabled": True}})).precision == "bf16"
    assert ZeroConfig.from_deepspeed(ds(**{section: {"enabled": False}})).precision == "fp32"


def test_fp16_static_loss_scale():
    cfg = ZeroConfig.from_deepspeed(ds(fp16={"enabled": True, "loss_scale": 128}))
    assert cfg.loss_scale.static is True and cfg.loss_scale.initial_scale == 128.0


def test_fp16_dynamic_defaults_follow_deepspeed():
    scale = ZeroConfig.from_deepspeed(ds(fp16={"enabled": True, "initial_scale_power": 12})).loss_scale
    assert (scale.initial_scale, scale.hysteresis, scale.static) == (4096.0, 2, False)


def test_fp16_section_disabled_is_ignored():
    cfg = ZeroConfig.from_deepspeed(ds(fp16={"enabled": False, "initial_scale_power": 3}))
    assert cfg.precision == "fp32" and cfg.loss_scale == LossScaleConfig()


def test_stages_and_communication_dtype():
    for stage in (1, 2, 3):
        assert ZeroConfig.from_deepspeed({"zero_optimization": {"stage": stage}}).stage == stage
    assert ZeroConfig.from_deepspeed(ds(communication_data_type="fp32")).reduce_dtype == "fp32"


def test_nvme_offload_and_element_buffer_size():
    cfg = ZeroConfig.from_deepspeed(ds({
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 4, "pin_memory": True,
                              "fast_init": False, "pipeline_read": False, "ratio": 1.0},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5, "buffer_size": 1e8,
                          "max_in_cpu": 1e9},
    }))
    assert cfg.offload_optimizer == NVMeOffload(path="/nvme", buffer_count=4, pin_memory=True)
    # 1e8 elements x 2 bytes = 2e8 bytes, rounded up to a multiple of 4096.
    expected = -(-200_000_000 // 4096) * 4096
    assert expected == 200_003_584
    assert cfg.offload_params == NVMeOffload(path="/nvme", buffer_count=5, buffer_size=expected, pin_memory=False)


def test_offload_device_none_and_legacy_flags():
    assert ZeroConfig.from_deepspeed(ds({"offload_optimizer": {"device": "none"}})).offload_optimizer is None
    cfg = ZeroConfig.from_deepspeed(ds({"cpu_offload": True, "cpu_offload_params": True,
                                        "cpu_offload_use_pin_memory": True}))
    assert cfg.offload_optimizer == CPUOffload(pin_memory=True) == cfg.offload_params


def test_persistence_threshold_is_mapped():
    cfg = ZeroConfig.from_deepspeed(ds({"stage3_param_persistence_threshold": 1e4}))
    assert cfg.param_persistence_threshold == 10_000


def test_stage_zero_and_missing_zero_section():
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.stage: stage 0 is plain DDP.*torch DDP, or stage 1"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 0}})
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization: is missing.*stage 0.*Add \"zero_optimization\""):
        ZeroConfig.from_deepspeed({"train_batch_size": 8})
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.stage: is missing.*Add \"stage\""):
        ZeroConfig.from_deepspeed({"zero_optimization": {"overlap_comm": True}})
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.stage: must be 1, 2 or 3, got 4"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 4}})


def test_auto_where_a_value_is_needed():
    """"auto" that no front end supplies (the stage, an offload device, a loss-scale value) stays an error.

    The resolvable ones (precision, clipping, batch sizes, ...) are tests/test_auto_values.py."""
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.stage: is \"auto\".*Replace \"auto\" with a value"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": "auto"}})
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.offload_optimizer\.device: is \"auto\""):
        ZeroConfig.from_deepspeed(ds({"offload_optimizer": {"device": "auto"}}))
    with pytest.raises(ZeroConfigError, match=r"^fp16\.loss_scale: is \"auto\""):
        ZeroConfig.from_deepspeed(ds(fp16={"enabled": True, "loss_scale": "auto"}))


def test_unknown_keys_suggest():
    with pytest.raises(ZeroConfigError, match=r"^zero_optimizaton: unknown key.*did you mean 'zero_optimization'"):
        ZeroConfig.from_deepspeed({"zero_optimizaton": {"stage": 3}, "zero_optimization": {"stage": 3}})
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.overlap_com: unknown key.*did you mean 'overlap_comm'"):
        ZeroConfig.from_deepspeed(ds({"overlap_com": True}))
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.offload_param\.nvme_pth: unknown key.*'nvme_path'"):
        ZeroConfig.from_deepspeed(ds({"offload_param": {"device": "nvme", "nvme_pth": "/x"}}))
    with pytest.raises(ZeroConfigError, match=r"^fp16\.initial_scale_pow: unknown key.*'initial_scale_power'"):
        ZeroConfig.from_deepspeed(ds(fp16={"enabled": True, "initial_scale_pow": 16}))


@pytest.mark.parametrize("key, value", [("zero_quantized_weights", True), ("zero_quantized_gradients", True),
                                        ("zero_hpz_partition_size", 8), ("mics_shard_size", 8)])
def test_unsupported_semantics_raise(key, value):
    with pytest.raises(ZeroConfigError, match=rf"^zero_optimization\.{key}: = {value} is not supported.*Remove {key}"):
        ZeroConfig.from_deepspeed(ds({key: value}))


@pytest.mark.parametrize("key, value", [("zero_quantized_weights", False), ("zero_hpz_partition_size", 1),
                                        ("mics_shard_size", -1)])
def test_unsupported_options_at_their_defaults_are_fine(key, value):
    assert ZeroConfig.from_deepspeed(ds({key: value})).stage == 3


def test_both_fp16_and_bf16_enabled():
    with pytest.raises(ZeroConfigError, match=r"fp16\.enabled and bf16\.enabled are both true.*Enable one"):
        ZeroConfig.from_deepspeed(ds(fp16={"enabled": True}, bf16={"enabled": True}))


def test_bad_values_name_the_deepspeed_key():
    with pytest.raises(ZeroConfigError, match=r"^fp16\.loss_scale_window: must be >= 1"):
        ZeroConfig.from_deepspeed(ds(fp16={"enabled": True, "loss_scale_window": 0}))
    with pytest.raises(ZeroConfigError, match=r"^communication_data_type: unknown dtype 'int8'"):
        ZeroConfig.from_deepspeed(ds(communication_data_type="int8"))
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.offload_param: needs stage 3.*got stage 2"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ZeroConfigError, match=r"^zero_optimization\.offload_optimizer\.device: unknown device 'gpu'"):
        ZeroConfig.from_deepspeed(ds({"offload_optimizer": {"device": "gpu"}}))
    with pytest.raises(ZeroConfigError, match=r"^fp16\.loss_scale: expected 0 \(dynamic\) or a positive scale"):
        ZeroConfig.from_deepspeed(ds(fp16={"enabled": True, "loss_scale": -1}))
    with pytest.raises(ZeroConfigError, match=r"^bf16\.bf16_master_weights_and_grads: is not supported"):
        ZeroConfig.from_deepspeed(ds(bf16={"enabled": True, "bf16_master_weights_and_grads": True}))


def test_deepspeed_file_errors_name_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    with pytest.raises(ZeroConfigError, match=r"ds\.json: zero_optimization\.stage: stage 0"):
        ZeroConfig.from_deepspeed(path)
