"""``zero_auto`` picks the least-offloaded preset whose peak (model states + working set) fits, says why, and
fails with how much more memory would make one fit.

Oracle: the ZeRO paper's per-rank model-state bytes written out here by hand for
mixed-precision (bf16) Adam, Ψ parameters, N ranks (P = G = 2 bytes, K = 12: fp32
master 4 + Adam moments 8), plus the working set of the test model (no root, L ≥ 32 units
of u = d² elements each; [Note: the estimated working set]): gradient buckets at stages
2-3, 4 reduce-scatters in flight and the unit in backward, 2(5u + pad) bytes (pad: the
N - 1 elements each of 8 flat groups per unit allowed for padding, 8(L + 1)(N - 1)); at
stage 3 the unit in use and one prefetched gathered, 2(2u + pad); with the optimizer
offloaded the 2-slot cast-upload ring, R = 2 min(64 MiB, 2⌈u/N⌉); with NVMe the slot pool
of (prefetch + 2) + read_ahead + 4 = 8 slots of 64 MiB, 512 MiB, which replaces the resting
staging of the formula (2 policies x 4 x 64 MiB, also 512 MiB). Compared with 75% of the
memory injected through ``AvailableMemory``:

| preset | device | host | NVMe |
|---|---|---|---|
| zero2 | 2Ψ + 14Ψ/N + 2(5u + pad) | 0 | 0 |
| zero3 | 16Ψ/N + 2(7u + 2pad) | 0 | 0 |
| zero2_offload | 2Ψ + 2Ψ/N + 2(5u + pad) | (12 + 4)Ψ/N + R | 0 |
| zero3_offload | 2Ψ/N + 2(7u + 2pad) | (2 + 12 + 4)Ψ/N + R | 0 |
| zero3_offload_nvme | 2Ψ/N + 2(7u + 2pad) | 4Ψ/N + 512 MiB + R | (12 + 2)Ψ/N |

A real run (2 gloo ranks, memory measured) trains exactly as the preset it chose set up
by hand; Lightning's ``strategy="zero_auto"`` trains like that preset under Lightning.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import _procs
from _launch import launch, run_code

import zero_strategy as zs
from zero_strategy import AvailableMemory, choose_preset

GIB = 2**30
STAGING = 2 * 4 * 64 * 2**20


class Stack(nn.Module):
    """``layers`` square bias-free linears: Ψ = layers·d², units of d² elements, no root."""

    def __init__(self, d: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))


def meta_stack(d: int, layers: int) -> nn.Module:
    with torch.device("meta"):
        return Stack(d, layers)


def ring(d2: int, n: int) -> int:
    """The cast-upload ring of an offloaded optimizer: 2 slots of at most 64 MiB."""
    return 2 * min(64 * 2**20, 2 * -(-d2 // n))


def by_formula(psi: int, d2: int, n: int, mem: AvailableMemory) -> str | None:
    pad = 8 * (psi // d2 + 1) * (n - 1)
    buckets, window = 2 * (5 * d2 + pad), 2 * (2 * d2 + pad)
    r = ring(d2, n)
    rows = [("zero2", 2 * psi + 14 * psi / n + buckets, 0, 0),
            ("zero3", 16 * psi / n + window + buckets, 0, 0),
            # host: the optimizer's 12Ψ/N, the bf16 gradient shard's host copy 2Ψ/N (and zero3's parameter shard)
            ("zero2_offload", 2 * psi + 2 * psi / n + buckets, 14 * psi / n + r, 0),
            ("zero3_offload", 2 * psi / n + window + buckets, 16 * psi / n + r, 0),
            ("zero3_offload_nvme", 2 * psi / n + window + buckets, 2 * psi / n + STAGING + r, 14 * psi / n)]
    for name, dev, host, nvme in rows:
        if dev <= 0.75 * mem.device and host <= 0.75 * mem.host and nvme <= 0.75 * mem.nvme:
            return name
    return None


def preset_of(cfg: zs.ZeroConfig) -> str:
    found = [n for n in ("zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_nvme")
             if zs.ZeroConfig.preset(n).replace(precision=cfg.precision) == cfg]
    assert len(found) == 1, cfg
    return found[0]


GRID = [(d, layers, n, dev, host, nvme)
        for d, layers in ((4096, 32), (8192, 80))            # about 0.54 and 5.4 billion parameters
        for n in (1, 8)
        for dev in (8 * GIB, 24 * GIB, 80 * GIB)
        for host in (16 * GIB, 32 * GIB, 256 * GIB)
        for nvme in (0, 4096 * GIB)]


def test_choices_follow_the_zero_formula_and_cover_every_preset():
    seen = set()
    for d, layers, n, dev, host, nvme in GRID:
        mem = AvailableMemory(device=dev, host=host, nvme=nvme)
        expected = by_formula(layers * d * d, d * d, n, mem)
        model = meta_stack(d, layers)
        if expected is None:
            with pytest.raises(MemoryError):
                choose_preset(model, {"preset": "zero_auto", "precision": "bf16"}, world_size=n, available=mem)
        else:
            got = preset_of(choose_preset(model, {"preset": "zero_auto", "precision": "bf16"}, world_size=n,
                                          available=mem))
            assert got == expected, (d, layers, n, dev / GIB, host / GIB, nvme / GIB)
        seen.add(expected)
    assert seen == {"zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_nvme", None}, seen


def test_the_choice_keeps_every_other_field():
    cfg = choose_preset(meta_stack(64, 2), {"preset": "zero_auto", "precision": "bf16", "gradient_clipping": 1.0,
                                            "prefetch": 2}, available=AvailableMemory(None, 64 * GIB, None))
    assert (cfg.precision, cfg.gradient_clipping, cfg.prefetch, cfg.auto) == ("bf16", 1.0, 2, False)


def test_a_cpu_only_run_counts_device_and_host_as_one_pool():
    """Without an accelerator the "device" is host memory: zero2's 16Ψ (N=1, fp32 Adam: 4 + 4 + 8)
    and its gradient buckets (5 of the 8 units in flight or in backward: 4 x 5d²) must fit in 75%
    of the host; zero3 needs the same plus gathered units, so the next choice that fits is
    nothing without NVMe."""
    d = 1024
    psi = d * d * 8  # 8 layers
    need = 16 * psi + 4 * 5 * d * d
    model = meta_stack(d, 8)
    assert preset_of(choose_preset(model, available=AvailableMemory(None, int(need / 0.75) + 1, None))) == "zero2"
    with pytest.raises(MemoryError):
        choose_preset(model, available=AvailableMemory(None, int(need / 0.75) - 1, None))


def test_when_nothing_fits_the_error_says_how_much_more_memory_would():
    d, layers, n = 8192, 80, 1
    psi = layers * d * d
    mem = AvailableMemory(device=80 * GIB, host=16 * GIB, nvme=50 * GIB)
    with pytest.raises(MemoryError) as info:
        choose_preset(meta_stack(d, layers), {"preset": "zero_auto", "precision": "bf16"}, world_size=n,
                      available=mem)
    text = str(info.value)
    r = ring(d * d, n)
    host_cpu = (16 * psi / n + r) / 0.75 - mem.host       # zero3_offload's host shortfall
    nvme_more = 14 * psi / n / 0.75 - mem.nvme            # zero3_offload_nvme's NVMe shortfall
    assert (2 * psi / n + STAGING + r) / 0.75 <= mem.host  # zero3_offload_nvme's host side fits
    assert f"zero3_offload would fit with {host_cpu / GIB:.2f} GiB more host memory per rank" in text, text
    assert f"zero3_offload_nvme would fit with {nvme_more / GIB:.2f} GiB more NVMe space per rank" in text, text
    assert "zero3_offload_nvme" in text.splitlines()[-2] and "no" in text.splitlines()[-2]  # the table is shown


def test_the_table_and_the_choice_are_logged(caplog):
    with caplog.at_level("INFO", logger="zero_strategy"):
        choose_preset(meta_stack(64, 2), available=AvailableMemory(None, 64 * GIB, None))
    text = caplog.text
    assert "zero_auto chose zero2" in text
    assert all(re.search(rf"{name}\s", text) for name in ("zero2", "zero3", "zero2_offload", "zero3_offload"))


def test_zero_auto_refuses_an_offload_given_with_it():
    with pytest.raises(zs.ZeroConfigError, match="zero_auto chooses the offload"):
        zs.ZeroConfig.from_dict({"preset": "zero_auto", "offload_optimizer": "cpu"})


def test_setup_with_injected_memory_trains_as_the_chosen_preset_by_hand(monkeypatch):
    """Injected device memory (through the measurement seam) between zero2_offload's and zero2's
    needs: setup picks zero2_offload, and the run equals zero2_offload set up by hand, exactly.
    fp32 Adam, N = 1 (P = G = 4, K = 8): zero2 needs 16Ψ + 4Ψf on the device and 4Ψ of gradient
    buckets (the TinyLM's few units are all in flight at once), zero2_offload 4Ψ + 4Ψ + 4Ψf (the
    gradient shard stays; master and moments go to the host) and the same buckets, zero3 more
    than zero2 here (its shards are whole on one rank, plus the gathered units)."""
    from _models import TinyLM, batch, loss_fn, param_groups
    from zero_strategy import _zero_auto as _auto
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    psi, psi_f = zs.estimate.count_parameters(base)
    device = int((16 * psi + 4 * psi_f) / 0.75)  # between 12Ψ + 4Ψf and 20Ψ + 4Ψf after the 25% headroom
    monkeypatch.setattr(_auto, "measure_available",
                        lambda comm, dev, config: AvailableMemory(device=device, host=64 * GIB, nvme=None))
    import copy
    runs = {}
    for spec in ("zero_auto", "zero2_offload"):
        model = copy.deepcopy(base)
        model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), spec)
        runs[spec] = [preset_of(zs.engine_of(model).config)]
        for step in range(3):
            tokens, targets = batch(0, step, 0)
            loss = loss_fn(model(tokens), targets)
            zopt.backward(loss)
            zopt.step()
            zopt.zero_grad()
            runs[spec].append(loss.item())
        runs[spec].append(zs.full_state_dict(model))
        zs.teardown(model)
    assert runs["zero_auto"][0] == "zero2_offload"
    assert runs["zero_auto"][1:4] == runs["zero2_offload"][1:4]
    for name, t in runs["zero2_offload"][4].items():
        assert torch.equal(runs["zero_auto"][4][name], t), name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_measure_agree_and_train_as_the_preset_by_hand():
    reports = launch("zero_auto.py", 2, {}, timeout=180)
    assert reports[0]["chosen"] == reports[1]["chosen"]
    for rep in reports:
        assert not rep["auto_flag_left"]
        assert rep["losses_auto"] == pytest.approx(rep["losses_hand"], rel=1e-6)
        assert rep["weight_rel_diff"] <= 1e-6, rep["worst"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lightning_strategy_name_zero_auto_trains_as_the_preset_it_chose(tmp_path):
    pytest.importorskip("lightning")
    # the TinyLM's model states are a few hundred KiB: every machine that runs this suite fits zero2
    assert preset_of(choose_preset(__import__("_models").TinyLM(layers=2))) == "zero2"
    cases = [dict(name=n, strategy=n, save_dir=str(tmp_path), epochs=1) for n in ("zero_auto", "zero2", "ddp")]
    reports = launch("lightning_trainer.py", 2, {"cases": cases}, timeout=240)
    for rank, rep in enumerate(reports):
        for name in ("zero_auto", "zero2"):
            assert "error" not in rep[name], f"rank {rank}: {rep[name].get('trace')}"
        assert rep["zero_auto"]["losses"] == pytest.approx(rep["zero2"]["losses"], rel=1e-6)
        assert rep["zero_auto"]["losses"] == pytest.approx(rep["ddp"]["losses"], rel=1e-5)
    auto, hand = torch.load(tmp_path / "zero_auto.pt"), torch.load(tmp_path / "zero2.pt")
    assert all(torch.equal(auto[k], hand[k]) for k in hand)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_accelerate_zero_auto_resolves_at_prepare(tmp_path):
    """``ZeroAccelerator("zero_auto")`` in one process of its own (no launcher): after prepare its
    ``zero_config`` is the chosen preset, the one ``choose_preset`` names."""
    pytest.importorskip("accelerate")
    code = ("import torch, zero_strategy as zs; from zero_strategy.accelerate import ZeroAccelerator; "
            "from _models import TinyLM; acc = ZeroAccelerator('zero_auto'); m = TinyLM(layers=2); "
            "o = torch.optim.AdamW(m.parameters()); m, o = acc.prepare(m, o); "
            "print(acc.zero_config.stage, acc.zero_config.auto, zs.engine_of(m).config.stage)")
    env = _procs.child_env(drop=("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZERO_STRATEGY_CONFIG"))
    returncode, stdout, log = run_code(code, tmp_path, env, 120)  # warm: Accelerate's state starts empty there
    assert returncode == 0, log[-3000:]
    assert stdout.split()[-3:] == ["2", "False", "2"], stdout
