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
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _launch import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CPU_CONFIG = ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"


def launch_env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZERO_STRATEGY_CONFIG", "ACCELERATE_USE_DEEPSPEED",
                "ACCELERATE_USE_FSDP", "ZERO_STRATEGY_ADOPTED_DEEPSPEED_LAUNCH", "ZERO_STRATEGY_LOG_ALL_RANKS"):
        env.pop(key, None)
    env.update(extra)
    return env


def accelerate_launch(worker: str, args: dict, config: Path = CPU_CONFIG, ranks: int = 2, timeout: float = 240.0,
                      cwd: Path | None = None, env: dict | None = None) -> tuple[list[dict], str]:
    """``accelerate launch --config_file CONFIG tests/workers/WORKER OUT``; (each rank's report, combined log)."""
    out = Path(tempfile.mkdtemp(prefix="zs_accl_"))
    try:
        (out / "args.json").write_text(json.dumps(args))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(ranks), "--main_process_port", str(free_port()),
               str(HERE / "workers" / worker), str(out)]
        proc = subprocess.run(cmd, env=env or launch_env(), cwd=cwd or ROOT, capture_output=True, text=True,
                              timeout=timeout)
        log = proc.stdout + proc.stderr
        missing = [r for r in range(ranks) if not (out / f"rank{r}.json").exists()]
        if missing:
            raise AssertionError(f"ranks {missing} of {worker} reported nothing:\n{log[-6000:]}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], log
    finally:
        shutil.rmtree(out, ignore_errors=True)
