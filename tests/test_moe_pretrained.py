"""Mixture-of-experts checkpoints as transformers 5 ships them load sharded, train, and save back.

transformers saves one tensor per expert (``experts.3.w1.weight``) and fuses them at load
into ``experts.gate_up_proj`` / ``down_proj`` through its weight converters.
``zero_strategy.transformers.from_pretrained`` runs those same converters on where the values
come from, so each rank reads only the rows its shards hold. Three families that
transformers maps differently (Mixtral: ``w1``/``w3``/``w2`` under ``block_sparse_moe``;
Qwen3-MoE: ``gate_proj``/``up_proj``/``down_proj``; DeepSeek-V3: the same plus shared experts,
MLA attention, a first dense layer and an fp32 router), built tiny from their configs and
saved by transformers, on 2 ranks at stages 1 and 3, each against transformers' own
``from_pretrained`` of the same directory (tests/workers/moe_pretrained.py):

* logits equal transformers' load, before training;
* no rank reads more than its shards' bytes plus one checkpoint tensor;
* two AdamW steps, each rank on half the batch, equal one process on the whole batch;
* ``save_pretrained`` writes what transformers writes for the same trained model (the same
  per-expert names, shapes and values), at stage 3 unit by unit (no whole state dict), and
  transformers reads it back equal to the trained weights;
* DeepSeek-V3 in bf16: its router weight stays fp32 (``_keep_in_fp32_modules_strict``), in the
  forward and in the logits, as transformers keeps it.

What cannot be read in slices is refused by name, with the fix, before anything is read: a
checkpoint quantized on disk (gpt-oss's MXFP4) and a converter that computes values or casts.
Every kind of operation transformers' conversion mapping uses is tried through its own
``WeightConverter``: read in slices, it gives what the converter gives on the values, or it is
refused by name (Inkling2's cast of the unembedding to the parameter's dtype, Inkling2-Loop's
dequantization of its experts); a kind the mapping adds later fails the test until it is tried.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _launch import launch_cases  # noqa: E402

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]
TOL = 1e-5  # fp32, absolute, on weights and logits of magnitude ~1


def _config(family: str):
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    if family == "mixtral":
        return transformers.MixtralConfig(**small, intermediate_size=48, num_key_value_heads=2,
                                          num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**small, intermediate_size=48, moe_intermediate_size=24,
                                           num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=8)
    return transformers.DeepseekV3Config(**small, intermediate_size=48, moe_intermediate_size=24,
                                         first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=4,
                                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                         q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                         v_head_dim=8)


def _save(directory, family: str) -> str:
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros at init, the routing's own bias once trained
            buf.copy_(torch.randn(buf.shape))
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    dirs = {f: _save(root / f, f) for f in FAMILIES}
    cases = [dict(case=f"{f}-{stage}", dir=dirs[f], stage=stage, saved=str(root / f"saved-{f}-{stage}"),
                  saved_ref=str(root / f"ref-{f}-{stage}")) for f in FAMILIES for stage in (1, 3)]
    cases.append(dict(case="deepseek_v3-bf16", dir=dirs["deepseek_v3"], stage=3, dtype="bfloat16", train=False))
    return root, dirs, launch_cases("moe_pretrained.py", 2, cases, key=lambda r: r["case"], timeout=420)


def _tensors(directory) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


CASES = [f"{f}-{stage}" for f in FAMILIES for stage in (1, 3)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_loads_with_transformers_logits(launched, case):
    for r in launched[2].of(case):
        assert r["logit_diff"] < TOL, r


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_each_rank_reads_its_share_and_at_most_one_tensor_more(launched, case):
    _, dirs, results = launched
    directory = dirs[case.rsplit("-", 1)[0]]
    sizes = {k: t.numel() * t.element_size() for k, t in _tensors(__import__("pathlib").Path(directory)).items()}
    reports = results.of(case)
    for r in reports:
        assert r["bytes_read"] <= r["own_bytes"] + max(sizes.values()), r
        experts = [k for k in sizes if ".experts.0." in k or ".experts.3." in k]
        assert not set(experts) <= set(r["keys_read"]), "a rank read every expert's tensors"
    assert sum(r["bytes_read"] for r in reports) < 1.1 * sum(sizes.values())


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_trains_as_one_process(launched, case):
    for r in launched[2].of(case):
        for ours, ref in r["losses"]:
            assert ours == pytest.approx(ref, rel=1e-5)
        assert r["weight_diff"] < TOL, r


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_saves_what_transformers_saves_and_reads_back(launched, case):
    root, dirs, results = launched
    reports = results.of(case)
    ours, theirs = _tensors(root / f"saved-{case}"), _tensors(root / f"ref-{case}")
    original = _tensors(__import__("pathlib").Path(dirs[case.rsplit("-", 1)[0]]))
    assert set(ours) == set(theirs) == set(original)  # per-expert names, as the checkpoint had them
    assert any(".experts.3." in k for k in ours)
    for key, want in theirs.items():
        assert ours[key].shape == want.shape and ours[key].dtype == want.dtype, key
        assert (ours[key] - want).abs().max().item() < TOL, key
    assert reports[0]["read_back_diff"] < TOL
    if case.endswith("-3"):  # streamed: one unit at a time, never the whole state dict
        assert not any(r["gathered_whole"] for r in reports)
        index = json.loads((root / f"saved-{case}" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(ours)


@pytest.mark.multiprocess
def test_an_fp32_router_stays_fp32_in_a_bf16_model(launched):
    for r in launched[2].of("deepseek_v3-bf16"):
        assert r["kept"] == {"model.layers.1.mlp.gate.weight": "torch.float32"}
        assert r["kept_in_forward"] == {"model.layers.1.mlp.gate": "torch.float32"}
        assert r["logit_diff"] < 1e-4, r  # (bf16 computes the rest: within one rounding of logits ~1e-2)


# ---------------------------------------------------------------- refusals, one process
def test_weights_quantized_on_disk_are_refused_by_name(tmp_path):
    from zero_strategy.checkpoint import CheckpointError
    from zero_strategy.transformers import from_pretrained

    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"])
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match=r"GptOssConfig \(gpt_oss\).*quantized on disk.*mxfp4.*"
                                              r"Mxfp4Config\(dequantize=True\)"):
        from_pretrained(transformers.AutoModelForCausalLM, tmp_path)


def test_a_converter_that_computes_values_is_refused_by_name(tmp_path):
    """A converter of the model's conversion mapping that scales its tensor (as a dequantization
    does) is named with its operation and the fix, before setup."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import ConversionOps, WeightConverter

    from zero_strategy.checkpoint import CheckpointError
    from zero_strategy.transformers import from_pretrained
    from _models import tiny_llama_config

    class Halve(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            tensor = next(iter(input_dict.values()))[0]
            return {target_patterns[0]: tensor * 0.5}

    class HalvedLlamaForCausalLM(transformers.LlamaForCausalLM):
        pass

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    register_checkpoint_conversion_mapping("HalvedLlamaForCausalLM", [
        WeightConverter(source_patterns="mlp.down_proj.weight", target_patterns="mlp.down_proj.weight",
                        operations=[Halve()])], overwrite=True)
    with pytest.raises(CheckpointError, match=r"HalvedLlamaForCausalLM: model.layers.0.mlp.down_proj.weight "
                                              r"\(transformers' WeightConverter of \['Halve'\].*computes new values"
                                              r".*from_pretrained and then zero_strategy.setup"):
        from_pretrained(HalvedLlamaForCausalLM, tmp_path)


@pytest.mark.parametrize("conversion", ["transpose", "chunk"])
def test_conversions_that_move_the_last_dimension_or_split_a_tensor(tmp_path, conversion):
    """Beyond the expert merges: a converter that transposes (the element ids path: See [Note:
    conversions run on row ids]) and one that splits a fused tensor into several parameters
    (a fused ``qkv``), registered for a model class as a family's mapping would be, saved by
    transformers (which reverts them) and loaded equal to transformers' own load, at stage 3."""
    import zero_strategy as zs
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Chunk, Transpose, WeightConverter

    from zero_strategy.transformers import from_pretrained
    from _models import tiny_llama_config

    name = f"{conversion.capitalize()}dLlamaForCausalLM"
    model_class = type(name, (transformers.LlamaForCausalLM,), {})
    converter = (WeightConverter(source_patterns="mlp.down_proj.weight", target_patterns="mlp.down_proj.weight",
                                 operations=[Transpose(0, 1)]) if conversion == "transpose" else
                 WeightConverter(source_patterns="self_attn.qkv_proj.weight",
                                 target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight"], operations=[Chunk(dim=0)]))
    register_checkpoint_conversion_mapping(name, [converter], overwrite=True)
    config = tiny_llama_config()
    config.num_key_value_heads = config.num_attention_heads  # q, k and v of one size: Chunk's equal thirds
    torch.manual_seed(1)
    model_class(config).save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert any(k.endswith("qkv_proj.weight") for k in keys) == (conversion == "chunk")
    ref = model_class.from_pretrained(tmp_path).eval()
    model, _ = zs.setup(from_pretrained(model_class, tmp_path), None,
                        zs.ZeroConfig(stage=3, param_persistence_threshold=0))
    full = zs.full_state_dict(model)
    for key, want in ref.state_dict().items():
        assert torch.equal(full[key], want), key


@pytest.mark.parametrize("layout", ["merge_experts", "transpose"])
def test_any_range_of_a_converted_parameter_reads_the_values_the_conversion_gives(layout):
    """Every [start, end) of the flattened parameter, read in slices, equals the same range of the
    conversion run on the whole tensors: rows (an expert merge) and elements (a transpose)."""
    from zero_strategy.checkpoint._converted import ConvertedGroup

    class Slice:
        def __init__(self, t):
            self.t = t

        def get_shape(self):
            return list(self.t.shape)

        def get_dtype(self):
            return "F32"

        def __getitem__(self, index):
            return self.t[index]

    torch.manual_seed(2)
    if layout == "merge_experts":
        tensors = {f"e.{i}.{w}": torch.randn(3, 5) for i in range(4) for w in ("w1", "w3")}
        sources = {p: [f"e.{i}.{p}" for i in range(4)] for p in ("w1", "w3")}

        def convert(inputs):
            return {"gate_up": torch.cat([torch.stack(inputs["w1"]), torch.stack(inputs["w3"])], dim=1)}
    else:
        tensors = {"w": torch.randn(6, 4)}
        sources = {"w": ["w"]}

        def convert(inputs):
            return {"wt": inputs["w"][0].t().contiguous()}
    group = ConvertedGroup("test", sources, convert, lambda k: Slice(tensors[k]), lambda d: torch.float32)
    [(name, shape)] = group.targets.items()
    want = convert({p: [tensors[k] for k in keys] for p, keys in sources.items()})[name].reshape(-1)
    assert (group._rows is not None) == (layout == "merge_experts")
    for start in range(0, want.numel(), 7):
        for end in (start + 1, start + 13, want.numel()):
            end = min(end, want.numel())
            assert torch.equal(group.read(name, start, end), want[start:end]), (start, end)


def _every_op_in_the_mapping() -> set[str]:
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return {type(op).__name__ for transforms in _build_checkpoint_conversion_mapping().values()
            for t in transforms or [] if isinstance(t, WeightConverter) for op in t.operations}


def _op_cases():
    """(op, its WeightConverter's patterns, source shapes per pattern, what is expected) for every kind
    of operation transformers' conversion mapping uses, with the arguments the mapping gives it."""
    from transformers import core_model_loading as c

    return {
        "Chunk": ([c.Chunk(dim=0)], ["qkv"], ["q", "k", "v"], {"qkv": [(6, 4)]}, "loads"),
        "Split": ([c.Split(dim=0)], ["qkv"], ["q", "kv"], {"qkv": [(6, 4)]}, "loads"),
        "Concatenate": ([c.MergeModulelist(dim=0), c.Concatenate(dim=1)], ["w1", "w3"], ["gate_up"],
                        {"w1": [(3, 5)] * 4, "w3": [(3, 5)] * 4}, "loads"),
        "MergeModulelist": ([c.MergeModulelist(dim=0)], ["w2"], ["down"], {"w2": [(5, 3)] * 4}, "loads"),
        "Transpose": ([c.Transpose(0, 1)], ["w"], ["wt"], {"w": [(6, 4)]}, "loads"),
        "Interleave": ([c.MergeModulelist(dim=0), c.Concatenate(dim=1), c.Interleave(dim=1)], ["w1", "w3"],
                       ["gate_up"], {"w1": [(3, 5)] * 2, "w3": [(3, 5)] * 2}, "loads"),
        "PermuteForRope": ([c.PermuteForRope()], ["wq"], ["q"], {"wq": [(8, 4)]}, "loads"),
        "ErnieFuseAndSplitTextVisionExperts": ([c.ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)],
                                               ["gate", "up"], ["text", "vision"],
                                               {"gate": [(3, 5)] * 4, "up": [(3, 5)] * 4}, "loads"),
        "Inkling2LoopMergeMessageQueries": ([c.Inkling2LoopMergeMessageQueries()], ["queries", "kv_queries"],
                                            ["query"], {"queries": [(4, 5)], "kv_queries": [(4, 5)]}, "loads"),
        "Inkling2UnpadVocab": ([c.Inkling2UnpadVocab()], ["unembed"], ["lm_head"], {"unembed": [(6, 4)]},
                               "refused: the elements' ids came back as \\['torch.float32'\\]"),
        "Inkling2LoopDequantizeExperts": ([c.Inkling2LoopDequantizeExperts()], ["w", "scale", "amax", "denominator"],
                                          ["gate_up"], {"w": [(2, 3, 32)], "scale": [(2, 3, 1)]},  # MXFP8
                                          "refused: the elements' ids came back as \\['torch.float32'\\]"),
    }


def test_every_kind_of_operation_in_transformers_mapping_loads_in_slices_or_is_refused_by_name():
    """Each operation transformers' conversion mapping uses, run through its own WeightConverter:
    read in slices it gives exactly what the converter gives on the values, or it is refused by
    name (a cast to the parameter's dtype, a dequantization). No kind of operation goes untried."""
    from transformers.core_model_loading import WeightConverter

    from zero_strategy.checkpoint import CheckpointError
    from zero_strategy.checkpoint._converted import ConvertedGroup
    from zero_strategy.transformers._pretrained import _conversion

    cases = _op_cases()
    assert _every_op_in_the_mapping() <= set(cases), "a new kind of operation in transformers' mapping: add it here"

    class Model:  # what the operations ask of the model: its config, a parameter's shape and dtype
        config = transformers.PretrainedConfig(num_attention_heads=2, vocab_size=6, unpadded_vocab_size=5)

        def get_parameter(self, name):
            return torch.empty({"q": (2, 4), "kv": (4, 4)}.get(name, (1,)))

    model = Model()
    torch.manual_seed(3)
    for name, (ops, sources, targets, shapes, expected) in cases.items():
        converter = WeightConverter(source_patterns=sources, target_patterns=targets, operations=ops)
        tensors = {f"{p}.{i}": torch.randn(s) for p, ss in shapes.items() for i, s in enumerate(ss)}
        keys = {p: [f"{p}.{i}" for i in range(len(ss))] for p, ss in shapes.items()}
        slices = {k: _ArraySlice(t) for k, t in tensors.items()}
        convert = _conversion(model, targets[0], converter)
        if expected != "loads":
            with pytest.raises(CheckpointError, match=f"{name}.*{expected.removeprefix('refused: ')}"):
                ConvertedGroup(name, keys, convert, slices.get, lambda d: torch.float32)
            continue
        group = ConvertedGroup(name, keys, convert, slices.get, lambda d: torch.float32)
        want = convert({p: [tensors[k] for k in ks] for p, ks in keys.items()})
        assert set(group.targets) == set(want), name
        for target, values in want.items():
            flat = values.reshape(-1)
            for start in range(0, flat.numel(), 5):
                for end in (start + 1, start + 11, flat.numel()):
                    end = min(end, flat.numel())
                    assert torch.equal(group.read(target, start, end), flat[start:end]), (name, target, start, end)


class _ArraySlice:
    """A safetensors slice over a tensor in memory."""

    def __init__(self, t):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def get_dtype(self):
        return "F32"

    def __getitem__(self, index):
        return self.t[index]
