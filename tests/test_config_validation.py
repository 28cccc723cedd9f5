"""ZeroConfig validates every field once, in __post_init__, and normalises spellings.

Each error is a ZeroConfigError (a ValueError) whose message names the key, the bad
value and the fix.
"""

import pickle

import pytest
import torch

from zero_strategy.config import CPUOffload, LossScaleConfig, NVMeOffload, ZeroConfig, ZeroConfigError


def test_defaults_are_stage3_fp32_without_offload():
    cfg = ZeroConfig()
    assert (cfg.stage, cfg.offload_optimizer, cfg.offload_params, cfg.precision) == (3, None, None, "fp32")
    assert cfg.compute_dtype is torch.float32
    assert cfg.gradient_reduce_dtype is torch.float32


def test_error_is_a_value_error_and_survives_pickling():
    with pytest.raises(ValueError):
        ZeroConfig(stage=5)
    err = ZeroConfigError("loss_scale.hysteresis", "must be >= 1, got 0", "Use 1.")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) == "loss_scale.hysteresis: must be >= 1, got 0. Use 1."
    assert again.key == "loss_scale.hysteresis"
    plain = ZeroConfigError("something is wrong")
    assert str(plain) == "something is wrong" and plain.key is None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_valid_stages(stage):
    assert ZeroConfig(stage=stage).stage == stage


def test_integral_float_stage_is_accepted_as_int():
    cfg = ZeroConfig(stage=2.0)
    assert cfg.stage == 2 and isinstance(cfg.stage, int)


def test_stage_zero_points_to_ddp():
    with pytest.raises(ZeroConfigError, match=r"^stage: stage 0 is plain data parallel.*DistributedDataParallel"):
        ZeroConfig(stage=0)


@pytest.mark.parametrize("stage", [4, -1])
def test_stage_out_of_range(stage):
    with pytest.raises(ZeroConfigError, match=rf"^stage: must be 1, 2 or 3, got {stage}"):
        ZeroConfig(stage=stage)


@pytest.mark.parametrize("stage", ["3", True, 2.5])
def test_stage_wrong_type(stage):
    with pytest.raises(ZeroConfigError, match=r"^stage: expected an integer.*whole number"):
        ZeroConfig(stage=stage)


@pytest.mark.parametrize(
    "spelling, canonical",
    [("fp32", "fp32"), ("float32", "fp32"), ("32", "fp32"), (32, "fp32"), (torch.float32, "fp32"),
     ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"), (torch.bfloat16, "bf16"), ("bf16-mixed", "bf16"),
     ("fp16", "fp16"), ("float16", "fp16"), ("16", "fp16"), (16, "fp16"), (torch.float16, "fp16")],
)
def test_precision_aliases_are_normalised(spelling, canonical):
    cfg = ZeroConfig(precision=spelling, reduce_dtype=spelling)
    assert cfg.precision == canonical and cfg.reduce_dtype == canonical


def test_dtype_properties():
    cfg = ZeroConfig(precision="bf16")
    assert cfg.compute_dtype is torch.bfloat16
    assert cfg.gradient_reduce_dtype is torch.bfloat16  # defaults to the compute dtype
    cfg = ZeroConfig(precision="bf16", reduce_dtype="fp32")
    assert cfg.gradient_reduce_dtype is torch.float32
    assert ZeroConfig(precision="fp16").compute_dtype is torch.float16


def test_unknown_precision_names_the_choices():
    with pytest.raises(ZeroConfigError, match=r"^precision: unknown dtype 'fp8'.*\"fp32\", \"bf16\" or \"fp16\""):
        ZeroConfig(precision="fp8")
    with pytest.raises(ZeroConfigError, match=r"^reduce_dtype: unknown dtype 'int8'"):
        ZeroConfig(reduce_dtype="int8")
    with pytest.raises(ZeroConfigError, match=r"did you mean 'bfloat16'"):
        ZeroConfig(precision="bfloat61")


@pytest.mark.parametrize(
    "value, expected",
    [(None, None), ("none", None), ("NONE", None), ("cpu", CPUOffload()), ("nvme", NVMeOffload()),
     (CPUOffload(pin_memory=False), CPUOffload(pin_memory=False)),
     ({"device": "nvme", "path": "/x", "buffer_count": 8}, NVMeOffload(path="/x", buffer_count=8)),
     ({"device": "cpu", "pin_memory": False}, CPUOffload(pin_memory=False)),
     ({"device": "none"}, None)],
)
def test_offload_spellings_are_normalised(value, expected):
    cfg = ZeroConfig(offload_optimizer=value, offload_params=value)
    assert cfg.offload_optimizer == expected and cfg.offload_params == expected


def test_unknown_offload_device_suggests():
    with pytest.raises(ZeroConfigError, match=r"^offload_optimizer: unknown offload device 'cpuu'.*did you mean 'cpu'"):
        ZeroConfig(offload_optimizer="cpuu")
    with pytest.raises(ZeroConfigError, match=r"^offload_params\.device: unknown offload device 'disk'.*\"nvme\""):
        ZeroConfig(offload_params={"device": "disk"})
    with pytest.raises(ZeroConfigError, match=r"^offload_optimizer: expected"):
        ZeroConfig(offload_optimizer=1)


def test_offload_params_needs_stage_3():
    for stage in (1, 2):
        with pytest.raises(ZeroConfigError, match=rf"^offload_params: needs stage 3.*got stage {stage}.*Set stage: 3, or drop offload_params"):
            ZeroConfig(stage=stage, offload_params="cpu")
    assert ZeroConfig(stage=3, offload_params="cpu").offload_params == CPUOffload()  # alone is fine
    assert ZeroConfig(stage=1, offload_optimizer="nvme").offload_optimizer == NVMeOffload()


def test_nvme_offload_ranges():
    with pytest.raises(ZeroConfigError, match=r"^buffer_count: must be >= 2, got 1"):
        NVMeOffload(buffer_count=1)
    with pytest.raises(ZeroConfigError, match=r"^buffer_size: must be a multiple of 4096 bytes, got 5000. Use 8192"):
        NVMeOffload(buffer_size=5000)
    with pytest.raises(ZeroConfigError, match=r"^buffer_size: must be >= 1, got 0"):
        NVMeOffload(buffer_size=0)
    with pytest.raises(ZeroConfigError, match=r"^io_threads: must be >= 1"):
        NVMeOffload(io_threads=0)
    with pytest.raises(ZeroConfigError, match=r"^read_ahead: must be >= 0"):
        NVMeOffload(read_ahead=-1)
    with pytest.raises(ZeroConfigError, match=r"^path: expected a directory path or null.*ZERO_STRATEGY_NVME_PATH"):
        NVMeOffload(path="")
    with pytest.raises(ZeroConfigError, match=r"^pin_memory: expected true or false, got 'yes'"):
        CPUOffload(pin_memory="yes")


def test_nvme_path_accepts_pathlike(tmp_path):
    assert NVMeOffload(path=tmp_path).path == str(tmp_path)


def test_nested_offload_errors_carry_the_key_path():
    with pytest.raises(ZeroConfigError, match=r"^offload_optimizer\.buffer_count: must be >= 2"):
        ZeroConfig(offload_optimizer={"device": "nvme", "buffer_count": 1})
    with pytest.raises(ZeroConfigError, match=r"^offload_params\.buffer_cont: unknown option.*did you mean 'buffer_count'"):
        ZeroConfig(offload_params={"device": "nvme", "buffer_cont": 4})
    with pytest.raises(ZeroConfigError, match=r"^offload_optimizer\.path: unknown option.*Valid options: device, pin_memory"):
        ZeroConfig(offload_optimizer={"device": "cpu", "path": "/x"})  # CPU offload has no path


@pytest.mark.parametrize(
    "field, value, message",
    [("initial_scale", 0, r"^initial_scale: must be > 0"),
     ("min_scale", -1.0, r"^min_scale: must be > 0"),
     ("growth_factor", 1.0, r"^growth_factor: must be > 1"),
     ("backoff_factor", 1.0, r"^backoff_factor: must be in \(0, 1\)"),
     ("backoff_factor", 0, r"^backoff_factor: must be in \(0, 1\)"),
     ("growth_interval", 0, r"^growth_interval: must be >= 1"),
     ("hysteresis", 0, r"^hysteresis: must be >= 1"),
     ("static", 1, r"^static: expected true or false"),
     ("initial_scale", float("inf"), r"^initial_scale: expected a finite number")],
)
def test_loss_scale_ranges(field, value, message):
    with pytest.raises(ZeroConfigError, match=message):
        LossScaleConfig(**{field: value})


def test_loss_scale_min_above_initial():
    with pytest.raises(ZeroConfigError, match=r"^min_scale: 1024.0 is above initial_scale 16.0.*Lower min_scale"):
        LossScaleConfig(initial_scale=16, min_scale=1024)


def test_loss_scale_from_mapping_and_errors_prefixed():
    cfg = ZeroConfig(loss_scale={"initial_scale": 1024, "static": True})
    assert cfg.loss_scale == LossScaleConfig(initial_scale=1024.0, static=True)
    with pytest.raises(ZeroConfigError, match=r"^loss_scale\.growth_interval: must be >= 1"):
        ZeroConfig(loss_scale={"growth_interval": 0})
    with pytest.raises(ZeroConfigError, match=r"^loss_scale: expected a mapping"):
        ZeroConfig(loss_scale=3)


def test_gradient_clipping():
    assert ZeroConfig(gradient_clipping=1).gradient_clipping == 1.0
    assert ZeroConfig(gradient_clipping=0).gradient_clipping == 0.0  # 0 = off, like None
    with pytest.raises(ZeroConfigError, match=r"^gradient_clipping: must be >= 0, got -1.0.*null / 0 to disable"):
        ZeroConfig(gradient_clipping=-1)
    with pytest.raises(ZeroConfigError, match=r"^gradient_clipping: expected a finite number"):
        ZeroConfig(gradient_clipping="1.0")


def test_unit_classes_normalised_to_tuple_of_names():
    assert ZeroConfig(unit_classes="Block").unit_classes == ("Block",)
    assert ZeroConfig(unit_classes=["A", "B"]).unit_classes == ("A", "B")
    assert ZeroConfig(unit_classes=[torch.nn.Linear, "B"]).unit_classes == ("Linear", "B")
    assert ZeroConfig(unit_classes=torch.nn.TransformerEncoderLayer).unit_classes == ("TransformerEncoderLayer",)
    with pytest.raises(ZeroConfigError, match=r"^unit_classes: expected class names, got 3"):
        ZeroConfig(unit_classes=[3])
    with pytest.raises(ZeroConfigError, match=r"^unit_classes: expected a class name or a list"):
        ZeroConfig(unit_classes=5)


def test_integer_knobs():
    with pytest.raises(ZeroConfigError, match=r"^param_persistence_threshold: must be >= 0"):
        ZeroConfig(param_persistence_threshold=-1)
    assert ZeroConfig(param_persistence_threshold=1e5).param_persistence_threshold == 100_000
    with pytest.raises(ZeroConfigError, match=r"^prefetch: must be >= 0"):
        ZeroConfig(prefetch=-2)
    with pytest.raises(ZeroConfigError, match=r"^cast_forward_inputs: expected true or false"):
        ZeroConfig(cast_forward_inputs="no")


def test_config_is_frozen_and_hashable():
    cfg = ZeroConfig(offload_optimizer="cpu")
    with pytest.raises(AttributeError):
        cfg.stage = 1
    assert hash(cfg) == hash(ZeroConfig(offload_optimizer=CPUOffload()))


def test_replace_validates_and_suggests():
    cfg = ZeroConfig(stage=3, offload_params="cpu")
    assert cfg.replace(precision="bfloat16").precision == "bf16"
    assert cfg.replace(prefetch=2).offload_params == CPUOffload()
    with pytest.raises(ZeroConfigError, match=r"^offload_params: needs stage 3"):
        cfg.replace(stage=2)
    with pytest.raises(ZeroConfigError, match=r"^prefech: unknown field.*did you mean 'prefetch'"):
        cfg.replace(prefech=2)
