"""One small model per case: ``estimate_memory``'s working set, then the engine's measured one.

Per case (stage, precision, offload): the estimate is taken from the model before setup (as
a user would, from the model or its meta-device twin), then two training steps run and
``memory_report(model).peak_working_set`` (peaks since setup: the setup's own one-group
gathers are inside them) is reported beside it, per category.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from _worker import finish, run_cases, start

import zero_strategy as zs

VOCAB, DIM, BLOCKS = 1000, 256, 4


class Block(nn.Module):
    """A residual MLP: two weights of 262,144 elements, above the persistence threshold."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """A root of 512,000 elements (embedding and untied head) around ``blocks`` units."""

    def __init__(self, blocks: int = BLOCKS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def run(case: dict) -> dict:
    torch.manual_seed(0)
    model = Net(case.get("blocks", BLOCKS))
    opt, par = case.get("offload_optimizer"), case.get("offload_params")
    if case.get("nvme_path"):  # "nvme" in a case: one swap directory per launch
        nvme = zs.NVMeOffload(path=case["nvme_path"])
        opt, par = (nvme if opt == "nvme" else opt), (nvme if par == "nvme" else par)
    config = zs.ZeroConfig(stage=case["stage"], precision=case["precision"], offload_optimizer=opt, offload_params=par)
    est = zs.estimate_memory(model, world_size=dist.get_world_size(), config=config, optimizer="adamw", device="cpu")
    model, zopt = zs.setup(model, torch.optim.AdamW(model.parameters()), config)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        # 1 x 4 tokens: every category measured (gathered units, gradient buckets, staging) is sized by the
        # parameters, not the batch, and CPU bf16 matmuls cost in proportion to the tokens (2 x 8 tokens
        # made ~0.25 GFLOP a step of the 4-block model, ~0.1 s at this kind of CPU's bf16 rate)
        tokens = torch.randint(0, VOCAB, (1, 4), generator=g)
        loss = nn.functional.cross_entropy(model(tokens).float().reshape(-1, VOCAB), tokens.reshape(-1))
        zopt.backward(loss)
        zopt.step()
        zopt.zero_grad()
    report = zs.memory_report(model)
    zs.teardown(model)
    return {"case": case["name"], "name": case["name"], "measured": report.peak_working_set,
            "measured_total": report.peak_working_set_bytes,
            "estimate": {"gathered": est.working_set_gathered, "grad_buckets": est.working_set_grad_buckets,
                         "staging": est.working_set_staging}}


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
