"""Configs load from mappings, YAML and JSON files, and anything ZeroConfig.load accepts."""

import json

import pytest

from zero_strategy.config import CPUOffload, LossScaleConfig, NVMeOffload, ZeroConfig, ZeroConfigError

FULL = {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "path": "/local_nvme", "buffer_count": 6, "buffer_size": 8192},
    "offload_params": "cpu",
    "precision": "bfloat16",
    "reduce_dtype": "fp32",
    "gradient_clipping": 1.0,
    "loss_scale": {"initial_scale": 1024, "growth_interval": 100},
    "unit_classes": ["Block"],
    "param_persistence_threshold": 0,
    "prefetch": 2,
    "cast_forward_inputs": False,
}


def test_from_dict_reads_nested_sections():
    cfg = ZeroConfig.from_dict(FULL)
    assert cfg == ZeroConfig(
        stage=3,
        offload_optimizer=NVMeOffload(path="/local_nvme", buffer_count=6, buffer_size=8192),
        offload_params=CPUOffload(),
        precision="bf16",
        reduce_dtype="fp32",
        gradient_clipping=1.0,
        loss_scale=LossScaleConfig(initial_scale=1024.0, growth_interval=100),
        unit_classes=("Block",),
        param_persistence_threshold=0,
        prefetch=2,
        cast_forward_inputs=False,
    )


@pytest.mark.parametrize("cfg", [ZeroConfig(), ZeroConfig.from_dict(FULL), ZeroConfig.preset("zero3_offload_nvme"),
                                 ZeroConfig(stage=1, offload_optimizer=CPUOffload(pin_memory=False))])
def test_to_dict_round_trips_through_json(cfg):
    data = json.loads(json.dumps(cfg.to_dict()))
    assert ZeroConfig.from_dict(data) == cfg


def test_preset_key_is_a_base_for_the_other_keys():
    cfg = ZeroConfig.from_dict({"preset": "zero3_offload", "precision": "bf16"})
    assert cfg == ZeroConfig.preset("zero3_offload", precision="bf16")
    with pytest.raises(ZeroConfigError, match=r"^preset: unknown preset 'zero9'"):
        ZeroConfig.from_dict({"preset": "zero9"})


def test_unknown_keys_at_every_level_name_the_path_and_suggest():
    with pytest.raises(ZeroConfigError, match=r"^stag: unknown key.*did you mean 'stage'"):
        ZeroConfig.from_dict({"stag": 3})
    with pytest.raises(ZeroConfigError, match=r"^loss_scale\.growth_intervall: unknown key.*did you mean 'growth_interval'"):
        ZeroConfig.from_dict({"loss_scale": {"growth_intervall": 10}})
    with pytest.raises(ZeroConfigError, match=r"^offload_optimizer\.nvme_path: unknown option.*did you mean 'path'"):
        ZeroConfig.from_dict({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}})


def test_from_dict_rejects_non_mappings():
    with pytest.raises(ZeroConfigError, match=r"must be a mapping, got list"):
        ZeroConfig.from_dict([("stage", 3)])


def test_yaml_file(tmp_path):
    path = tmp_path / "zero.yaml"
    path.write_text("stage: 2\noffload_optimizer: cpu\nprecision: bf16\nloss_scale:\n  hysteresis: 2\n")
    assert ZeroConfig.from_file(path) == ZeroConfig(stage=2, offload_optimizer="cpu", precision="bf16",
                                                    loss_scale={"hysteresis": 2})
    yml = tmp_path / "zero.yml"
    yml.write_text("preset: zero1\n")
    assert ZeroConfig.from_file(str(yml)) == ZeroConfig.preset("zero1")


def test_json_file(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(FULL))
    assert ZeroConfig.from_file(path) == ZeroConfig.from_dict(FULL)


def test_missing_file(tmp_path):
    with pytest.raises(ZeroConfigError, match=r"config file .*nope\.yaml does not exist.*Check the path"):
        ZeroConfig.from_file(tmp_path / "nope.yaml")


_TOP_LEVEL = r"top level of .*c\.yaml must be a mapping, got {}.*key: value"


@pytest.mark.parametrize("name, text, match", [
    pytest.param("zero.toml", "stage = 3", r"unsupported config file type '\.toml'.*\.yaml, \.yml or \.json",
                 id="unsupported_suffix"),
    pytest.param("bad.yaml", "stage: 3\nprecision: bf16\n  prefetch: [1\n",
                 r"invalid YAML in .*bad\.yaml at line 3.*Fix the syntax", id="yaml_syntax_error_reports_the_line"),
    pytest.param("bad.json", '{\n  "stage": 3,\n  "precision": "bf16",\n}\n', r"invalid JSON in .*bad\.json at line 4",
                 id="json_syntax_error_reports_the_line"),
    pytest.param("c.yaml", "- 3\n- 2\n", _TOP_LEVEL.format("list"), id="top_level_must_be_a_mapping-list"),
    pytest.param("c.yaml", "", _TOP_LEVEL.format("an empty file"), id="top_level_must_be_a_mapping-empty"),
    pytest.param("c.yaml", "3\n", _TOP_LEVEL.format("int"), id="top_level_must_be_a_mapping-int"),
    pytest.param("c.yaml", "stage: 3\nloss_scale:\n  backoff_factor: 2\n",
                 r"c\.yaml: loss_scale\.backoff_factor: must be in \(0, 1\)",
                 id="value_errors_in_a_file_name_the_file_and_the_key"),
])
def test_bad_file_is_refused_naming_the_file(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig.from_file(path)


def test_a_deepspeed_file_is_routed_to_from_deepspeed(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 32, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    cfg = ZeroConfig.from_file(path)
    assert (cfg.stage, cfg.precision, cfg.offload_optimizer) == (2, "bf16", CPUOffload(pin_memory=False))


def test_load_accepts_every_kind_of_spec(tmp_path):
    cfg = ZeroConfig(stage=1)
    assert ZeroConfig.load(cfg) is cfg
    assert ZeroConfig.load("zero2_offload") == ZeroConfig.preset("zero2_offload")
    path = tmp_path / "z.yaml"
    path.write_text("stage: 1\n")
    assert ZeroConfig.load(path) == cfg
    assert ZeroConfig.load(str(path)) == cfg
    assert ZeroConfig.load({"stage": 1}) == cfg
    assert ZeroConfig.load({"zero_optimization": {"stage": 1}}) == cfg


def test_load_errors():
    with pytest.raises(ZeroConfigError, match=r"'zero33' is neither a preset name nor an existing config file.*"
                                              r"did you mean 'zero3'.*Presets: zero1"):
        ZeroConfig.load("zero33")
    with pytest.raises(ZeroConfigError, match=r"cannot build a ZeRO config from int 3.*preset name"):
        ZeroConfig.load(3)
    with pytest.raises(ZeroConfigError, match=r"does not exist"):
        ZeroConfig.load("missing/zero.yaml")
