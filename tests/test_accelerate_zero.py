"""ZeroAccelerator: DDP parity, save_state/load_state resume, launch configs and errors.

The multi-process cases run ``accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml``
(the shipped CPU config) once for all presets, and are judged by what each rank reports
(see tests/_launch.py for why). Errors raised before Accelerate sets up are checked in
this process; the others in one plain single-process worker, since Accelerate's state
is a per-process singleton.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import _procs  # noqa: E402
from _accelerate_launch import accelerate_launch, accelerate_run, launch_env, run_single  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PRESETS = ["zero1", "zero2", "zero3", "zero2_offload"]
COMMON = {"gas": 2, "clip": 0.3, "steps": 4, "resume_at": 2}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Launched as a user's shell does (no ACCELERATE_USE_CPU: ZeroAccelerator sets it)."""
    # the save is asynchronous (the config's async_save): load_state of a new run waits for it
    args = {"mode": "launch", "presets": PRESETS, "resume_save_preset": {"preset": "zero3", "async_save": True},
            "resume_load_preset": "zero2", **COMMON}
    out = tmp_path_factory.mktemp("accelerate_parity")
    reports, _ = accelerate_launch("accelerate_parity.py", args, timeout=180, out=out, use_cpu=False)
    return out, reports


# ----------------------------------------------------------------------- 2 processes
@pytest.mark.multiprocess
def test_cpu_config_really_starts_two_gloo_processes(launched):
    _, reports = launched
    for r in reports:
        assert r["num_processes"] == 2
        assert r["distributed_type"].endswith("MULTI_CPU")
        assert r["ref_model_type"] == "DistributedDataParallel"  # the reference really is DDP
        assert r["zero_model_type"] == "TinyLM"  # ours is the user's model, no wrapper


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", PRESETS)
def test_training_equals_accelerate_ddp(launched, preset):
    """Accumulation 2, clipping active, LR schedule, prepared data loaders: same weights as DDP."""
    _, reports = launched
    for r in reports:
        res = r["parity"][preset]
        assert res["same_object"]
        assert res["clipped"], "the clipping threshold must bite for this test to mean anything"
        assert res["rel"] < 1e-5, f"{preset}: relative weight difference {res['rel']:.2e} vs DDP"
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5)


@pytest.mark.multiprocess
def test_save_state_then_load_state_resumes_across_stages(launched):
    """Saved under zero3 at step 2 (asynchronously), resumed into a fresh model under zero2: same run as
    uninterrupted."""
    out, reports = launched
    for r in reports:
        assert r["background_saves"] == 1
        assert r["resume_loaded_rel"] == 0.0
        assert r["resume_final_rel"] < 1e-6
        assert {"zero_model", "zero_strategy_accelerate.json", "scheduler.bin",
                "random_states_0.pkl", "random_states_1.pkl"} <= set(r["ckpt_files"])
        assert "rank00001-of-00002.safetensors" in r["zero_files"]  # every rank's shard, not rank 0's only


@pytest.mark.multiprocess
def test_load_state_on_one_process(launched):
    out, _ = launched
    args = {"mode": "resume", "from": str(out), "resume_load_preset": "zero1", **COMMON}
    one = Path(tempfile.mkdtemp(prefix="zs_acc1_"))
    log = run_single("accelerate_parity.py", args, one, use_cpu=False)
    (r,) = _procs.read_reports(one, 1, "accelerate_parity.py", log)
    assert r["num_processes"] == 1
    assert r["resume_loaded_rel"] == 0.0
    assert r["resume_final_rel"] < 1e-5


@pytest.mark.multiprocess
@pytest.mark.slow
def test_example_script_with_the_shipped_cpu_config():
    """The command of docs/front-ends/accelerate.md, with bf16 chosen on the launch command line (Accelerate's one precision setting)."""
    out = Path(tempfile.mkdtemp(prefix="zs_example_"))
    log = accelerate_run(ROOT / "recipes" / "accelerate" / "train_example.py",
                         ["--zero-config", "zero3", "--steps", "2", "--out", str(out)], timeout=180,
                         launch_args=("--mixed_precision", "bf16"), use_cpu=False)
    assert "step 2: loss" in log, log[-4000:]
    assert "ZeRO stage 3, precision bf16, 2 processes: saved to" in log, log[-4000:]
    assert (out / "model" / "model.safetensors").exists()
    assert (out / "state" / "zero_model" / "rank00001-of-00002.safetensors").exists()


# ----------------------------------------------------------------------- one process
@functools.lru_cache(maxsize=None)
def _after_setup() -> tuple[dict | None, str]:
    """One run of workers/accelerate_errors.py (Accelerate's state is per process): its raw report,
    or None and the log; each test below asserts its own behaviour on it."""
    out = Path(tempfile.mkdtemp(prefix="zs_acc1_"))
    log = run_single("accelerate_errors.py", None, out, use_cpu=False)
    path = out / "rank0.json"
    return (json.loads(path.read_text()) if path.exists() else None), log


def _report() -> dict:
    report, log = _after_setup()
    assert report is not None, f"accelerate_errors.py reported nothing:\n{log[-6000:]}"
    return report


@pytest.mark.multiprocess
def test_precision_defaults_to_fp32_when_the_launch_chose_none():
    assert _report()["default_precision"] == "fp32"


#: each misuse the worker attempts after setup: the error it must raise and what the message names
REFUSED = {
    "prepared_twice": ("ValueError", "already prepared"),
    "prepared_twice_with_optimizer": ("ValueError", "already prepared"),
    "optimizer_without_model": ("ValueError", "same prepare() call"),
    "clip_subset": ("ValueError", ""),
    "precision_conflict": ("ZeroConfigError", "--mixed_precision bf16"),
    "save_state_while_pending": ("RuntimeError", ""),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_misuse_after_setup_is_refused_with_its_own_error(case):
    """Preparing a prepared model again, an optimizer without its model, clipping a subset of
    the parameters, a config precision against the launch's (the message names the flag to
    use), ``save_state`` while a model waits for its optimizer."""
    error, names = REFUSED[case]
    r = _report()[case]
    assert r["type"] == error and names in r["message"], r


@pytest.mark.multiprocess
def test_a_refused_load_state_restores_nothing():
    """Issue 38: every ZeRO checkpoint of the directory is checked before Accelerate restores its own
    objects and before any model is loaded; the second model's damaged file left the first model
    and a registered object restored before."""
    r = _report()
    assert r["refused_load_state"]["type"] == "CheckpointError", r["refused_load_state"]
    assert "zero_model_1" in r["refused_load_state"]["message"] and "is corrupted" in r["refused_load_state"]["message"]
    assert r["refused_load_state_changed"] == [[], []]
    assert r["refused_load_state_counter"] == 5  # not the saved 0


@pytest.mark.multiprocess
def test_a_model_prepared_before_its_optimizer_waits_for_it():
    r = _report()
    assert r["pending_before_optimizer"] == 1 and r["pending_after_optimizer"] == 0


@pytest.mark.multiprocess
def test_a_model_prepared_before_its_optimizer_is_sharded_when_the_optimizer_comes():
    r = _report()
    assert r["late_is_zero"] and r["late_optimizer"] == "ZeroAcceleratedOptimizer"


@pytest.mark.multiprocess
def test_free_memory_releases_a_stage3_model_without_gathering_it():
    """Gathering the whole model on every rank is what stage 3 avoids: its parameters stay
    released (NaN placeholders of the full shape) unless ``keep_weights=True`` asks."""
    from _models import TinyLM

    r = _report()
    assert not r["after_free_is_zero"]
    assert r["after_free_param_shape"] == list(TinyLM().layers[0].fc1.weight.shape)
    assert r["after_free_all_nan"]


@pytest.mark.multiprocess
def test_free_memory_keep_weights_gives_back_the_unsharded_model():
    r = _report()
    assert not r["kept_is_zero"]
    assert r["kept_max_diff"] == 0.0  # never trained: the weights it was prepared with


@pytest.mark.multiprocess
def test_an_optimizer_of_a_torn_down_model_is_refused():
    assert "torn down" in _report()["stale_optimizer"]["message"]


# ----------------------------------------------------------------------- before Accelerate sets up
@pytest.fixture
def clean_env(monkeypatch):
    for key in ("ZERO_STRATEGY_CONFIG", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_unknown_preset_is_refused_with_a_suggestion(clean_env):
    from zero_strategy import ZeroConfigError
    from zero_strategy.accelerate import ZeroAccelerator

    with pytest.raises(ZeroConfigError, match="zero3"):
        ZeroAccelerator("zer03")


def test_unknown_key_is_refused(clean_env):
    from zero_strategy import ZeroConfigError
    from zero_strategy.accelerate import ZeroAccelerator

    with pytest.raises(ZeroConfigError, match="stagee.*did you mean 'stage'"):
        ZeroAccelerator({"stagee": 2})


def test_env_variable_names_its_source(clean_env):
    from zero_strategy import ZeroConfigError
    from zero_strategy.accelerate import ZeroAccelerator

    clean_env.setenv("ZERO_STRATEGY_CONFIG", "zero4")
    with pytest.raises(ZeroConfigError, match="ZERO_STRATEGY_CONFIG=zero4"):
        ZeroAccelerator()


def test_fsdp_launches_are_refused(clean_env):
    """FSDP would shard a second time; DEEPSPEED launches are adopted (tests/test_accelerate_deepspeed_config.py)."""
    from zero_strategy.accelerate import ZeroAccelerator

    clean_env.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="MULTI_GPU-type accelerate config"):
        ZeroAccelerator("zero2")


def test_sharding_plugins_are_refused(clean_env):
    from zero_strategy.accelerate import ZeroAccelerator

    with pytest.raises(ValueError, match="zero_config"):
        ZeroAccelerator("zero2", fsdp_plugin=object())


def test_config_sources_and_default(clean_env):
    from zero_strategy.accelerate import _config

    assert _config.choose_spec(None)[0] == "zero3"  # tests/test_default_preset.py: the same in every front end
    clean_env.setenv("ZERO_STRATEGY_CONFIG", "zero3_offload")
    assert _config.choose_spec(None)[0] == "zero3_offload"
    assert _config.choose_spec("zero1")[0] == "zero1"
    cfg = _config.load_config(str(ROOT / "recipes" / "accelerate" / "zero3.yaml"), "file")
    assert cfg.stage == 3


def test_precision_comes_from_mixed_precision():
    from zero_strategy import ZeroConfig, ZeroConfigError
    from zero_strategy.accelerate._config import apply_precision

    assert apply_precision(ZeroConfig.preset("zero2"), "bf16", "s").precision == "bf16"
    assert apply_precision(ZeroConfig.preset("zero2"), "fp16", "s").precision == "fp16"
    assert apply_precision(ZeroConfig.preset("zero2"), "no", "s").precision == "fp32"
    assert apply_precision(ZeroConfig.preset("zero2", precision="bf16"), "bf16", "s").precision == "bf16"
    with pytest.raises(ZeroConfigError, match=r"says 'bf16' but Accelerate's mixed_precision='fp16'"):
        apply_precision(ZeroConfig.preset("zero2", precision="bf16"), "fp16", "s")
    with pytest.raises(ValueError, match="fp8"):
        apply_precision(ZeroConfig.preset("zero2"), "fp8", "s")


def test_deepspeed_auto_values_are_resolved_from_accelerate():
    """The per-front-end table is tests/test_auto_values.py."""
    from zero_strategy.accelerate._config import apply_precision, load_config

    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
          "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "gradient_clipping": "auto",
          "train_micro_batch_size_per_gpu": "auto"}
    cfg = apply_precision(load_config(ds, "ds"), "bf16", "ds")
    assert (cfg.stage, cfg.precision, cfg.gradient_clipping) == (3, "bf16", None)
    assert cfg.offload_optimizer is not None
    assert apply_precision(load_config(ds, "ds"), "no", "ds").precision == "fp32"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_import_zero_strategy_does_not_import_accelerate():
    code = ("import sys, zero_strategy; assert 'accelerate' not in sys.modules; "
            "zero_strategy.ZeroAccelerator; assert 'accelerate' in sys.modules")
    proc = _procs.run([sys.executable, "-c", code], 60, env=launch_env(use_cpu=False))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("key", ["tp_size", "cp_size"])
def test_model_parallel_sizes_are_refused_not_run_as_data_parallelism(clean_env, key):
    """Tensor and context parallelism, run as data parallelism, would train two samples where one
    was to be split: refused by name (sequence parallelism is honoured: test_accelerate_sequence_parallel.py)."""
    from accelerate.parallelism_config import ParallelismConfig

    from zero_strategy.accelerate import ZeroAccelerator

    with pytest.raises(ValueError, match=f"{key} to 1"):
        ZeroAccelerator("zero2", parallelism_config=ParallelismConfig(**{key: 2}))


def test_a_launch_config_asking_for_sequence_parallelism_in_one_process_is_refused(clean_env):
    """What `accelerate launch` sets from a config file with ``parallelism_config_sp_size: 2``, in a
    process that is not one of a multiple of 2: refused, never run as data parallelism."""
    from zero_strategy.accelerate import ZeroAccelerator

    clean_env.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    clean_env.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    clean_env.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="sequence parallelism of size 2 needs a multiple of 2 processes"):
        ZeroAccelerator("zero2")
