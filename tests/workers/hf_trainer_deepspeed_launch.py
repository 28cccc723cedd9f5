"""A Hugging Face ``Trainer`` script launched with a DeepSpeed user's accelerate config.

``front`` (args.json): ``zero`` adds the one import a DeepSpeed user adds,
``from zero_strategy.transformers import zero_trainer`` (before ``TrainingArguments``), and
trains ``zero_trainer(Trainer)``; ``stock`` is the same script with the stock ``Trainer``
under the shipped MULTI_GPU CPU config (DDP), the oracle. The ZeRO config comes from the
launch's ds_config; everything else from the ``TrainingArguments``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _worker import finish  # noqa: E402

ARGS = json.loads((Path(sys.argv[1]) / "args.json").read_text())
if ARGS["front"] == "zero":
    from zero_strategy.transformers import zero_trainer  # noqa: E402 - the one change, before TrainingArguments

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402

VOCAB, SEQ, EXAMPLES = 64, 16, 16


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=g)
    ds = [{"input_ids": t, "labels": t} for t in ids]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    args = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        save_strategy="no", logging_steps=1, learning_rate=3e-3, max_grad_norm=0.5, report_to=[], seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer_cls = zero_trainer(Trainer) if ARGS["front"] == "zero" else Trainer
    trainer = trainer_cls(model=model, args=args, train_dataset=ds)
    trainer.train()
    acc = trainer.accelerator
    zero = getattr(acc, "zero_config", None)
    state = zs.full_state_dict(trainer.model) if zero is not None else trainer.model.state_dict()
    finish(out, {
        "num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type),
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "weights": torch.cat([v.detach().float().flatten() for _, v in sorted(state.items())]).tolist(),
        "zero_config": None if zero is None else {"stage": zero.stage, "gradient_clipping": zero.gradient_clipping,
                                                  "precision": zero.precision},
    })


if __name__ == "__main__":
    main()
