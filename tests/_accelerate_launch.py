"""``accelerate launch`` of a worker script with a given accelerate config, judged by per-rank reports.

As tests/_launch.py, but through Accelerate's own launcher, the way users start their
scripts: each rank writes ``<out>/rank<r>.json`` (ranks can abort at interpreter exit
after finishing, see tests/_launch.py), and a run that hangs is killed by ``timeout``.
The shipped CPU config (recipes/accelerate/cpu_2proc.yaml) is MULTI_GPU-type with
ACCELERATE_USE_CPU set by the launch environment, so both the stock ``Accelerator``
(DDP) and ZeroAccelerator form one gloo group of 2 CPU processes.
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


def launch_env(**extra: str) -> dict:
    return _procs.child_env(drop=_procs.LAUNCH_VARS + _procs.FRONT_END_VARS, ACCELERATE_USE_CPU="1", **extra)


def accelerate_run(script: Path, script_args: list[str], config: Path = CPU_CONFIG, ranks: int = 2,
                   timeout: float = 240.0, cwd: Path | None = None, env: dict | None = None,
                   launch_args: tuple[str, ...] = ()) -> str:
    """``accelerate launch --config_file CONFIG [launch_args] SCRIPT [script_args]``; its combined log.
    A launch that outlives ``timeout`` is killed with every rank it started."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(ranks), "--main_process_port", str(free_port()), *launch_args, str(script),
           *script_args]
    return _procs.run(cmd, timeout, env=env or launch_env(), cwd=cwd or ROOT, merge_stderr=True).stdout


def accelerate_launch(worker: str, args: dict, config: Path = CPU_CONFIG, ranks: int = 2, timeout: float = 240.0,
                      cwd: Path | None = None, env: dict | None = None) -> tuple[list[dict], str]:
    """``accelerate launch --config_file CONFIG tests/workers/WORKER OUT``; (each rank's report, combined log)."""
    out = Path(tempfile.mkdtemp(prefix="zs_accl_"))
    try:
        (out / "args.json").write_text(json.dumps(args))
        log = accelerate_run(HERE / "workers" / worker, [str(out)], config, ranks, timeout, cwd, env)
        return _procs.read_reports(out, ranks, worker, log), log
    finally:
        shutil.rmtree(out, ignore_errors=True)
