"""estimate_memory reproduces the ZeRO paper's per-rank model-state formulas.

References are computed independently here: the paper's Figure 1 numbers
(7.5B parameters, N = 64, mixed-precision Adam, K = 12) and hand-written
per-term formulas for other dtypes, optimizers and offloads.
"""

import json

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy.config import NVMeOffload, ZeroConfig, ZeroConfigError
from zero_strategy.estimate import MemoryEstimate, count_parameters, estimate_memory, format_table

PSI = 7.5e9
N = 64
GB = 1e9


@pytest.mark.parametrize("stage, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, paper_gb):
    # Figure 1 of Rajbhandari et al. 2020: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    est = estimate_memory(PSI, world_size=N, stage=stage, precision="fp16", optimizer="adam")
    assert est.total_device / GB == pytest.approx(paper_gb, abs=0.05)


def test_zero_paper_formulas_exactly():
    # bf16 Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
    expected = {0: 16 * PSI, 1: 4 * PSI + 12 * PSI / N, 2: 2 * PSI + 14 * PSI / N, 3: 16 * PSI / N}
    for stage, nbytes in expected.items():
        est = estimate_memory(PSI, world_size=N, stage=stage, precision="bf16")
        assert est.total_device == nbytes, stage
        assert est.total_host == 0 and est.nvme_bytes == 0


def test_per_term_breakdown_stage_2_bf16_adam():
    est = estimate_memory(1_000_000, world_size=4, stage=2, precision="bf16")
    assert (est.device_params, est.device_grads, est.device_optimizer) == (2_000_000, 500_000, 3_000_000)


def test_fp32_has_no_master_copy():
    # P = G = 4, M = 0, S = 8: stage 1 = 8Ψ + 8Ψ/N.
    est = estimate_memory(1_000_000, world_size=4, stage=1, precision="fp32")
    assert (est.device_params, est.device_grads, est.device_optimizer) == (4_000_000, 4_000_000, 2_000_000)


def test_reduce_dtype_changes_only_gradients():
    est = estimate_memory(1_000_000, world_size=2, stage=3, precision="bf16", reduce_dtype="fp32")
    assert (est.device_params, est.device_grads, est.device_optimizer) == (1_000_000, 2_000_000, 6_000_000)


@pytest.mark.parametrize("optimizer, state", [("adam", 8), ("AdamW", 8), ("sgd", 0), ("sgd_momentum", 4),
                                              ("adagrad", 4), ("rmsprop", 4), (6, 6)])
def test_optimizer_state_bytes(optimizer, state):
    est = estimate_memory(1000, world_size=1, stage=1, precision="bf16", optimizer=optimizer)
    assert est.device_optimizer == (4 + state) * 1000


def test_frozen_params_hold_only_parameters():
    for stage, params in [(0, 2 * 800), (1, 2 * 800), (2, 2 * 800), (3, 2 * 800 / 4)]:
        est = estimate_memory(0, frozen_params=800, world_size=4, stage=stage, precision="bf16")
        assert (est.device_params, est.device_grads, est.device_optimizer) == (params, 0, 0)


def test_cpu_optimizer_offload():
    psi, n = 1_000_000, 4
    est = estimate_memory(psi, world_size=n, stage=2, precision="bf16", offload_optimizer="cpu")
    assert est.device_optimizer == 0
    assert est.host_optimizer == 12 * psi / n
    assert est.host_grads == 2 * psi / n  # the bf16 gradient shard's host copy for the CPU step
    assert est.total_device == 2 * psi + 2 * psi / n
    assert est.total_host == 14 * psi / n and est.nvme_bytes == 0


def test_nvme_optimizer_offload_uses_disk_and_staging():
    psi, n = 1_000_000, 4
    est = estimate_memory(psi, world_size=n, stage=3, precision="bf16", offload_optimizer="nvme")
    assert est.nvme_bytes == 12 * psi / n and est.host_optimizer == 0
    assert est.host_staging == 4 * 64 * 2**20
    custom = NVMeOffload(buffer_count=3, buffer_size=4096 * 10)
    est = estimate_memory(psi, world_size=n, stage=3, offload_optimizer=custom)
    assert est.host_staging == 3 * 40960


def test_param_offload_stage_3():
    psi, psi_f, n = 1_000_000, 200_000, 4
    cpu = estimate_memory(psi, frozen_params=psi_f, world_size=n, stage=3, precision="bf16",
                          offload_optimizer="cpu", offload_params="cpu")
    assert cpu.device_params == 0 and cpu.host_params == 2 * (psi + psi_f) / n
    assert cpu.total_device == 2 * psi / n  # only the gradient shard remains
    nvme = estimate_memory(psi, frozen_params=psi_f, world_size=n, stage=3, precision="bf16",
                           offload_optimizer="nvme", offload_params="nvme")
    assert nvme.nvme_bytes == 12 * psi / n + 2 * (psi + psi_f) / n
    assert nvme.host_staging == 2 * 4 * 64 * 2**20


def test_stage_none_gives_ddp_and_every_stage():
    rows = estimate_memory(PSI, world_size=N)
    labels = [r.label for r in rows]
    assert labels[:3] == ["DDP", "ZeRO-1", "ZeRO-2"]
    assert "ZeRO-3 opt:cpu params:cpu" in labels and "ZeRO-3 opt:nvme params:nvme" in labels
    assert all(isinstance(r, MemoryEstimate) for r in rows)
    # Each step down the table never needs more device memory.
    device = [r.total_device for r in rows]
    assert device == sorted(device, reverse=True)


def test_stage_none_with_offload_keeps_the_offload():
    rows = estimate_memory(1e6, world_size=2, offload_params="cpu")
    assert [(r.stage, r.offload_params) for r in rows] == [(0, "none"), (3, "cpu")]


def test_config_supplies_stage_precision_and_offload():
    cfg = ZeroConfig.preset("zero3_offload", precision="bf16")
    assert estimate_memory(1e6, world_size=4, config=cfg) == estimate_memory(
        1e6, world_size=4, stage=3, precision="bf16", offload_optimizer="cpu", offload_params="cpu")
    with pytest.raises(ZeroConfigError, match=r"^config: given together with stage.*either config"):
        estimate_memory(1e6, config=cfg, stage=2)
    with pytest.raises(ZeroConfigError, match=r"^config: expected a ZeroConfig"):
        estimate_memory(1e6, config={"stage": 3})


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once
        self.norm = nn.LayerNorm(16)
        self.norm.requires_grad_(False)  # frozen


def test_module_counts_trainable_frozen_and_tied_once():
    model = Tied()
    assert count_parameters(model) == (100 * 16 + 16 * 16 + 16, 2 * 16)
    est = estimate_memory(model, world_size=1, stage=0, precision="fp32", optimizer="sgd")
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    assert (est.num_params, est.frozen_params) == (trainable, 32)
    assert est.total_device == 8 * trainable + 4 * 32


def test_module_on_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    assert estimate_memory(model, stage=3, world_size=2).num_params == 1000 * 1000 + 1000 + 1000 * 10 + 10


def test_format_table_is_aligned_in_gib():
    rows = estimate_memory(PSI, world_size=N)
    table = format_table(rows)
    lines = table.splitlines()
    assert "GiB" in lines[0] and set(lines[1]) <= {"-", " "}
    body = lines[2:2 + len(rows)]
    assert len({len(line) for line in body}) == 1  # aligned columns
    ddp = body[0].split()
    assert ddp[0] == "DDP" and float(ddp[4]) == round(16 * PSI / 2**30, 2)
    assert format_table(rows[0]).splitlines()[2].startswith("DDP")


def test_str_and_to_dict():
    est = estimate_memory(PSI, world_size=N, stage=3)
    assert "ZeRO-3" in str(est) and "GiB" in str(est)
    data = json.loads(json.dumps(est.to_dict()))
    assert data["total_device"] == 16 * PSI / N and data["stage"] == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(model_or_num_params=-1), r"^model_or_num_params: expected a non-negative number"),
     (dict(model_or_num_params="7B"), r"^model_or_num_params: expected a non-negative number"),
     (dict(model_or_num_params=10, frozen_params=-5), r"^frozen_params: expected a non-negative number"),
     (dict(model_or_num_params=10, world_size=0), r"^world_size: must be an integer >= 1, got 0"),
     (dict(model_or_num_params=10, world_size=2.0), r"^world_size: must be an integer >= 1"),
     (dict(model_or_num_params=10, stage=4), r"^stage: must be 0 \(DDP\), 1, 2 or 3, got 4"),
     (dict(model_or_num_params=10, optimizer="adamm"), r"^optimizer: unknown optimizer 'adamm' \(did you mean .*'adam'"),
     (dict(model_or_num_params=10, optimizer=-1), r"^optimizer: state bytes per parameter must be >= 0"),
     (dict(model_or_num_params=10, precision="int8"), r"^precision: unknown dtype 'int8'"),
     (dict(model_or_num_params=10, stage=2, offload_params="cpu"), r"^offload_params: needs stage 3.*stage=3"),
     (dict(model_or_num_params=10, stage=0, offload_optimizer="cpu"), r"^offload_optimizer: needs a ZeRO stage"),
     (dict(model_or_num_params=10, offload_optimizer="ssd"), r"^offload_optimizer: unknown offload device 'ssd'")],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(kwargs.pop("model_or_num_params"), **kwargs)


def test_hybrid_sharding_shards_model_states_over_the_group_only():
    """Issue #15: with shard_group_size=k of N ranks each rank holds what flat ZeRO on k ranks holds
    (ZeRO paper, mixed-precision Adam: stage 3 16Ψ/k, stage 2 2Ψ + 14Ψ/k, stage 1 4Ψ + 12Ψ/k)."""
    psi, k = 1_000_000, 2
    for stage, want in ((3, 16 * psi / k), (2, 2 * psi + 14 * psi / k), (1, 4 * psi + 12 * psi / k)):
        est = zs.estimate_memory(psi, world_size=8, stage=stage, precision="bf16", shard_group_size=k)
        assert est.total_device == pytest.approx(want), stage
    via_config = zs.estimate_memory(psi, world_size=8, config=zs.ZeroConfig(stage=3, precision="bf16",
                                                                           shard_group_size=k))
    assert via_config.total_device == pytest.approx(16 * psi / k)
    with pytest.raises(zs.ZeroConfigError, match="shard_group_size"):
        zs.estimate_memory(psi, world_size=8, stage=3, shard_group_size=3)
