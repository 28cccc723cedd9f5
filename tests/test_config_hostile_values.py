"""Every malformed config is a ZeroConfigError naming the key and the fix: undecodable files,
numbers beyond float range, DeepSpeed strings that would switch on unsupported features,
NVMe buffer settings beyond what makes sense.

Before, UnicodeDecodeError and OverflowError escaped raw, ``"zero_quantized_weights":
"true"`` was silently ignored, and ``buffer_count: 1e8`` allocated 763 MiB at setup.
"""

from __future__ import annotations

import pytest

from zero_strategy.config import ZeroConfig, ZeroConfigError

HUGE = 10**400  # valid JSON/YAML integer, beyond float range


def ds(zero=None, **top):
    return {"zero_optimization": {"stage": 3, **(zero or {})}, **top}


def nvme(**kw):
    return {"stage": 3, "offload_optimizer": {"device": "nvme", **kw}}


CASES = [
    ("gradient_clipping_huge", lambda: ZeroConfig.from_dict({"stage": 2, "gradient_clipping": HUGE}),
     r"gradient_clipping: expected a finite number"),
    ("ds_gradient_clipping_huge", lambda: ZeroConfig.from_deepspeed(ds(gradient_clipping=HUGE)),
     r"gradient_clipping: expected a finite number"),
    ("ds_initial_scale_power_huge", lambda: ZeroConfig.from_deepspeed(
        ds(fp16={"enabled": True, "initial_scale_power": HUGE})),
     r"fp16\.initial_scale_power: expected an integer in \[0, 127\] \(2\*\*power must be a finite fp32 scale\)"),
    ("ds_loss_scale_huge", lambda: ZeroConfig.from_deepspeed(ds(fp16={"enabled": True, "loss_scale": HUGE})),
     r"fp16\.loss_scale: expected 0 \(dynamic\) or a positive scale"),
    ("ds_buffer_size_infinite", lambda: ZeroConfig.from_deepspeed(
        ds({"offload_param": {"device": "nvme", "buffer_size": float("inf")}})),
     r"offload_param\.buffer_size: expected a positive element count, got inf"),
    ("ds_buffer_size_nan", lambda: ZeroConfig.from_deepspeed(
        ds({"offload_param": {"device": "nvme", "buffer_size": float("nan")}})),
     r"offload_param\.buffer_size: expected a positive element count, got nan"),
    ("ds_quantized_weights_string", lambda: ZeroConfig.from_deepspeed(ds({"zero_quantized_weights": "true"})),
     r"zero_optimization\.zero_quantized_weights: expected true or false, got 'true'\. Write false \(no quotes\)"),
    ("ds_quantized_gradients_string", lambda: ZeroConfig.from_deepspeed(
        ds({"zero_quantized_gradients": "yes"})),
     r"zero_optimization\.zero_quantized_gradients: expected true or false, got 'yes'"),
    ("ds_hpz_string", lambda: ZeroConfig.from_deepspeed(ds({"zero_hpz_partition_size": "8"})),
     r"zero_optimization\.zero_hpz_partition_size: expected an integer, got '8'\. Write 1 \(no quotes\)"),
    ("ds_mics_string", lambda: ZeroConfig.from_deepspeed(ds({"mics_shard_size": "8"})),
     r"zero_optimization\.mics_shard_size: expected an integer, got '8'"),
    ("ds_bf16_optimizer_states_string", lambda: ZeroConfig.from_deepspeed(
        ds(bf16={"enabled": True, "bf16_optimizer_states": "true"})),
     r"bf16\.bf16_optimizer_states: expected true or false, got 'true'"),
    ("ds_fp16_master_string", lambda: ZeroConfig.from_deepspeed(
        ds(fp16={"enabled": True, "fp16_master_weights_and_grads": "true"})),
     r"fp16\.fp16_master_weights_and_grads: expected true or false, got 'true'"),
    ("ds_buffer_count_string", lambda: ZeroConfig.from_deepspeed(
        ds({"offload_param": {"device": "nvme", "buffer_count": "8"}})),
     r"offload_param\.buffer_count: expected an integer, got '8'"),
    ("buffer_count_huge", lambda: ZeroConfig.from_dict(nvme(buffer_count=10**8)),
     r"offload_optimizer\.buffer_count: must be <= 1024, got 100000000: each buffer is a host staging slot"),
    ("buffer_size_beyond_one_request", lambda: ZeroConfig.from_dict(nvme(buffer_size=2**31)),
     r"offload_optimizer\.buffer_size: must be <= 1073741824, got 2147483648: it is the size of one read or "
     r"write request, and Linux moves at most 2 GiB - 4 KiB per request"),
    ("read_ahead_huge", lambda: ZeroConfig.from_dict(nvme(read_ahead=10**8)),
     r"offload_optimizer\.read_ahead: must be <= 1020, got 100000000: every group read ahead holds one staging"),
]


@pytest.mark.parametrize("build,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_a_config_error(build, message):
    with pytest.raises(ZeroConfigError, match=message):
        build()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_that_is_not_utf8(tmp_path, suffix):
    path = tmp_path / f"zero{suffix}"
    path.write_bytes("stage: 3".encode("utf-16"))
    with pytest.raises(ZeroConfigError, match=r"zero\.(yaml|json) is not UTF-8 text \(byte 0: invalid start "
                                              r"byte\)\. Save it as UTF-8\."):
        ZeroConfig.load(str(path))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_nested_too_deeply(tmp_path, suffix):
    path = tmp_path / f"zero{suffix}"
    path.write_text("[" * 100_000)
    with pytest.raises(ZeroConfigError, match=r"is nested too deeply to be a config"):
        ZeroConfig.load(str(path))


def test_limits_themselves_are_accepted():
    cfg = ZeroConfig.from_dict(nvme(buffer_count=1024, buffer_size=1 << 30, read_ahead=1020))
    assert (cfg.offload_optimizer.buffer_count, cfg.offload_optimizer.buffer_size) == (1024, 1 << 30)
    assert ZeroConfig.from_deepspeed(ds({"zero_quantized_weights": False, "zero_hpz_partition_size": 1})).stage == 3
