"""transformers' causal LMs beyond tests/recipe/test_hf_backend.py's six, tiny folders written by
transformers: Gemma 4 text (per-layer head widths), DeepSeek V4 (renamed tensors, w1/w2/w3 experts),
DeepSeek V3.2 (sparse attention), Qwen3-Next and Kimi Linear (linear attention; Kimi's q/k/v
convolutions joined on load), Granite 4 hybrid and Bamba (Mamba layers), OLMo 2, Phi-3, Gemma 2
(soft-capping), Qwen2 (biases), BioGPT (tied `output_projection`), GPT-NeoX (`embed_out`), BART's
decoder, CPM-Ant (a tie flag tying nothing). Each decodes greedily as transformers does (not CPM-Ant:
below); a 2-step run's export reloads in transformers with the folder's keys, the checkpoint's
weights and weft's logits of them. Packed samples, cp and pp are refused where a convolution along
the sequence lets documents see each other; so are families transformers computes two ways (Moshi,
Youtu); MFU's FLOPs are torch's count (Gemma 4, Hunyuan's moe_topk)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weft import generate
from weft.components.config import ConfigError, parse_args
from weft.components.config.shipped import SHIPPED_TOKENIZER
from weft.components.data import load_tokenizer
from weft.recipe.plan import RunPlan

from tests.support.train_runs import run, run_args

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DECODER = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
EXPERTS = dict(moe_intermediate_size=16, num_experts_per_tok=2)
CONFIGS = {
    # a sliding layer (window 8, shorter than the samples) then a global one of another head width
    "gemma4_text": lambda: transformers.Gemma4TextConfig(
        **SHAPE, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=2048, per_layer_config={"1": {"head_dim": 16}}),
    # its folder's names differ from the modules' (attn, ffn, w1/w2/w3): transformers renames and stacks on load
    "deepseek_v4": lambda: transformers.DeepseekV4Config(
        **{**SHAPE, **EXPERTS}, n_routed_experts=4, n_shared_experts=1, q_lora_rank=16, o_lora_rank=8,
        o_groups=2, index_head_dim=16, index_n_heads=2, index_topk=4),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **{**SHAPE, **EXPERTS}, num_experts=4, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        shared_expert_intermediate_size=16),
    # a Kimi delta-attention layer, then an MLA layer with experts (grouped sigmoid routing, a shared expert)
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        **{**SHAPE, "moe_intermediate_size": 16, "num_key_value_heads": 4}, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        linear_num_heads=4, linear_head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    # a Mamba 2 layer, then an attention layer; experts (top 2 of 4) and a shared MLP in each
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16),
    # a Mamba 2 layer then an attention layer, without layer_types (attn_layer_indices)
    "bamba": lambda: transformers.BambaConfig(**SHAPE, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                                              mamba_d_state=16, mamba_chunk_size=16),
    "olmo2": lambda: transformers.Olmo2Config(**SHAPE),
    "phi3": lambda: transformers.Phi3Config(**SHAPE),
    "gemma2": lambda: transformers.Gemma2Config(**SHAPE, sliding_window=8,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),  # q, k and v with biases
    # tied embeddings whose output is not lm_head (output_projection), and a tie flag that ties nothing
    "biogpt": lambda: transformers.BioGptConfig(**{k: SHAPE[k] for k in DECODER}),
    # GPT-NeoX: its folder names the head embed_out (transformers renames it for GPTNeoXForCausalLM only)
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**{k: SHAPE[k] for k in DECODER}, rotary_pct=0.5),
    # MLA with DeepSeek sparse attention: the indexer keeps 4 of the up to 16 keys a query sees. Its 4
    # indexer heads: with 2, several keys' index scores are exactly 0 (a ReLU per head, summed), ties
    # torch's top-k breaks one way in transformers' cached generate and another in its forward
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **{**SHAPE, **EXPERTS, "num_key_value_heads": 4}, n_routed_experts=4, n_shared_experts=1, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, index_n_heads=4, index_head_dim=16, index_topk=4),
    # BART's decoder as a causal LM: learned positions (offset 2), an embedding LayerNorm, unused
    # cross-attention weights; transformers' generate forces EOS as the last token (forced_eos_token_id)
    "bart": lambda: transformers.BartConfig(
        vocab_size=2048, d_model=32, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
        encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, forced_eos_token_id=2),
    "cpmant": lambda: transformers.CpmAntConfig(vocab_size=2048, hidden_size=32, num_attention_heads=4, dim_head=8,
                                                dim_ff=64, num_hidden_layers=2, position_bias_num_buckets=32),
}
# CPM-Ant's generate (with its cache) gives other tokens than its own forward without a cache, which
# weft's decoding calls: transformers' two paths differ, so only its export is checked.
DECODED = [family for family in CONFIGS if family != "cpmant"]
FP32 = ("--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3")
TOKENS = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))


def tiny_folder(folder: Path, family: str) -> Path:
    """A randomly initialised transformers model of `family` (every bias drawn too), saved as a folder."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_families")


@pytest.fixture(scope="module")
def folder(root):
    """Each family's folder, written when first asked for."""
    def of(family: str) -> Path:
        return root / family if (root / family).is_dir() else tiny_folder(root / family, family)
    return of


@pytest.mark.parametrize("family", DECODED)
def test_generate_decodes_greedily_as_transformers(folder, family, capsys):
    prompt = "ROMEO: But, soft!"
    assert generate.main(["--hf", str(folder(family)), "--backend", "transformers", "--prompt", prompt,
                          "--max-new-tokens", "8"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    tokenizer = load_tokenizer(str(SHIPPED_TOKENIZER))
    ids = tokenizer.encode(prompt, bos=True, eos=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder(family)).eval()
    out = theirs.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_id,
                          pad_token_id=tokenizer.eos_id, forced_eos_token_id=None)  # the model's tokens only
    assert len(out[0]) == len(ids) + 8 and ours == tokenizer.decode(out[0].tolist())


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_two_step_run_exports_the_folder_s_keys_with_the_trained_weights(folder, root, family):
    """2 steps on text, checkpointed and exported: transformers reloads the export with nothing
    missing or left over, the folder's key set, the checkpoint's weights and the logits weft's
    model computes from that checkpoint."""
    from weft.generate import checkpoint_model, load_model

    dump = root / f"run_{family}"
    losses = run(run_args(dump, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path",
                          str(folder(family)), "--model.backend", "transformers", *FP32, "--checkpoint.enable",
                          "--checkpoint.interval", "2", "--export.hf_folder", "hf", steps=2, batch=2))
    assert len(losses) == 2
    source, exported = load_file(folder(family) / "model.safetensors"), load_file(dump / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert sum(not torch.equal(exported[k], source[k]) for k in source) > len(source) // 2  # it trained
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(dump / "hf", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    state = reloaded.state_dict()
    assert all(torch.equal(state[k], exported[k]) for k in exported if k in state)
    checkpoint = str(dump / "checkpoint" / "step-2")
    args, _ = checkpoint_model(checkpoint, None)
    trained = load_model(args, hf=None, checkpoint=checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(TOKENS).logits, generate.logits(trained.eval(), TOKENS),
                                   rtol=0, atol=1e-5)
    shutil.rmtree(dump / "checkpoint")


def test_packed_samples_are_refused_where_a_convolution_mixes_the_documents(folder):
    """Bamba's Mamba layer convolves along the sequence, through a document's end: a packed row's
    second document gets other logits than alone, so packed data is refused in one line, and so are
    cp and pp (one causal mask over the row)."""
    from weft.models import TRANSFORMERS_SPEC

    model = transformers.AutoModelForCausalLM.from_pretrained(folder("bamba")).eval()
    lengths = [10, 14]
    tokens = TOKENS[:1]
    with torch.no_grad():
        packed = TRANSFORMERS_SPEC.backend.forward(model, tokens, torch.cat([torch.arange(n) for n in lengths]))
        alone = torch.cat([model(input_ids=doc).logits for doc in tokens.split(lengths, dim=1)], dim=1)
    assert (packed - alone)[:, lengths[0]:].abs().max() > 1e-3
    cfg = parse_args(run_args(folder("bamba").parent / "plan", "--model.flavor", "from_hf_config",
                              "--checkpoint.initial_load_path", str(folder("bamba")),
                              "--model.backend", "transformers", "--data.document_masking"))
    with pytest.raises(ConfigError) as refused:
        RunPlan.from_config(cfg, 1, device_type="cpu", check_environment=False)
    message = str(refused.value)
    assert message.startswith("data.document_masking = true: ") and "\n" not in message
    assert "bamba's layers mix tokens along the sequence outside attention" in message
    assert "model.layers.0.mamba.conv1d" in message
    for layout in (("--parallelism.cp", "2"), ("--parallelism.pp", "2")):  # one causal mask over the row: refused too
        cfg = parse_args(run_args(folder("bamba").parent / "plan", "--model.flavor", "from_hf_config",
                                  "--checkpoint.initial_load_path", str(folder("bamba")), "--model.backend",
                                  "transformers", "--parallelism.dp_shard", "1", *layout))
        with pytest.raises(ConfigError) as refused:
            RunPlan.from_config(cfg, 2, device_type="cpu", check_environment=False)
        message = str(refused.value)
        assert message.startswith(f"{layout[0].removeprefix('--')} = 2: BambaForCausalLM (model_type bamba")
        assert "its layers mix tokens along the sequence outside attention (model.layers.0.mamba.conv1d)" in message
        assert "\n" not in message


@pytest.mark.parametrize("family", ["gemma4_text", "hunyuan_v1_moe"])
def test_the_flops_per_token_are_those_torch_counts_in_a_training_step(folder, tmp_path, family):
    """MFU's count of the built model, Gemma 4's global layer at its own head width and Hunyuan's
    routed experts at its moe_topk of n, equals torch's FlopCounterMode over a forward and backward
    (eager attention and experts, whose products the counter sees)."""
    from torch.utils.flop_counter import FlopCounterMode

    from weft.components.hf import model_args_from_hf_folder
    from weft.models import TRANSFORMERS_SPEC

    path = folder(family) if family in CONFIGS else tmp_path
    if family not in CONFIGS:  # Hunyuan's MoE names the experts per token moe_topk, not num_experts_per_tok
        torch.manual_seed(0)
        config = transformers.HunYuanMoEV1Config(**SHAPE, moe_intermediate_size=16, num_experts=4, moe_topk=2)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                experts_implementation="eager")
    with FlopCounterMode(display=False) as counter:
        model(TOKENS).logits.sum().backward()
    args = model_args_from_hf_folder(path, "transformers")
    ours = TRANSFORMERS_SPEC.flops_per_token(args, 0, TOKENS.shape[1]) * TOKENS.numel()
    assert ours == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_a_family_that_ties_more_than_its_output_is_refused_in_one_line(tmp_path, capsys):
    """BERT's causal head ties its decoder's bias too, which the backend's one tie (the output
    projection's) would write twice: refused before anything is built, naming the family and the ties."""
    config = transformers.BertConfig(vocab_size=2048, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, is_decoder=True)
    config.save_pretrained(tmp_path)
    assert generate.main(["--hf", str(tmp_path), "--backend", "transformers", "--prompt", "ROMEO:"]) == 2
    refusal = capsys.readouterr().err
    assert refusal.count("\n") == 1 and ("model_type bert: transformers ties 2 tensors to others "
                                         "(cls.predictions.decoder.weight, cls.predictions.decoder.bias); the "
                                         "transformers backend ties the output projection only") in refusal


def test_deepseek_v32_s_sparse_attention_is_computed_as_transformers_computes_it(folder):
    """DeepSeek V3.2's indexer keeps index_topk (4) of the keys each query attends: weft's model of
    the folder gives transformers' logits, and these differ from those of every key kept, so the
    sparse path is the one both computed."""
    from weft.components.hf import model_args_from_hf_folder
    from weft.generate import load_model

    path = folder("deepseek_v32")
    ours = load_model(model_args_from_hf_folder(path, "transformers"), hf=str(path), checkpoint=None,
                      device=torch.device("cpu"), dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = generate.logits(ours.eval(), TOKENS)
        torch.testing.assert_close(logits, theirs(TOKENS).logits, rtol=0, atol=1e-5)
        for layer in theirs.model.layers:
            layer.self_attn.indexer.index_topk = TOKENS.shape[1]
        assert (logits - theirs(TOKENS).logits).abs().max() > 1e-3


@pytest.mark.parametrize(("family", "why"), [
    ("moshi", "model_type moshi: transformers' forward (which training runs) attends every earlier token, but its "
              "generate's cache keeps the last sliding_window (8) of the max_position_embeddings (128) it takes"),
    ("youtu", "model_type youtu: transformers zeroes the token embedding's padding row (pad_token_id 0) whenever it "
              "loads a youtu folder"),
], ids=["moshi", "youtu"])
def test_a_family_transformers_computes_two_ways_is_refused_in_one_line(tmp_path, capsys, family, why):
    """Moshi whose sliding window is shorter than its positions (its forward attends every token, its
    cache the window) and Youtu with a pad_token_id (transformers' load zeroes that embedding row):
    `weft generate` and `weft train` refuse the folder, one line, exit 2; without the cause, it loads."""
    from weft.cli import main as weft
    from weft.components.hf import model_args_from_hf_folder

    config = transformers.AutoConfig.for_model(family, **{k: SHAPE[k] for k in DECODER}, sliding_window=8)
    config.save_pretrained(tmp_path / family)
    assert weft(["generate", "--hf", str(tmp_path / family), "--backend", "transformers", "--prompt", "R"]) == 2
    refusal = capsys.readouterr().err
    assert refusal.count("\n") == 1 and why in refusal
    assert weft(["train", *run_args(tmp_path / "run", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path",
                                    str(tmp_path / family), "--model.backend", "transformers")]) == 2
    refusal = capsys.readouterr().err
    assert refusal.count("\n") == 1 and why in refusal
    fixed = {"moshi": {"sliding_window": 128}, "youtu": {"pad_token_id": None}}[family]
    transformers.AutoConfig.for_model(family, **{k: SHAPE[k] for k in DECODER} | fixed).save_pretrained(tmp_path / "ok")
    assert model_args_from_hf_folder(tmp_path / "ok", "transformers").model_type == family
