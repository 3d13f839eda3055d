"""gpt-oss against transformers' GptOssForCausalLM: the published models' parameter counts, logits and
greedy decoding of a tiny random folder written by transformers (a sequence past the sliding window,
random sinks and biases, a swiglu_limit that clamps, YaRN) through weft's own spec, the sinks'
gradient against a plain softmax with a sink column, the export's key set and values (bit for bit
after a step at a negligible learning rate), and the config fields weft refuses."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

from weft.components.hf import ConversionError, load_hf_into_model, model_args_from_hf_folder, save_hf_model
from weft.layers.attention import sink_attention, window_block_mask, window_causal_mask
from weft.models import spec_for_flavor, spec_for_hf_config
from weft.models.gpt_oss import GPT_OSS_FLAVORS, Transformer
from weft.models.gpt_oss.hf_mapping import hf_config, model_args_from_hf_config

from tests.support.hf_folders import tiny_gpt_oss_hf_folder, tiny_gpt_oss_model
from tests.support.train_runs import run, run_args

# The issue's figures, from transformers 5.24's GptOssConfig(num_hidden_layers=24, num_local_experts=32)
# and (36, 128), vocabulary 201088.
PUBLISHED = {"gpt_oss_20b": 20_914_757_184, "gpt_oss_120b": 116_829_156_672}
TOKENS = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))  # 4 windows of 4


def _hf_model(args):
    config = {k: v for k, v in hf_config(args).items() if k not in ("architectures", "model_type", "torch_dtype")}
    return GptOssForCausalLM(GptOssConfig(**config))


@pytest.mark.parametrize("flavor", sorted(GPT_OSS_FLAVORS))
def test_flavor_counts_match_transformers_and_config_json_reads_back(flavor):
    args = GPT_OSS_FLAVORS[flavor]
    with torch.device("meta"):
        model, hf = spec_for_flavor(flavor).build(args), _hf_model(args)
    ours, theirs = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in hf.parameters())
    assert ours == theirs == PUBLISHED.get(flavor, theirs)
    routed = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    assert model.active_parameters() == theirs - routed + routed * args.top_k // args.n_experts
    assert spec_for_flavor(flavor).block_numel(args) * args.n_layers == ours - 2 * args.vocab_size * args.dim - args.dim
    assert model_args_from_hf_config(hf_config(args)) == args
    assert spec_for_hf_config(hf_config(args)) is spec_for_flavor(flavor)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny transformers folder, its model, and weft's model loaded from it."""
    path = tmp_path_factory.mktemp("gpt_oss") / "hf"
    hf = tiny_gpt_oss_hf_folder(path)
    model = Transformer(model_args_from_hf_folder(path))
    load_hf_into_model(model, path)
    return path, hf, model.eval()


@torch.no_grad()
def test_folder_gives_transformers_logits_and_each_feature_matters(folder):
    path, hf, model = folder
    assert model.args.layer_types == () and model.args.window(0) == 4 and model.args.window(1) is None
    theirs = hf(TOKENS).logits
    assert theirs.abs().max() > 1.0  # a random model, not a near-zero one
    torch.testing.assert_close(model(TOKENS), theirs, rtol=0, atol=1e-5)
    # Each feature changes the logits, so that matching them checks it: a window one longer (the
    # off-by-one some mask libraries have), no clamp, no sinks, no YaRN attention factor.
    core, experts = model.layers["0"].attention.core, model.layers["0"].feed_forward.experts
    for module, attribute, value in [(core, "window", 5), (experts, "limit", 1e9)]:
        kept = getattr(module, attribute)
        setattr(module, attribute, value)
        assert (model(TOKENS) - theirs).abs().max() > 1e-3, attribute
        setattr(module, attribute, kept)
    sinks = core.sinks.clone()
    core.sinks.fill_(-1e4)  # no sinks
    assert (model(TOKENS) - theirs).abs().max() > 1e-3
    core.sinks.copy_(sinks)
    rotations = model.rope_rotations.clone()
    model.rope_rotations.div_(model.rope_rotations.abs())  # unit rotations: YaRN without its attention factor
    assert (model(TOKENS) - theirs).abs().max() > 1e-3
    model.rope_rotations.copy_(rotations)
    torch.testing.assert_close(model(TOKENS), theirs, rtol=0, atol=1e-5)


def test_generate_decodes_the_folder_greedily_as_transformers_does(folder, capsys):
    """40 tokens past the window of 4, routed and clamped, equal to transformers' generate."""
    from tests.support.greedy_decoding import assert_greedy_decoding_equals_transformers

    path, hf, _ = folder
    assert_greedy_decoding_equals_transformers(hf, path, "gpt-oss", 40, 4, capsys)


def _plain_sink_attention(q, k, v, sinks, allowed):
    """transformers' eager formula in plain PyTorch: scores, a sink column per head, softmax, the
    column dropped."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], -1).softmax(-1)[..., :-1] @ v


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sink_attention_and_its_gradient_equal_a_plain_softmax_with_a_sink_column():
    """SDPA with a zero key/value column biased by the sink (the CPU path), in a window of 4 over
    two packed documents: values and the gradients of q, k, v and the sinks; FlexAttention's
    out·σ(lse - sink) (the CUDA path) in forward, which is all FlexAttention does on the CPU."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g)
    sinks = torch.randn(4, generator=g) * 2
    docs = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
    allowed = window_causal_mask(16, 4, docs)
    assert allowed[0, 0, 10].nonzero().flatten().tolist() == [7, 8, 9, 10]  # window and document
    grads = []
    for attend in (lambda *t: sink_attention(*t, allowed), lambda *t: _plain_sink_attention(*t, allowed)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = attend(*inputs)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads.append([out, *(t.grad for t in inputs)])
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert grads[0][4].abs().min() > 1e-4  # every sink has a gradient
    with torch.no_grad():
        flex = sink_attention(q, k, v, sinks, window_block_mask(16, 4, docs, 2, torch.device("cpu")))
    torch.testing.assert_close(flex, grads[1][0].detach(), rtol=0, atol=1e-5)


@torch.no_grad()
def test_export_has_transformers_key_set_and_gives_weft_logits(folder, tmp_path):
    path, _, model = folder
    save_hf_model(model, tmp_path / "round_trip")
    source, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "round_trip" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[key], source[key]) for key in source)  # interleaved gate/up split back
    other = Transformer(model.args)
    other.init_weights(seed=3)  # weft's own weights, exported and read back by transformers
    save_hf_model(other, tmp_path / "export")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").float().eval()
    assert type(theirs) is GptOssForCausalLM
    torch.testing.assert_close(theirs(TOKENS).logits, other.eval()(TOKENS), rtol=0, atol=1e-5)


def test_an_export_after_a_step_at_a_negligible_rate_holds_every_tensor(folder, tmp_path):
    """train.py from the folder (weft's spec), one step at lr 1e-12, exported in float32: every
    tensor of the input, experts and biases included, of its shape and within 1e-6."""
    path, _, _ = folder
    run(run_args(tmp_path / "run", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(path),
                 "--model.backend", "weft", "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-12",
                 "--export.hf_folder", "export", "--no-validation.enable", steps=1, seq_len=32))
    source, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "run" / "export" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert sum(".experts." in key for key in source) == 8  # gate_up, down and their biases, 2 layers
    for key in source:
        torch.testing.assert_close(exported[key], source[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("change", "message"), [
    ({"attention_bias": False}, "attention_bias is False; weft's gpt-oss supports only True"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters.rope_type is llama3; weft's gpt-oss implements default and yarn"),
    ({"layer_types": ["full_attention", "chunked_attention"]},
     "layer_types holds chunked_attention; expected sliding_attention or full_attention"),
    ({"num_experts_per_tok": 9}, "top_k 9 must lie in 1..n_experts (4)"),
])
def test_unrepresentable_config_is_refused_in_one_line_naming_the_field(folder, tmp_path, change, message):
    path, _, _ = folder
    config = json.loads((path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError) as caught:
        model_args_from_hf_folder(tmp_path)
    assert str(caught.value) == f"HF folder {tmp_path}: {message}"


def _mxfp4_by_the_format(blocks, scales):
    """The published MXFP4 format read value by value: byte b of group g holds elements 2b (low
    nibble) and 2b + 1 (high) of the group's 32, each an E2M1 code (sign, 2 exponent bits, 1
    mantissa bit) times 2^(scale - 127); rows are output features, transposed to [in, out]."""
    def e2m1(code):
        sign, exponent, mantissa = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
        return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa * 0.5) * 2.0 ** (exponent - 1))

    lookup = torch.tensor([e2m1(c) for c in range(16)])
    low, high = lookup[(blocks & 15).long()], lookup[(blocks >> 4).long()]
    values = torch.stack([low, high], -1).flatten(-2) * 2.0 ** (scales.double() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(-1, -2).to(torch.bfloat16)


def test_a_hand_built_mxfp4_folder_loads_to_the_dequantized_values(folder, tmp_path, monkeypatch):
    """The folder's experts as published (`*_blocks`, `*_scales`, `quantization_config`): weft's
    experts hold the values the format defines (and transformers' own dequantization gives), in
    bfloat16, each tensor dequantized once (gate_up_proj gives w1 and w3); the export writes the
    bf16 key set."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from weft.components.hf import mxfp4

    path, _, model = folder
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    expected = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        experts, fan_in, fan_out = tensors.pop(key).shape
        blocks = torch.randint(0, 256, (experts, fan_out, fan_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 130, (experts, fan_out, fan_in // 32), generator=g, dtype=torch.uint8)
        tensors |= {f"{key}_blocks": blocks, f"{key}_scales": scales}
        expected[key] = _mxfp4_by_the_format(blocks, scales)
        assert torch.equal(convert_moe_packed_tensors(blocks, scales), expected[key])
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    save_file(tensors, quantized / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router"]}
    (quantized / "config.json").write_text(json.dumps(config))
    loaded, calls = Transformer(model.args), []
    dequantize = mxfp4.dequantize
    monkeypatch.setattr(mxfp4, "dequantize", lambda *a: calls.append(1) or dequantize(*a))
    load_hf_into_model(loaded, quantized)
    assert len(calls) == len(expected) == 4  # gate_up_proj and down_proj of 2 layers
    save_hf_model(loaded, tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(load_file(path / "model.safetensors"))
    for key, values in expected.items():
        assert torch.equal(exported[key].to(torch.bfloat16), values), key
    config["quantization_config"]["quant_method"] = "gptq"
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="quantization_config.quant_method is gptq; weft reads"):
        load_hf_into_model(loaded, quantized)


@pytest.mark.parametrize(("layout", "message"), [
    (["--parallelism.cp", "2"], "model.flavor = debugmodel_gpt_oss: apply_cp: cannot replace layers.0.attention.core "
                                "(SinkAttention): context parallelism supports only the plain causal core"),
], ids=["cp"])
def test_what_the_layouts_cannot_split_is_refused_in_one_line(layout, message, tmp_path, capsys):
    """cp (the sinks and windows need a core of their own); tp with and without ep, fsdp, ep, pp:
    tests/parallelisms/test_llama4_parity.py."""
    from weft import train

    argv = ["--job.config_file", "debug_moe", "--model.flavor", "debugmodel_gpt_oss", "--job.dump_folder",
            str(tmp_path), "--job.dry_run", "--parallelism.dp_shard", "1", *layout]
    assert train.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"weft: error: {message}")


def test_a_stopped_run_resumes_exactly(tmp_path):
    """4 steps straight, or 2, a stop and 2 more from the checkpoint: the same losses, bit for bit."""
    def args(dump):
        return run_args(dump, "--model.flavor", "debugmodel_gpt_oss", "--moe.bias_update_rate", "0.01",
                        "--no-validation.enable", config="debug_moe", steps=4, seq_len=64, checkpoint_every=2)

    straight = run(args(tmp_path / "straight"))
    first = run(args(tmp_path / "resumed"), stop_after=2)
    assert len(first) == 2 and first + run(args(tmp_path / "resumed")) == straight


def test_lora_on_the_experts_exports_a_peft_folder_transformers_loads_with_the_merged_logits(folder, tmp_path):
    """train.py fine-tunes the folder with adapters on wq, wv and the experts, exports the merged model
    and the PEFT folder: PeftModel on the folder's GptOssForCausalLM gives the merged export's logits,
    and so does the PEFT folder read back onto weft's model."""
    from peft import PeftModel

    path, hf, _ = folder
    run(run_args(tmp_path / "run", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(path),
                 "--model.backend", "weft", "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-2",
                 "--lora.enable", "--lora.target_modules", "wq,wv,experts", "--lora.rank", "4",
                 "--export.hf_folder", "merged", "--export.peft_folder", "peft", "--no-validation.enable",
                 steps=3, seq_len=32))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged", attn_implementation="eager").float().eval()
    assert sorted(load_file(tmp_path / "run" / "merged" / "model.safetensors")) == sorted(load_file(path / "model.safetensors"))
    adapter = json.loads((tmp_path / "run" / "peft" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    with torch.no_grad():
        base, theirs = hf(TOKENS).logits, merged(TOKENS).logits
        peft_logits = PeftModel.from_pretrained(tiny_gpt_oss_model(), tmp_path / "run" / "peft").eval()(TOKENS).logits
    assert (theirs - base).abs().max() > 1e-2, "the adapters must change the model"
    torch.testing.assert_close(peft_logits, theirs, rtol=0, atol=1e-5)
    # and read back onto weft's own model (generate.py --adapter): gate and up de-interleaved
    from weft.components.hf.adapters import load_peft_adapter

    ours = Transformer(model_args_from_hf_folder(path))
    load_hf_into_model(ours, path)
    ours = load_peft_adapter(ours, tmp_path / "run" / "peft").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), theirs, rtol=0, atol=1e-5)


def test_qlora_holds_the_experts_in_nf4_learns_and_exports_the_merged_model(tmp_path):
    """QLoRA on the debug flavor (the tiny folder's matrices are smaller than NF4's blocks): the
    experts and linears frozen in NF4, adapters on wq, wv and the experts; the loss falls, and the
    merged export (dequantized base plus adapters) is the bf16 key set transformers loads."""
    losses = run(run_args(tmp_path / "run", "--model.flavor", "debugmodel_gpt_oss", "--lora.enable",
                          "--lora.target_modules", "wq,wv,experts", "--lora.rank", "4", "--lora.quantize_base", "nf4",
                          "--optimizer.lr", "3e-3", "--export.hf_folder", "merged", "--no-validation.enable",
                          "--checkpoint.initial_load_path=", config="debug_moe", steps=3, seq_len=32))
    assert losses[-1] < losses[0]
    exported = load_file(tmp_path / "run" / "merged" / "model.safetensors")
    with torch.device("meta"):
        hf = _hf_model(GPT_OSS_FLAVORS["debugmodel_gpt_oss"])
    assert sorted(exported) == sorted(name for name, _ in hf.named_parameters())
    assert not any(".lora_" in key or "nf4" in key for key in exported)


@torch.no_grad()
def test_packed_documents_see_only_themselves_through_windows_and_sinks(folder):
    """Two documents packed in one row (positions restarting, document ids) give each document's
    logits alone, within 1e-5: the sliding and full masks are block-causal."""
    _, _, model = folder
    first, second = TOKENS[0, :7], TOKENS[1, :9]
    packed = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    documents = torch.tensor([[0] * 7 + [1] * 9])
    logits = model(packed, positions, document_ids=documents)
    torch.testing.assert_close(logits[0, :7], model(first[None])[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[0, 7:], model(second[None])[0], rtol=0, atol=1e-5)


def _published_config(layers: int, experts: int) -> dict:
    """config.json of openai/gpt-oss-20b (24, 32) and -120b (36, 128) as published (transformers 4's
    format, rope_scaling beside rope_theta; the MXFP4 quantization_config)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
        "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": layers, "num_key_value_heads": 8, "num_local_experts": experts,
        "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    }


@pytest.mark.parametrize(("flavor", "layers", "experts"), [("gpt_oss_20b", 24, 32), ("gpt_oss_120b", 36, 128)])
def test_the_published_config_files_read_as_their_flavors(flavor, layers, experts):
    config = _published_config(layers, experts)
    assert model_args_from_hf_config(config) == GPT_OSS_FLAVORS[flavor]
    assert spec_for_hf_config(config) is spec_for_flavor(flavor)
