"""QLoRA under ZeRO: a 4-bit bitsandbytes base plus PEFT LoRA adapters, exact against one process.

A tiny Llama is quantized once by transformers (``BitsAndBytesConfig(load_in_4bit=True)``, NF4 and
FP4, ``bnb_4bit_quant_storage`` bf16 and uint8) and saved; every run loads those same 4-bit bytes,
so the reference and the sharded run share one quantized base. On 2 ranks
(tests/workers/qlora.py), each case against the single-process run of the same directory on the
whole batch:

* losses equal, adapters equal within fp32 rounding after 3 AdamW steps, and they moved (a run
  that silently trains nothing, or at loss 0.0, as FSDP2's QLoRA once did, fails here);
* only the adapters train; the packed base bytes and their quant states are unchanged;
* at stage 3, uint8 storage (bitsandbytes' default) as well as bf16, each rank rests on 1/N of the
  packed bytes (about 0.5/N bytes per base parameter): counted in the flat groups, by
  ``memory_report``, on the parameters (placeholders), and by the garbage collector over every live
  tensor of the storage dtype in the process (no whole copy left anywhere);
* the one-call loader, ``zero_strategy.transformers.from_pretrained(..., quantization_config=...)`` on
  the dense checkpoint, makes the base transformers' own quantizing load makes (codes bit for bit,
  quant states equal) with each rank holding only its slice, and trains as that base does in one
  process, and resumes from ``save_checkpoint`` exactly (uint8 code shards in the checkpoint);
* PEFT's ``save_pretrained`` and ``merge_and_unload``, and ``teardown``, with bf16 and uint8 storage;
* 8-bit bases and unquantized 4-bit weights are refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from _launch import launch_cases  # noqa: E402

pytestmark = pytest.mark.multiprocess

QUANTS = [("nf4", "bfloat16"), ("fp4", "bfloat16"), ("nf4", "uint8"), ("fp4", "uint8")]
CASES = [("nf4", "bfloat16", "zero1"), ("nf4", "bfloat16", "zero2"), ("nf4", "bfloat16", "zero3"),
         ("nf4", "bfloat16", "zero3_offload"), ("fp4", "bfloat16", "zero1"), ("fp4", "bfloat16", "zero3"),
         ("nf4", "uint8", "zero1"), ("nf4", "uint8", "zero3"), ("fp4", "uint8", "zero3"),
         ("nf4", "uint8", "zero3_offload"), ("fp4", "uint8", "zero3_offload")]
LOADED = [("nf4", "uint8", "zero3"), ("fp4", "uint8", "zero3_offload"), ("nf4", "bfloat16", "zero3_offload"),
          ("fp4", "bfloat16", "zero3")]  # through the one-call loader
TOL = 1e-5  # fp32 adapters of magnitude ~0.1-1


def _name(quant, storage, preset) -> str:
    return f"{quant}-{storage}-{preset}"


def _save(root, quant: str, storage: str) -> str:
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    dense = root / "dense"
    if not dense.exists():
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(dense)
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant,
                                        bnb_4bit_compute_dtype=torch.float32,
                                        bnb_4bit_use_double_quant=quant == "nf4",
                                        bnb_4bit_quant_storage=getattr(torch, storage))
    model = transformers.AutoModelForCausalLM.from_pretrained(dense, quantization_config=q, device_map="cpu",
                                                              dtype=torch.float32)
    out = root / f"{quant}-{storage}"
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    return root, {qs: _save(root, *qs) for qs in QUANTS}


@pytest.fixture(scope="module")
def launched(saved):
    root, dirs = saved
    cases = [dict(case=_name(*c), dir=dirs[c[:2]], preset=c[2]) for c in CASES]
    for c in cases:  # the user's PEFT calls after training, where the base is sharded
        if c["case"] in (_name("nf4", "bfloat16", "zero3"), _name("nf4", "uint8", "zero3")):
            c.update(seams=True, saved=str(root / f"adapter-{c['case']}"))
    cases.append(dict(case="kbit-nf4-bfloat16-zero3", dir=dirs[("nf4", "bfloat16")], preset="zero3", kbit=True))
    cases += [dict(case=f"teardown-nf4-{storage}-zero3", dir=dirs[("nf4", storage)], preset="zero3", teardown=True)
              for storage in ("bfloat16", "uint8")]
    cases += [dict(case=f"load-{_name(*c)}", dense=str(root / "dense"), quant=c[0], storage=c[1], preset=c[2],
                   loader=True) for c in LOADED]
    cases[-len(LOADED)].update(resume=True, checkpoint=str(root / "checkpoint"))  # LOADED[0]: uint8 at zero3
    cases += [dict(case="refuse-int8", refuse="int8"), dict(case="refuse-unquantized", refuse="unquantized")]
    return launch_cases("qlora.py", 2, cases, key=lambda r: r["case"], timeout=600)


@pytest.mark.parametrize("case", [_name(*c) for c in CASES] + ["kbit-nf4-bfloat16-zero3"])
def test_qlora_trains_exactly_as_one_process(launched, case):
    for r in launched.of(case):
        assert r["adapter_names"] and r["only_lora_trains"], r
        assert r["adapter_moved"] > 1e-3, f"adapters did not train: {r['adapter_moved']}"
        assert all(l > 0.5 for l in r["losses"]), r["losses"]
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < TOL, (r["losses"], r["ref_losses"])
        assert r["adapter_diff"] < TOL, r["adapter_diff"]
        assert r["base_equal"] and r["base_keys"] > 0, r


@pytest.mark.parametrize("storage", ["bfloat16", "uint8"])
@pytest.mark.parametrize("quant", ["nf4", "fp4"])
def test_stage3_shards_the_packed_base(launched, quant, storage):
    """Each rank rests on its 1/N of the packed bytes, about 0.5/N bytes per base parameter, whatever the
    storage dtype: in the engine's shards, and among all the live tensors of the process."""
    presets = [c[2] for c in CASES if c[:2] == (quant, storage) and c[2].startswith("zero3")]
    assert presets
    for preset in presets:
        for r in launched.of(_name(quant, storage, preset)):
            m = r["memory"]
            assert m["grouped_numel"] == m["packed_numel"], m
            shard = sum(math.ceil(n / 2) for n in m["group_elems"]) * m["itemsize"]
            assert m["held"] == shard, m
            assert m["packed_numel"] * m["itemsize"] * 2 == m["base_params"], m  # 4 bits per base parameter
            assert m["held"] <= m["base_params"] * 0.5 / 2 + m["group_count"] * m["itemsize"], m
            assert m["param_storage"] < 64 * 14, m  # placeholders: no packed bytes in the parameters at rest
            assert m["report_params"] >= m["held"], m
            # the process itself: its shards, the placeholders and (uint8) the double-quantized absmax, no more
            assert m["live"] <= m["held"] + m["state_bytes"] + m["param_storage"], m
            assert m["live"] < m["base_params"] * 0.5 * 0.6, m  # far from a whole copy (0.5 bytes per parameter)
            assert r["warnings"] == [], r["warnings"]


@pytest.mark.parametrize("storage", ["bfloat16", "uint8"])
def test_peft_save_pretrained_and_merge_on_the_sharded_base(launched, storage):
    """``save_pretrained`` (every rank) writes the trained adapter, which reloads onto a fresh 4-bit base equal
    to the reference's; ``merge_and_unload`` gives the reference's merged logits (PEFT requantizes the merged
    weight into a new ``Params4bit``, which is whole on every rank from then on)."""
    for r in launched.of(_name("nf4", storage, "zero3")):
        seams = r["seams"]
        assert seams["reloaded_names"] and seams["reloaded_diff"] < TOL, seams
        assert seams["merged_diff"] < 1e-4, seams
        assert seams["full_state_dict_keeps_storage"], seams


@pytest.mark.parametrize("storage", ["bfloat16", "uint8"])
def test_teardown_gives_back_the_packed_base_bit_for_bit(launched, storage):
    for r in launched.of(f"teardown-nf4-{storage}-zero3"):
        assert r["equal"] and r["dtypes"] == [f"torch.{storage}"] and r["switch_restored"], r


@pytest.mark.parametrize("case,words", [("refuse-int8", ["8-bit", "load_in_4bit"]),
                                         ("refuse-unquantized", ["not quantized yet", "quantization_config"])])
def test_refusals_name_the_problem_and_the_fix(launched, case, words):
    for r in launched.of(case):
        assert r["error_message"] is not None, "setup accepted it"
        for w in words:
            assert w in r["error_message"], r["error_message"]


@pytest.mark.parametrize("quant,storage,preset", LOADED)
def test_the_one_call_loader_quantizes_each_ranks_slices(launched, quant, storage, preset):
    """``from_pretrained(AutoModelForCausalLM, dense, quantization_config=BitsAndBytesConfig(...))``, PEFT,
    ``setup``: the base equals transformers' quantizing load bit for bit, each rank rests on its half of
    the codes, and training equals single-process QLoRA on transformers' base from the same adapters."""
    for r in launched.of(f"load-{_name(quant, storage, preset)}"):
        assert r["base_equal"] and r["base_keys"] > 0 and r["loaded_in_4bit"], r
        assert r["drawn"], "the adapters were not initialized at setup"
        assert r["adapter_names"] and r["only_lora_trains"] and r["adapter_moved"] > 1e-3, r
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < TOL, (r["losses"], r["ref_losses"])
        assert r["adapter_diff"] < TOL, r["adapter_diff"]
        m = r["memory"]
        assert m["held"] == sum(math.ceil(n / 2) for n in m["group_elems"]) * m["itemsize"], m
        assert m["packed_numel"] * m["itemsize"] * 2 == m["base_params"], m
        assert m["live"] <= m["held"] + m["state_bytes"] + m["param_storage"], m
        assert r["warnings"] == [], r["warnings"]


def test_checkpoint_resume_with_the_uint8_base(launched):
    """``save_checkpoint`` of the trained run (its uint8 code shards among the frozen groups) and
    ``load_checkpoint`` into a fresh run from the loader: adapters and packed base equal, and the next
    step's loss equals the uninterrupted run's."""
    for r in launched.of(f"load-{_name(*LOADED[0])}"):
        resumed = r["resumed"]
        assert resumed["adapters_equal"] and resumed["base_equal"], resumed
        assert resumed["next_loss"] == resumed["again_loss"], resumed


def test_the_one_call_loader_refuses_what_it_does_not_quantize(saved):
    """An 8-bit config and a checkpoint saved already quantized are refused, each naming the way that works."""
    from zero_strategy.checkpoint import CheckpointError
    from zero_strategy.transformers import from_pretrained

    root, dirs = saved
    with pytest.raises(ValueError, match="only 4-bit bitsandbytes bases.*load_in_8bit.*load_in_4bit=True"):
        from_pretrained(transformers.AutoModelForCausalLM, root / "dense",
                        quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(CheckpointError, match="bitsandbytes-quantized.*zero_strategy.setup"):
        from_pretrained(transformers.AutoModelForCausalLM, dirs[("nf4", "bfloat16")])


def test_the_one_call_loader_initializes_adapters_as_peft_does(saved):
    """PEFT builds its adapters on the loader's meta model and initializes nothing; setup (one process)
    initializes them as PEFT would (``lora_B`` zero: the adapted model starts equal to the base), and
    refuses by name DoRA's magnitude (like PiSSA or OLoRA), which is computed from the base weights."""
    from peft import LoraConfig, get_peft_model

    import zero_strategy as zs
    from zero_strategy.transformers import from_pretrained

    root, _ = saved
    model = from_pretrained(transformers.AutoModelForCausalLM, root / "dense", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model, _ = zs.setup(model, None, "zero3")
    lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(lora) == 8
    assert all(not v.any() for k, v in lora.items() if "lora_B" in k)
    assert all(v.abs().max() > 0 and v.abs().max() <= 1 / math.sqrt(64) for k, v in lora.items() if "lora_A" in k)
    zs.teardown(model)

    model = from_pretrained(transformers.AutoModelForCausalLM, root / "dense", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="use_dora=True, which PEFT computes from the base weights.*init_lora_weights"):
        zs.setup(model, None, "zero3")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trl_sft_qlora_recipe_through_zero_trainer_equals_ddp():
    """TRL's QLoRA recipe (4-bit NF4 base, prepare_model_for_kbit_training, SFTTrainer with a LoraConfig)
    through ``zero_trainer(SFTTrainer)`` at stage 3, against the stock SFTTrainer as DDP on 2 processes."""
    pytest.importorskip("trl")
    from _accelerate_launch import accelerate_launch

    reps, _ = accelerate_launch("qlora_trl.py", {}, timeout=400, use_cpu=False)
    for r in reps:
        case = r["sft_qlora"]
        assert "error" not in case, case.get("error")
        zero, ref = case["zero"], case["ref"]
        assert ref["wrapped"] == "DistributedDataParallel" and zero["sharded"]
        assert case["trainable"] and all("lora_" in n for n in case["trainable"]), case["trainable"]
        assert len(zero["losses"]) == 3 and all(l > 0.5 for l in zero["losses"])
        assert zero["losses"] == pytest.approx(ref["losses"], rel=1e-5), (zero["losses"], ref["losses"])
        assert case["weights_rel"] < 1e-5, case["weights_rel"]
        held, whole = zero["packed"]
        assert 0 < held <= whole // 2 + 64, (held, whole)  # this rank rests on half the 4-bit bytes
