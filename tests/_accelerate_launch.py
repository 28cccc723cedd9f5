"""``accelerate launch`` of a worker script with a given accelerate config, judged by per-rank reports:
the one Accelerate launcher of the tests.

As tests/_launch.py, but through Accelerate's own launcher, the way users start their
scripts: each rank writes ``<out>/rank<r>.json`` (ranks can abort at interpreter exit
after finishing, see tests/_launch.py), and a run that hangs is killed by ``timeout``.
The shipped CPU config (recipes/accelerate/cpu_2proc.yaml) is MULTI_GPU-type; on a machine
without GPUs its processes form one gloo group only once ACCELERATE_USE_CPU is set. Two
policies, chosen per launch by ``use_cpu``:

* ``True`` (the default): the launch environment exports ACCELERATE_USE_CPU=1, which a script
  needs when it builds a stock ``Accelerator`` or ``TrainingArguments`` (a DDP reference)
  before any ZeroAccelerator/ZeroTrainer;
* ``False``: the launch starts as a user's shell does, without it, and ZeroAccelerator sets it
  (see the config's comment); the tests of that path, and of scripts that build ours first.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import _launch
import _procs
from _procs import HERE, ROOT, free_port

CPU_CONFIG = ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"


def launch_env(use_cpu: bool = True, **extra: str) -> dict:
    """A launch's environment: this process's, less the launch and front-end variables a test may
    have set, with ACCELERATE_USE_CPU=1 when ``use_cpu`` (see the module's docstring) and ``extra``."""
    cpu = {"ACCELERATE_USE_CPU": "1"} if use_cpu else {}
    return _procs.child_env(drop=_procs.LAUNCH_VARS + _procs.FRONT_END_VARS, **{**cpu, **extra})


def accelerate_run(script: Path, script_args: list[str], config: Path = CPU_CONFIG, ranks: int = 2,
                   timeout: float = 240.0, cwd: Path | None = None, env: dict | None = None,
                   launch_args: tuple[str, ...] = (), use_cpu: bool = True, warm: bool = False) -> str:
    """``accelerate launch --config_file CONFIG [launch_args] SCRIPT [script_args]``; its combined log.
    A launch that outlives ``timeout`` is killed with every rank it started. ``env`` (default
    :func:`launch_env` of ``use_cpu``) replaces the launch's environment. Always Accelerate's own
    launcher: the tests of the command users type (the recipe's, the DeepSpeed configs') use this.
    ``warm``: the launcher's process and the ranks it starts are warm interpreters behind
    tests/_zygote_shim.py ([Note: warm processes behind a launcher] in tests/_zygote.py); what the
    launcher does is unchanged."""
    from _zygote import rank_entry, warm_command

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(ranks), "--main_process_port", str(free_port()), *launch_args,
           *(rank_entry(str(script)) if warm else [str(script)]), *script_args]
    env = env or launch_env(use_cpu)
    if warm:
        cmd, env = warm_command(cmd, env)
    return _procs.run(cmd, timeout, env=env, cwd=cwd or ROOT, merge_stderr=True).stdout


# [Note: warm Accelerate launches]
# ``accelerate launch`` on a single machine does two things: it turns its arguments and config file
# into environment variables (for a MULTI_GPU-type config ``prepare_multi_gpu_env``, for a DeepSpeed
# one ``prepare_deepspeed_cmd_env``, applied with ``patch_environment``), and it runs torchrun
# (``_run_torchrun``), which starts each rank with that environment plus its own per-rank variables.
# Each launch cost three cold interpreters (the launcher, which imports torch, and two ranks importing
# torch and transformers, and DeepSpeed for its configs): 10-15 s of CPU, about 30 launches a suite.
# So a test's launch runs Accelerate's own ``launch_command`` here, on its parsed arguments, with
# ``_run_torchrun`` replaced by a function that keeps the environment Accelerate prepared for it,
# and the ranks fork warm from tests/_launch.py's forkserver with torchrun's per-rank variables
# (TORCHELASTIC_USE_AGENT_STORE=False: no agent holds the store, rank 0 does, as under a plain
# ``init_process_group``). Accelerate's dispatch, validation and translation of every argument
# (dynamo flags, mixed precision, DeepSpeed fields) are its own; only the process start is ours.
# A launch that would not reach torchrun (a CPU-typed or single-process config, several machines,
# DeepSpeed's multi-node runner) and ``accelerate_run`` itself (``real_launcher=True``) keep the real
# launcher, so the command users type is still tested: test_accelerate_zero.py's recipe run and
# test_accelerate_deepspeed_config.py's DeepSpeed config file (that one's launcher process and ranks
# are warm interpreters behind tests/_zygote_shim.py, ``warm_behind_launcher``: Accelerate's launcher and
# torchrun still start every process). ZS_TEST_COLD_START=1 makes every launch the real one.


class _NotTorchrun(Exception):
    """Accelerate chose a launch other than a single-machine torchrun: the real launcher runs it."""


def _warm_rank_envs(config: Path, ranks: int, env: dict, script: Path, script_args: list[str],
                    launch_args: tuple[str, ...], cwd: Path) -> list[dict] | None:
    """Each rank's environment as ``accelerate launch --config_file CONFIG [launch_args]`` would give it
    through torchrun, or None where that launch does not start torchrun on one machine. See [Note: warm
    Accelerate launches]."""
    if not _launch._WARM:
        return None
    from unittest import mock

    import accelerate.commands.launch as accelerate_launcher

    prepared: dict[str, str] = {}

    def keep_environment(args):  # in place of torchrun: what Accelerate set up for it
        if args.num_machines != 1 or args.num_processes != ranks:
            raise _NotTorchrun
        prepared.update(os.environ)

    def refuse(*_args, **_kwargs):
        raise _NotTorchrun

    port = free_port()
    argv = ["--config_file", str(config), "--num_processes", str(ranks), "--main_process_port", str(port),
            *launch_args, str(script), *script_args]
    saved, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)  # what the launcher process would read, where it would read it
    os.chdir(cwd)
    try:
        with mock.patch.object(accelerate_launcher, "_run_torchrun", keep_environment), \
                mock.patch.object(accelerate_launcher, "_run_subprocess", refuse), \
                mock.patch.object(accelerate_launcher, "simple_launcher", refuse), \
                mock.patch.object(accelerate_launcher, "tpu_launcher", refuse), \
                mock.patch.object(accelerate_launcher, "sagemaker_launcher", refuse):
            accelerate_launcher.launch_command(accelerate_launcher.launch_command_parser().parse_args(argv))
    except _NotTorchrun:
        return None
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved)
    prepared.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks),
                    LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default",
                    ROLE_WORLD_SIZE=str(ranks), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                    TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="False")
    return [dict(prepared, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r)) for r in range(ranks)]


def accelerate_launch(worker: str, args: dict, config: Path = CPU_CONFIG, ranks: int = 2, timeout: float = 240.0,
                      cwd: Path | None = None, env: dict | None = None, *, out: Path | None = None,
                      launch_args: tuple[str, ...] = (), use_cpu: bool = True,
                      real_launcher: bool = False, warm_behind_launcher: bool = False) -> tuple[list[dict], str]:
    """``accelerate launch --config_file CONFIG [launch_args] tests/workers/WORKER OUT``; (each rank's
    report, combined log).

    ``out``: a directory the caller owns, for a test that reads the files the workers wrote
    there; it is kept. Without it a temporary directory is made and removed (as tests/_launch.py).
    ``real_launcher``: Accelerate's launcher process and torchrun start the ranks, never the warm start
    (see [Note: warm Accelerate launches]); with ``warm_behind_launcher`` those processes are warm
    interpreters behind the zygote's shim (``accelerate_run``'s ``warm``)."""
    if out is not None:
        return _accelerate_launch(worker, args, Path(out), config, ranks, timeout, cwd, env, launch_args, use_cpu,
                                  real_launcher, warm_behind_launcher)
    out = Path(tempfile.mkdtemp(prefix="zs_accl_"))
    try:
        return _accelerate_launch(worker, args, out, config, ranks, timeout, cwd, env, launch_args, use_cpu,
                                  real_launcher, warm_behind_launcher)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _accelerate_launch(worker, args, out, config, ranks, timeout, cwd, env, launch_args, use_cpu, real_launcher,
                       warm_behind_launcher):
    (out / "args.json").write_text(json.dumps(args))
    script = HERE / "workers" / worker
    rank_envs = None if real_launcher else _warm_rank_envs(config, ranks, env or launch_env(use_cpu), script,
                                                           [str(out)], launch_args, cwd or ROOT)
    if rank_envs is None:
        log = accelerate_run(script, [str(out)], config, ranks, timeout, cwd, env, launch_args, use_cpu,
                             warm=warm_behind_launcher)
    else:
        log = _launch.run_warm_ranks(script, [str(out)], rank_envs, out, timeout, f"accelerate launch {worker}",
                                     cwd=cwd or ROOT)
    return _procs.read_reports(out, ranks, worker, log), log


def run_single(worker: str, args: dict | None, out: Path, timeout: float = 120.0, use_cpu: bool = True) -> str:
    """``python tests/workers/WORKER OUT`` as one plain process (no launcher: Accelerate's state is a
    per-process singleton) in a launch's environment; its combined log. ``args``, unless None, is
    written to ``OUT/args.json`` first; OUT is the caller's and kept. The process forks warm, as a
    launch's ranks do (tests/_launch.py, [Note: warm worker start]; its log in ``OUT/single/``): a
    process of its own, so Accelerate's state starts empty there as in a fresh interpreter, the
    forkserver having imported Accelerate without making any. A fresh interpreter under
    ``ZS_TEST_COLD_START=1``."""
    if args is not None:
        (out / "args.json").write_text(json.dumps(args))
    script, env = HERE / "workers" / worker, launch_env(use_cpu)
    if _launch._WARM:
        logs = out / "single"
        logs.mkdir(exist_ok=True)
        return _launch.run_warm_ranks(script, [str(out)], [env], logs, timeout, worker, cwd=ROOT)
    proc = _procs.run([sys.executable, str(script), str(out)], timeout, env=env)
    return proc.stdout + proc.stderr
