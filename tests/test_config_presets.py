"""Presets are data: a name, a one-line description and the fields they set."""

import pytest

from zero_strategy.config import PRESETS, CPUOffload, NVMeOffload, ZeroConfig, ZeroConfigError, preset_names

EXPECTED = {
    "zero1": (1, None, None),
    "zero2": (2, None, None),
    "zero2_offload": (2, CPUOffload(), None),
    "zero3": (3, None, None),
    "zero3_offload": (3, CPUOffload(), CPUOffload()),
    "zero3_offload_nvme": (3, NVMeOffload(), NVMeOffload()),
    "zero_auto": (3, None, None),  # until setup resolves it (test_zero_auto.py)
}


def test_preset_names_are_the_documented_seven():
    assert preset_names() == list(EXPECTED)
    assert set(PRESETS) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_sets_stage_and_offload(name):
    cfg = ZeroConfig.preset(name)
    assert (cfg.stage, cfg.offload_optimizer, cfg.offload_params) == EXPECTED[name]
    assert cfg.auto == (name == "zero_auto")
    # Everything else keeps the dataclass defaults.
    assert cfg.replace(stage=3, offload_optimizer=None, offload_params=None, auto=False) == ZeroConfig()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_preset_has_a_one_line_description(name):
    description, fields = PRESETS[name]
    assert isinstance(description, str) and description and "\n" not in description
    assert isinstance(fields, dict) and "stage" in fields


def test_preset_overrides():
    cfg = ZeroConfig.preset("zero3_offload", precision="bf16", gradient_clipping=1.0)
    assert (cfg.stage, cfg.precision, cfg.gradient_clipping) == (3, "bf16", 1.0)
    assert ZeroConfig.preset("zero3_offload", offload_params=None).offload_params is None


def test_preset_names_are_forgiving_about_case_and_dashes():
    assert ZeroConfig.preset("ZeRO3-Offload") == ZeroConfig.preset("zero3_offload")


def test_override_that_breaks_the_preset_is_an_error():
    with pytest.raises(ZeroConfigError, match=r"^offload_params: needs stage 3"):
        ZeroConfig.preset("zero3_offload", stage=2)


def test_unknown_override_suggests():
    with pytest.raises(ZeroConfigError, match=r"^precison: unknown field.*did you mean 'precision'"):
        ZeroConfig.preset("zero2", precison="bf16")


def test_unknown_preset_lists_presets_and_close_match():
    with pytest.raises(ZeroConfigError, match=r"unknown preset 'zero4'.*did you mean .*'zero3'.*Presets: zero1 \(") as info:
        ZeroConfig.preset("zero4")
    for name in EXPECTED:
        assert name in str(info.value)
    with pytest.raises(ZeroConfigError, match=r"unknown preset 'fsdp'\. Presets: zero1"):
        ZeroConfig.preset("fsdp")
