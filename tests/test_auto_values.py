"""``"auto"`` in a ds_config means the same in every front end.

One resolver (zero_strategy/_deepspeed_auto.py, see its [Note: "auto" means "the front
end supplies it"]) serves the Lightning Trainer strategy, Fabric, ZeroAccelerator, the
HF ``ZeroTrainer`` and the plain ``ZeroConfig.from_deepspeed``. For each key of the
table, set to "auto" in a ds_config, each front end is built as users build it, with
the same precision chosen the front end's own way, and the ZeroConfig it ends up with
must be (1) what the same front end builds from the explicit equivalent (the value the
Hugging Face DeepSpeed integration fills in for that key, or the key left out where
DeepSpeed's default applies), (2) the same in every front end, and (3) the expected
value: the front end's precision, no clipping inside ``step()`` (the front end clips),
DeepSpeed's default persistence threshold 1e5.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

import _procs  # noqa: E402
from _zygote import warm_command  # noqa: E402
from _accelerate_launch import launch_env  # noqa: E402

HERE = Path(__file__).resolve().parent
PRECISIONS = ["fp32", "bf16", "fp16"]
BASE = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
ZERO_KNOBS = ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
              "stage3_max_live_parameters", "stage3_max_reuse_distance"]


def _with(path: str, value) -> dict:
    ds = copy.deepcopy(BASE)
    node = ds
    *parents, name = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[name] = value
    return ds


def _precision_row() -> dict:
    auto = {p: {**BASE, "fp16": {"enabled": "auto", "initial_scale_power": 8, "loss_scale_window": 500},
                "bf16": {"enabled": "auto"}} for p in PRECISIONS}
    explicit = {p: {**BASE, "fp16": {"enabled": p == "fp16", "initial_scale_power": 8, "loss_scale_window": 500},
                    "bf16": {"enabled": p == "bf16"}} for p in PRECISIONS}
    return {"key": "fp16.enabled+bf16.enabled", "precisions": PRECISIONS, "auto": auto, "explicit": explicit}


def _row(path: str, explicit_value=None) -> dict:
    """``path`` set to "auto"; the explicit equivalent is ``explicit_value``, or the key left out when None."""
    explicit = BASE if explicit_value is None else _with(path, explicit_value)
    return {"key": path, "precisions": PRECISIONS, "auto": {p: _with(path, "auto") for p in PRECISIONS},
            "explicit": {p: explicit for p in PRECISIONS}}


TABLE = [
    _precision_row(),
    _row("gradient_clipping"),                     # the front end clips (gradient_clip_val, clip_grad_norm_, max_grad_norm)
    _row("train_micro_batch_size_per_gpu"),        # the data loader's
    _row("train_batch_size"),
    _row("gradient_accumulation_steps"),           # the front end's accumulation
    _row("communication_data_type"),               # DeepSpeed's default: reduce in the compute dtype
    _row("zero_optimization.stage3_param_persistence_threshold", 100_000),  # DeepSpeed's default 1e5
    *[_row(f"zero_optimization.{k}") for k in ZERO_KNOBS],  # tuning knobs the engine sizes itself
]
FRONT_ENDS = ["lightning_trainer", "fabric", "accelerate", "hf_trainer", "plain"]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="zs_auto_"))
    try:
        (out / "args.json").write_text(json.dumps({"table": TABLE}))
        cmd, env = warm_command([sys.executable, str(HERE / "workers" / "auto_values.py"), str(out)], launch_env())
        proc = _procs.run(cmd, 280, env=env)
        assert (out / "rank0.json").exists(), (proc.stdout + proc.stderr)[-6000:]
        return json.loads((out / "rank0.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def effective(result: dict) -> dict:
    """The config's fields that act: ``loss_scale`` acts only in fp16 (a ds_config with fp16.enabled "auto"
    keeps its loss-scale settings for the front end that picks fp16)."""
    assert "error" not in result, result
    cfg = dict(result["config"])
    if cfg["precision"] != "fp16":
        cfg.pop("loss_scale")
    return cfg


def _entries(results, key, precision):
    found = [e for e in results if e["row"] == key and e["precision"] == precision]
    assert {e["front_end"] for e in found} == (set(FRONT_ENDS) if precision == "fp32" else set(FRONT_ENDS) - {"plain"})
    return found


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("key", [row["key"] for row in TABLE])
def test_auto_resolves_to_the_explicit_value_in_every_front_end(results, key, precision):
    entries = _entries(results, key, precision)
    for e in entries:
        assert effective(e["auto"]) == effective(e["explicit"]), f"{e['front_end']}: 'auto' is not the explicit value"
    first = effective(entries[0]["auto"])
    for e in entries[1:]:
        assert effective(e["auto"]) == first, f"{e['front_end']} differs from {entries[0]['front_end']}"
    assert first["precision"] == precision
    assert first["gradient_clipping"] is None
    assert first["param_persistence_threshold"] == 100_000
    assert (first["stage"], first["offload_optimizer"]["device"]) == (3, "cpu")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fp16_auto_keeps_the_ds_config_loss_scale(results):
    """fp16.enabled "auto" resolved to fp16 by the front end still uses the section's loss-scale settings."""
    for e in _entries(results, "fp16.enabled+bf16.enabled", "fp16"):
        scale = e["auto"]["config"]["loss_scale"]
        assert (scale["initial_scale"], scale["growth_interval"]) == (256.0, 500), e["front_end"]
