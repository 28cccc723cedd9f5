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
import shutil
import sys
import tempfile
from pathlib import Path

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
    :func:`launch_env` of ``use_cpu``) replaces the launch's environment."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(ranks), "--main_process_port", str(free_port()), *launch_args, str(script),
           *script_args]
    return _procs.run(cmd, timeout, env=env or launch_env(use_cpu), cwd=cwd or ROOT, merge_stderr=True).stdout


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
    log = accelerate_run(HERE / "workers" / worker, [str(out)], config, ranks, timeout, cwd, env, launch_args, use_cpu)
    return _procs.read_reports(out, ranks, worker, log), log


def run_single(worker: str, args: dict | None, out: Path, timeout: float = 120.0, use_cpu: bool = True) -> str:
    """``python tests/workers/WORKER OUT`` as one plain process (no launcher: Accelerate's state is a
    per-process singleton) in a launch's environment; its combined log. ``args``, unless None, is
    written to ``OUT/args.json`` first; OUT is the caller's and kept."""
    if args is not None:
        (out / "args.json").write_text(json.dumps(args))
    proc = _procs.run([sys.executable, str(HERE / "workers" / worker), str(out)], timeout, env=launch_env(use_cpu))
    return proc.stdout + proc.stderr
