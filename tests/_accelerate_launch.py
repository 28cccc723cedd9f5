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
                   launch_args: tuple[str, ...] = (), use_cpu: bool = True) -> str:
    """``accelerate launch --config_file CONFIG [launch_args] SCRIPT [script_args]``; its combined log.
    A launch that outlives ``timeout`` is killed with every rank it started. ``env`` (default
    :func:`launch_env` of ``use_cpu``) replaces the launch's environment. Always Accelerate's own
    launcher: the tests of the command users type (the recipe's, the DeepSpeed configs') use this."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(ranks), "--main_process_port", str(free_port()), *launch_args, str(script),
           *script_args]
    return _procs.run(cmd, timeout, env=env or launch_env(use_cpu), cwd=cwd or ROOT, merge_stderr=True).stdout


# [Note: warm Accelerate launches]
# ``accelerate launch`` with a single-machine MULTI_GPU-type config does two things: it turns its
# arguments and config file into environment variables (``prepare_multi_gpu_env``), and it runs
# torchrun, which starts each rank with that environment plus its own per-rank variables. Each
# launch cost three cold interpreters (the launcher, which imports torch, and two ranks importing
# torch and transformers): about 10 s of CPU, 30 launches a suite. So where a test launches a
# worker on that config, the environment comes from Accelerate's own parser and env preparation,
# run here, and the ranks fork warm from tests/_launch.py's forkserver with torchrun's per-rank
# variables (TORCHELASTIC_USE_AGENT_STORE=False: no agent holds the store, rank 0 does, as under
# a plain ``init_process_group``). Anything else (DeepSpeed or FSDP configs, several machines,
# extra launch arguments) and ``accelerate_run`` itself keep the real launcher, so the command
# users type is still tested (test_accelerate_zero.py's recipe run, test_accelerate_deepspeed_config.py).
# ZS_TEST_COLD_START=1 makes every launch the real one.


def _warm_rank_envs(config: Path, ranks: int, env: dict, script: Path, script_args: list[str]) -> list[dict] | None:
    """Each rank's environment as ``accelerate launch --config_file CONFIG`` with torchrun would give it,
    or None where that launch is not a single-machine torchrun launch. See [Note: warm Accelerate launches]."""
    if not _launch._WARM:
        return None
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    port = free_port()
    argv = ["--config_file", str(config), "--num_processes", str(ranks), "--main_process_port", str(port),
            str(script), *script_args]
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # what the launcher process would read
    try:
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
        if not args.multi_gpu or args.cpu or args.use_deepspeed or args.use_fsdp or args.num_machines != 1:
            return None
        shared = prepare_multi_gpu_env(args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    shared.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                  GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default", ROLE_WORLD_SIZE=str(ranks),
                  TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                  TORCHELASTIC_USE_AGENT_STORE="False",
                  TORCH_NCCL_ASYNC_ERROR_HANDLING=shared.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    return [dict(shared, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r)) for r in range(ranks)]


def accelerate_launch(worker: str, args: dict, config: Path = CPU_CONFIG, ranks: int = 2, timeout: float = 240.0,
                      cwd: Path | None = None, env: dict | None = None, *, out: Path | None = None,
                      launch_args: tuple[str, ...] = (), use_cpu: bool = True) -> tuple[list[dict], str]:
    """``accelerate launch --config_file CONFIG [launch_args] tests/workers/WORKER OUT``; (each rank's
    report, combined log).

    ``out``: a directory the caller owns, for a test that reads the files the workers wrote
    there; it is kept. Without it a temporary directory is made and removed (as tests/_launch.py)."""
    if out is not None:
        return _accelerate_launch(worker, args, Path(out), config, ranks, timeout, cwd, env, launch_args, use_cpu)
    out = Path(tempfile.mkdtemp(prefix="zs_accl_"))
    try:
        return _accelerate_launch(worker, args, out, config, ranks, timeout, cwd, env, launch_args, use_cpu)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _accelerate_launch(worker, args, out, config, ranks, timeout, cwd, env, launch_args, use_cpu):
    (out / "args.json").write_text(json.dumps(args))
    script = HERE / "workers" / worker
    rank_envs = None if launch_args else _warm_rank_envs(config, ranks, env or launch_env(use_cpu), script, [str(out)])
    if rank_envs is None:
        log = accelerate_run(script, [str(out)], config, ranks, timeout, cwd, env, launch_args, use_cpu)
    else:
        log = _launch.run_warm_ranks(script, [str(out)], rank_envs, out, timeout, f"accelerate launch {worker}",
                                     cwd=cwd or ROOT)
    return _procs.read_reports(out, ranks, worker, log), log


def run_single(worker: str, args: dict | None, out: Path, timeout: float = 120.0, use_cpu: bool = True) -> str:
    """``python tests/workers/WORKER OUT`` as one plain process (no launcher: Accelerate's state is a
    per-process singleton) in a launch's environment; its combined log. ``args``, unless None, is
    written to ``OUT/args.json`` first; OUT is the caller's and kept."""
    if args is not None:
        (out / "args.json").write_text(json.dumps(args))
    proc = _procs.run([sys.executable, str(HERE / "workers" / worker), str(out)], timeout, env=launch_env(use_cpu))
    return proc.stdout + proc.stderr
