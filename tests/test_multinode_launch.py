"""Multi-node launches through the launchers users already have, simulated on one host as
2 nodes x 2 processes (gloo): torchrun (static and c10d rendezvous), Lightning's
``Trainer(num_nodes=2, devices=2)`` under torchrun and under SLURM's variables, and
``accelerate launch --num_machines 2``. Issue #15.

Each run trains two steps at stage 3 (tests/workers/multinode.py); the oracle is plain
torch AdamW on each step's whole global batch, computed in one process, which is what DDP
computes. Every rank must report its launcher-given place and weights within fp32
tolerance of that reference. The checkpoint filesystem rule: with a path each node sees
as its own directory (no shared filesystem), saving fails on every rank with an error
that says why; with a shared one it saves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _procs
from _procs import HERE, free_port
from _zygote import rank_entry, warm_command

WORKER = str(HERE / "workers" / "multinode.py")
ROOT = HERE.parent
TOL = 1e-5


def env(**extra) -> dict:
    """The test's environment without any launcher's variables (each node's launcher sets its own)."""
    drop = tuple(k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_", "ACCELERATE_")))
    return _procs.child_env(drop=drop + _procs.LAUNCH_VARS + ("NODE_RANK", "GROUP_RANK"), **extra)


def run_nodes(commands: list[tuple[list[str], dict]], out: Path, timeout: float = 200) -> list[dict]:
    """Start one command per simulated node (or per process), wait, return the 4 ranks' reports.
    At ``timeout`` every node's launcher is killed with all its ranks."""
    procs = [_procs.start(*warm_command(cmd, e)) for cmd, e in commands]  # [Note: warm processes behind a launcher]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    _procs.kill_group(q)
                tails = "\n".join(q.communicate()[0][-3000:] for q in procs)
                raise AssertionError(f"the nodes did not finish in {timeout}s:\n{tails}") from None
    finally:
        for p in procs:
            _procs.kill_group(p)
    reports = _procs.read_reports(out, 4, "the 2 nodes", "\n".join(log[-3000:] for log in logs))
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}:\n{rep['error']}"
    return reports


def prepare(tmp_path: Path, ckpt: dict | None = None, **extra) -> Path:
    (tmp_path / "args.json").write_text(json.dumps({"stage": 3, "ckpt": ckpt, **extra}))
    return tmp_path


def torchrun(node: int, port: int, out: Path, mode: str, rdzv: bool = False) -> list[str]:
    where = (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zs-test"] if rdzv
             else ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)])
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", *where,
            *rank_entry(WORKER), str(out), mode]


def assert_trained_like_the_reference(reports: list[dict]) -> None:
    for r, rep in enumerate(reports):
        assert rep["global_rank"] == r
        assert rep["diff"] < TOL, (r, rep["diff"])


def assert_two_nodes_of_two(reports: list[dict], node_key: str, local_key: str) -> None:
    places = sorted((int(rep["place"][node_key]), int(rep["place"][local_key])) for rep in reports)
    assert places == [(0, 0), (0, 1), (1, 0), (1, 1)], places


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_torchrun_static_rendezvous_two_nodes(tmp_path):
    out, port = prepare(tmp_path), free_port()
    reports = run_nodes([(torchrun(n, port, out, "plain"), env()) for n in (0, 1)], out)
    assert_trained_like_the_reference(reports)
    assert_two_nodes_of_two(reports, "GROUP_RANK", "LOCAL_RANK")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_c10d_rendezvous_two_nodes_and_a_shared_checkpoint(tmp_path):
    shared = str(tmp_path / "shared" / "ckpt")
    out, port = prepare(tmp_path, ckpt={"0": shared, "1": shared}), free_port()
    reports = run_nodes([(torchrun(n, port, out, "plain", rdzv=True), env()) for n in (0, 1)], out)
    assert_trained_like_the_reference(reports)
    assert_two_nodes_of_two(reports, "GROUP_RANK", "LOCAL_RANK")
    assert all(rep["save"] == "" for rep in reports), [rep["save"] for rep in reports]
    # every rank's shard, written on both "nodes", in the one directory, and published
    assert sorted(p.name for p in Path(shared).glob("rank*")) == [f"rank{r:05d}-of-00004.safetensors" for r in range(4)]
    assert (Path(shared) / "metadata.json").is_file()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_path_that_is_not_shared_between_nodes_fails_clearly_on_every_rank(tmp_path):
    (tmp_path / "node1").mkdir()
    ckpt = {"0": str(tmp_path / "node0" / "ckpt"), "1": str(tmp_path / "node1" / "ckpt")}  # one directory per node
    out, port = prepare(tmp_path, ckpt=ckpt), free_port()
    reports = run_nodes([(torchrun(n, port, out, "plain"), env()) for n in (0, 1)], out)
    for rep in reports:
        assert "cannot see" in rep["save"] and "shared by every rank" in rep["save"], rep["save"]
    assert not (tmp_path / "node0" / "ckpt").exists()  # nothing half-made was published
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == []  # its temporary directory removed


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_lightning_num_nodes_2_under_torchrun(tmp_path):
    pytest.importorskip("lightning")
    out, port = prepare(tmp_path), free_port()
    reports = run_nodes([(torchrun(n, port, out, "lightning"), env()) for n in (0, 1)], out)
    assert_trained_like_the_reference(reports)
    assert {rep["environment"] for rep in reports} == {"TorchElasticEnvironment"}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_lightning_num_nodes_2_under_slurm_variables(tmp_path):
    """What ``srun --nodes 2 --ntasks-per-node 2`` sets, one process per task (srun starts them)."""
    pytest.importorskip("lightning")
    out, port = prepare(tmp_path), free_port()
    commands = []
    for r in range(4):
        slurm = dict(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(r), SLURM_LOCALID=str(r % 2),
                     SLURM_NODEID=str(r // 2), SLURM_NNODES="2", SLURM_JOB_NAME="zs_multinode",
                     SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))
        commands.append(([sys.executable, WORKER, str(out), "lightning"], env(**slurm)))
    reports = run_nodes(commands, out)
    assert_trained_like_the_reference(reports)
    assert {rep["environment"] for rep in reports} == {"SLURMEnvironment"}
    assert_two_nodes_of_two(reports, "SLURM_NODEID", "SLURM_LOCALID")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_accelerate_launch_two_machines(tmp_path):
    pytest.importorskip("accelerate")
    out, port = prepare(tmp_path), free_port()
    config = ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"
    commands = [([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                  "--num_machines", "2", "--machine_rank", str(n), "--num_processes", "4",
                  "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *rank_entry(WORKER), str(out),
                  "accelerate"],
                 env()) for n in (0, 1)]
    reports = run_nodes(commands, out)
    assert_trained_like_the_reference(reports)
    assert_two_nodes_of_two(reports, "GROUP_RANK", "LOCAL_RANK")


# Hybrid sharding through each front end's own knob: shard within the node (LOCAL_WORLD_SIZE=2),
# replicate across the two nodes; the same reference.
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("front_end", ["plain", "lightning"])
def test_hybrid_sharding_per_node_under_torchrun(front_end, tmp_path):
    """The plain API's ZeroConfig and the Lightning strategy's argument, shard_group_size='node'."""
    if front_end == "lightning":
        pytest.importorskip("lightning")
    out, port = prepare(tmp_path, shard_group_size="node"), free_port()
    reports = run_nodes([(torchrun(n, port, out, front_end), env()) for n in (0, 1)], out)
    assert_trained_like_the_reference(reports)
    assert {rep["replicas"] for rep in reports} == {2}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_hybrid_sharding_through_accelerate_config(tmp_path):
    pytest.importorskip("accelerate")
    out, port = prepare(tmp_path, shard_group_size=2), free_port()
    config = ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"
    commands = [([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                  "--num_machines", "2", "--machine_rank", str(n), "--num_processes", "4",
                  "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *rank_entry(WORKER), str(out),
                  "accelerate"],
                 env()) for n in (0, 1)]
    reports = run_nodes(commands, out)
    assert_trained_like_the_reference(reports)
    assert {rep["replicas"] for rep in reports} == {2}
