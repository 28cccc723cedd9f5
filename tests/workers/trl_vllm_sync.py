"""Online trainers with ``use_vllm=True`` through ``zero_trainer``: what a vLLM engine would receive.

Run under ``accelerate launch`` with 2 CPU processes. vLLM needs a GPU and is not
installed, so the engine is a fake that generates deterministic completions and records
every weight it is sent, with TRL's own code driving it unchanged (``VLLMGeneration`` for
GRPO and RLOO, OnlineDPOTrainer's own push): server mode talks to a fake ``VLLMClient``
(``update_named_params``: metadata, then the stream; the fake keeps every tensor until the
stream ends, as vLLM's packed NCCL producer keeps several), colocate mode to a fake
``LLM`` (``...model.load_weights([(name, tensor)])`` on every process). Only the names
``trl.generation.vllm_generation`` and TRL's online-DPO module import from vLLM are
replaced, inside this worker.

Each case trains a tiny Llama for 2 steps (a sync before each generation) and then syncs
once more by hand. Reported per case: every sync's received tensors compared with the
stock trainer on DDP fed the same completions (and both runs' losses and rewards), the
last sync compared with ``zs.full_state_dict(model)``, the most stage-3 units gathered at
once while the engine received, whether a tensor changed while the engine held it, and
what TRL's own code would have sent at stage 3 (the placeholders).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

from _worker import finish, worst_rel_diff
from zero_strategy.transformers import zero_trainer  # before any TrainingArguments (see its module note)

import datasets  # noqa: E402
import trl.experimental.online_dpo.online_dpo_trainer as online_dpo_trainer  # noqa: E402
import trl.generation.vllm_generation as vllm_generation  # noqa: E402
from accelerate_trl import WORDS, make_model, sentences, tokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer  # noqa: E402

import zero_strategy as zs  # noqa: E402

ZERO3 = {"stage": 3, "param_persistence_threshold": 0}
TOKENIZER = tokenizer()


class FakeEngine:
    """What vLLM would receive, sync by sync, and deterministic completions to train on."""

    def __init__(self):
        self.syncs: list[dict[str, torch.Tensor]] = []
        self.receiving: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.changed_after_handover: list[str] = []  # tensors whose values changed while the engine held them
        self.max_gathered_units = 0  # stage-3 units gathered at once while a tensor arrived
        self.model = None  # set once the trainer is built: the model whose engine is watched
        self.calls = 0

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        if self.model is not None and zs.is_set_up(self.model):
            engine = zs.api._engine_of(self.model)
            gathered = sum(1 for u in engine.units if u.sharded_groups and u.state.value == "gathered")
            self.max_gathered_units = max(self.max_gathered_units, gathered)
        # kept as handed over, as vLLM's packed producer keeps several: must stay valid after its unit is
        # released; the copy taken now is what a consumer that reads at once would get
        self.receiving[name] = (tensor, tensor.detach().clone())

    def end_sync(self) -> None:
        self.syncs.append({k: now for k, (_, now) in self.receiving.items()})
        self.changed_after_handover += [k for k, (held, now) in self.receiving.items()
                                        if not torch.equal(held, now)]
        self.receiving = {}

    def completion(self, prompt: list[int], k: int) -> list[int]:
        """4 tokens drawn from the prompt, the copy k and the call count; the same in every run."""
        g = torch.Generator().manual_seed(sum(prompt) * 1009 + k * 101 + self.calls)
        return [3 + int(i) for i in torch.randint(0, len(WORDS), (4,), generator=g)]


ENGINE = FakeEngine()


class FakeVLLMClient:
    """``trl.generation.vllm_client.VLLMClient``'s surface that GRPOTrainer uses, in process."""

    def __init__(self, *args, **kwargs):
        pass

    def init_communicator(self, device=None):
        pass

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def update_named_params(self, metadata, named_params):
        received = []
        for name, tensor in named_params:
            ENGINE.receive(name, tensor)
            received.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)))
        assert [tuple(m) for m in metadata] == received, "the stream differs from the metadata sent before it"
        ENGINE.end_sync()

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, n=1, **kwargs):
        completions = [ENGINE.completion(p, k) for p in prompts for k in range(n)]
        ENGINE.calls += 1
        return {"prompt_ids": prompts, "completion_ids": completions,
                "logprobs": [[[-1.0] for _ in c] for c in completions]}


class FakeLLM:
    """``vllm.LLM`` in colocate mode: ``llm_engine...model.load_weights`` and ``generate``."""

    def __init__(self, **kwargs):
        model = types.SimpleNamespace(load_weights=lambda weights: [ENGINE.receive(n, t) for n, t in weights])
        runner = types.SimpleNamespace(model=model)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner)))

    def reset_prefix_cache(self):
        ENGINE.end_sync()  # the last call of sync_weights in colocate mode

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        """VLLMGeneration sends token ids (``n=1`` per copy), OnlineDPOTrainer texts (``n=2``)."""
        n = getattr(sampling_params, "n", 1)
        outs = []
        for k, p in enumerate(prompts):
            prompt_ids = p["prompt_token_ids"] if isinstance(p, dict) else TOKENIZER(p)["input_ids"]
            completions = []
            for j in range(n):
                ids = ENGINE.completion(prompt_ids, k * n + j)
                lps = [{t: types.SimpleNamespace(logprob=-1.0, rank=1)} for t in ids]
                completions.append(types.SimpleNamespace(token_ids=ids, logprobs=lps))
            outs.append(types.SimpleNamespace(prompt_token_ids=prompt_ids, outputs=completions))
        ENGINE.calls += 1
        return outs


def fake_vllm() -> None:
    for module in (vllm_generation, online_dpo_trainer):
        module.is_vllm_available = lambda: True
        module.VLLMClient = FakeVLLMClient
        module.LLM = FakeLLM
        module.SamplingParams = types.SimpleNamespace  # vllm.SamplingParams(**kwargs): read by attribute


def even_tokens(completions, **kwargs) -> list[float]:
    """A rule-based reward: the share of words with an even index."""
    def even(word: str) -> bool:
        return word[1:].isdigit() and int(word[1:]) % 2 == 0

    return [sum(map(even, c.split())) / max(1, len(c.split())) for c in completions]


def prompts() -> datasets.Dataset:
    texts = sentences(torch.Generator().manual_seed(3), 16, 2, 5)
    return datasets.Dataset.from_dict({"prompt": [t + " " for t in texts]})  # ends on a token boundary


# the mean reward each trainer logs per step: GRPO's and RLOO's "reward", OnlineDPOTrainer's
# "objective/scores" (it logs no "reward"; a comparison of that key alone compared two empty lists)
REWARD_KEYS = ("reward", "objective/scores")


def run(which: str, kind: str, mode: str, zero_config, out: Path, lora: bool) -> dict:
    """``kind``: "grpo", "rloo" or "odpo" (OnlineDPOTrainer, which pushes weights with its own method)."""
    global ENGINE
    ENGINE = FakeEngine()
    common = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True,
                  dataloader_num_workers=0, bf16=False, use_vllm=True, vllm_mode=mode)
    online = dict(num_generations=2, max_completion_length=4, beta=0.0)
    if kind == "rloo":
        args, trainer_cls = RLOOConfig(**common, **online), RLOOTrainer
    elif kind == "odpo":
        args, trainer_cls = OnlineDPOConfig(**common, max_new_tokens=4), OnlineDPOTrainer
    else:  # the fake engine's logprobs are not the policy's: no importance-sampling correction
        args, trainer_cls = GRPOConfig(**common, **online, vllm_importance_sampling_correction=False), GRPOTrainer
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 init_lora_weights=False)  # B != 0: the merged weights differ from the base ones
    cls = zero_trainer(trainer_cls) if which == "zero" else trainer_cls
    extra = {"zero_config": zero_config} if which == "zero" else {}
    torch.manual_seed(1)  # the LoRA matrices are drawn when the trainer wraps the model
    trainer = cls(model=make_model(), reward_funcs=even_tokens, args=args, train_dataset=prompts(),
                  processing_class=tokenizer(), peft_config=peft_config, **extra)
    model = trainer.model
    ENGINE.model = model
    trainer.train()
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        generation.sync_weights()  # by hand, after the last step
    else:
        trainer._move_model_to_vllm()
    logs = trainer.state.log_history
    r = {"trainer": type(trainer).__name__, "wrapped": type(trainer.model_wrapped).__name__,
         "generation": type(generation).__name__, "syncs": ENGINE.syncs,
         "max_gathered_units": ENGINE.max_gathered_units, "changed_after_handover": ENGINE.changed_after_handover,
         "rewards": [h[k] for h in logs for k in REWARD_KEYS if k in h],
         "losses": [h["loss"] for h in logs if "loss" in h]}
    if which == "zero":
        r["stage"] = trainer.accelerator.zero_config.stage
        r["sharded"] = zs.is_set_up(model) and zs.api._engine_of(model).plan.shards_parameters
        r["full"] = zs.full_state_dict(model)
        # what TRL's own code reads at stage 3 (no DeepSpeed, no FSDP detected): the placeholders
        if generation is not None:
            stock = vllm_generation.VLLMGeneration._iter_named_params(generation)
        else:
            stock = model.named_parameters()  # OnlineDPOTrainer's push: param.data of each
        r["stock_iterator_nan"] = any(bool(t.data.isnan().any()) for _, t in stock)
    return r


def compare(zero: dict, ref: dict, lora: bool) -> dict:
    report = {k: zero[k] for k in ("trainer", "generation", "stage", "sharded", "max_gathered_units",
                                   "stock_iterator_nan")}
    report["ref_wrapped"] = ref["wrapped"]
    report["changed_after_handover"] = (zero["changed_after_handover"], ref["changed_after_handover"])
    report["rewards"] = (zero["rewards"], ref["rewards"])
    report["losses"] = (zero["losses"], ref["losses"])
    report["receives"] = bool(ref["syncs"])  # server mode: only the main process holds a client
    if not report["receives"]:
        return report
    report["n_syncs"] = (len(zero["syncs"]), len(ref["syncs"]))
    report["names_equal"] = all(sorted(a) == sorted(b) and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
                                                            for k in a)
                                for a, b in zip(zero["syncs"], ref["syncs"]))
    report["names"] = sorted(ref["syncs"][0])
    report["any_nan"] = any(bool(t.isnan().any()) for s in zero["syncs"] for t in s.values())
    report["vs_ddp_rel"] = [worst_rel_diff(a, b)[0] for a, b in zip(zero["syncs"], ref["syncs"])]
    first, last = zero["syncs"][0], zero["syncs"][-1]
    report["weights_moved"] = worst_rel_diff(first, last)[0]
    if not lora:  # without adapters the names are the model's own: the last sync is the full state
        full = zero["full"]
        report["last_vs_full_state_dict"] = max(float((t - full[n]).abs().max()) for n, t in last.items())
        report["covers_every_weight"] = sorted(last) == sorted(n for n, _ in make_model().named_parameters())
    return report


def main() -> None:
    out = Path(sys.argv[1])
    import json

    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    fake_vllm()
    configs = {"zero3": ZERO3, "zero2": "zero2"}
    report, refs = {}, {}
    for case in args["cases"]:  # "<stage>[_<kind>][_lora]_<mode>": "zero3_server", "zero3_rloo_colocate", ...
        stage, *rest = case.split("_")
        mode, lora = rest[-1], "lora" in rest
        kind = next((k for k in ("rloo", "odpo") if k in rest), "grpo")
        try:
            key = (kind, mode, lora)
            if key not in refs:
                refs[key] = run("ref", kind, mode, None, out / "ref_{}_{}_{}".format(*key), lora)
            zero = run("zero", kind, mode, configs[stage], out / case, lora)
            report[case] = compare(zero, refs[key], lora)
        except Exception:  # noqa: BLE001 - reported to the test; the ranks stop together
            import traceback

            report[case] = {"error": traceback.format_exc()}
            print(report[case]["error"], file=sys.stderr)
            break
    finish(out, report)


if __name__ == "__main__":
    main()
