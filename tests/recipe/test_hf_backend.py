"""The transformers backend (models/transformers): folders of families weft does not implement,
written by transformers here (Mistral; Gemma 3 with sliding and global layers and tied embeddings;
DeepSeek V3 and GLM-4 MoE, whose per-expert tensors transformers stacks on load), decode greedily as
transformers does and train under the recipe. Six SFT steps (prompt/completion, packed) in one
process equal fsdp 2, tp 2 (the model's `_tp_plan`, MoE experts split by expert), ep 2 (weft's grouped experts in
transformers' place), pp 2 (transformers' stage), cp 2 (on text) and compiled blocks; float8 converts
the linears weft's filter lets through; the exports reload in transformers with the source's key set and the trained
weights; LoRA's (and QLoRA's) PEFT folder loads in `peft` with the merged export's logits; a stopped
run resumes bit for bit; MFU's FLOPs are torch's count; and what the backend does not reach is refused in one line
naming the key. Qwen3.5 text and gpt-oss (MORE) go through the same on text (fsdp 2, tp 2, exports,
LoRA, resume); gpt-oss trains on packed samples as weft's own gpt-oss, Qwen3.5's are refused;
Mistral under DDP; a Llama folder trains alike under both backends on each data format."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weft import generate
from weft.components.config import ConfigError, parse_args
from weft.components.config.shipped import SHIPPED_TOKENIZER
from weft.components.data import load_tokenizer
from weft.components.hf import ConversionError
from weft.recipe.plan import RunPlan

from tests.support.chat_data import make_chats, write_jsonl
from tests.support.dist_utils import run_distributed
from tests.support.hf_multimodal import write_multimodal_folder
from tests.support.hf_tokenizer import build_qwen3_tokenizer_folder
from tests.support.train_runs import run, run_args

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
MOE = {**SHAPE, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "n_shared_experts": 1}
del MOE["head_dim"]
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),  # as Mistral 7B v0.3 ships
    # one sliding layer (window 8, shorter than the 32-token samples) and one global, embeddings tied
    "gemma3": lambda: transformers.Gemma3TextConfig(**SHAPE, sliding_window=8, pad_token_id=0,
                                                    layer_types=["sliding_attention", "full_attention"]),
    # a dense layer, then an MoE layer: MLA attention, grouped routing (2 groups of 4, one chosen), a
    # shared expert; its folder holds one tensor per expert, which transformers stacks on load
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **MOE, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2,
        topk_group=1, first_k_dense_replace=1),
    # a dense layer, then an MoE layer (sigmoid routing, a shared expert), partial rotary and q/k norms
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**MOE, head_dim=8, use_qk_norm=True, first_k_dense_replace=1),
}
FAMILIES = list(CONFIGS)
# The families whose folders transformers converts on load (experts stacked), and the linears their
# LoRA runs adapt: PEFT would read adapters on gate_proj/up_proj/down_proj as the stacked experts'.
CONVERTED = {"deepseek_v3": "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj", "glm4_moe": "q_proj,k_proj,v_proj,o_proj"}
# Families with layers of their own, checked for greedy decoding and fsdp 2 parity: Qwen3.5's
# linear-attention (gated delta rule) layer beside a full one; gpt-oss's attention sinks, biases and
# experts (plain parameters under FSDP), with a sliding and a global layer.
MORE = {
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        **SHAPE, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "gpt_oss": lambda: transformers.GptOssConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                 layer_types=["sliding_attention", "full_attention"]),
}
CONFIGS |= MORE
FP32 = ("--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3")


ROUTER_BIAS = "e_score_correction_bias"  # DeepSeek V3's and GLM-4 MoE's routing bias: a buffer in the folder


def tiny_folder(folder: Path, family: str) -> Path:
    """A randomly initialised transformers model of `family`, saved as a Hugging Face folder."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    for name, buffer in model.named_buffers():
        if name.endswith(ROUTER_BIAS):  # as a trained model's, so that loading it is seen in the routing
            buffer.copy_(torch.randn(buffer.shape))
    model.save_pretrained(folder)
    return folder


def sft_args(folder: Path, data: Path, dump: Path, *extra: str) -> list[str]:
    return run_args(dump, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(folder),
                    "--data.format", "prompt_completion", "--data.dataset_path", str(data), *FP32,
                    "--checkpoint.enable", "--checkpoint.interval", "3", *extra, steps=6, batch=4)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The folders and the SFT data every test shares."""
    root = tmp_path_factory.mktemp("hf_backend")
    for family in CONFIGS:
        tiny_folder(root / family, family)
    records = [{"prompt": f"Q{i}: who is there?\n", "completion": "Nay, answer me." * (1 + i % 4)} for i in range(64)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # short samples, three documents to a 32-token row: later documents would see earlier ones
    write_jsonl(root / "short.jsonl", [{"prompt": f"Q{i}:", "completion": " Nay." * (1 + i % 3)} for i in range(64)])
    return root


@pytest.fixture(scope="module")
def one_process(root) -> dict[str, list[float]]:
    """Each family's 6 steps in one process, exported at the end (<run>/hf)."""
    return {family: run(sft_args(root / family, root / "sft.jsonl", root / f"one_{family}", "--export.hf_folder", "hf"))
            for family in FAMILIES}


def logits_of(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def more_one_process(root) -> dict[str, list[float]]:
    """Each of MORE's families: 4 steps in one process, exported at the end (<run>/hf)."""
    return {family: run(more_args(root, family, root / f"one_{family}", "--export.hf_folder", "hf",
                                  *KEEP_GPT_OSS.get(family, ())))
            for family in MORE}


# gpt-oss trains under both backends: its transformers run's checkpoint, read back below.
KEEP_GPT_OSS = {"gpt_oss": ("--checkpoint.enable", "--checkpoint.interval", "4")}


def more_args(root: Path, family: str, dump: Path, *extra: str) -> list[str]:
    """MORE's runs read the shipped text (packed samples are refused for Qwen3.5: see below)."""
    return run_args(dump, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(root / family),
                    "--model.backend", "transformers", *FP32, *extra, steps=4, batch=4)


@pytest.mark.parametrize("family", [*FAMILIES, *MORE])
def test_generate_decodes_greedily_as_transformers(root, family, capsys):
    prompt = "ROMEO: But, soft!"
    assert generate.main(["--hf", str(root / family), "--backend", "transformers", "--prompt", prompt,
                          "--max-new-tokens", "12"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    tokenizer = load_tokenizer(str(SHIPPED_TOKENIZER))
    ids = tokenizer.encode(prompt, bos=True, eos=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(root / family).eval()
    out = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_id,
                          pad_token_id=tokenizer.eos_id)
    assert ours == tokenizer.decode(out[0].tolist())


@pytest.mark.parametrize("family", [*FAMILIES, "gpt_oss"])
def test_packed_documents_see_only_themselves(root, family):
    """The step's forward of a packed row (positions restarting at each document) gives each
    document the logits transformers gives it alone: gpt-oss's masks (sliding window 8 inside the
    documents, sinks) built from the positions by the step, as its code builds them without."""
    from weft.models import TRANSFORMERS_SPEC

    model = transformers.AutoModelForCausalLM.from_pretrained(root / family).eval()
    lengths = [10, 14, 8]
    tokens = torch.randint(0, 2048, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = TRANSFORMERS_SPEC.backend.forward(model, tokens, positions)
        alone = torch.cat([model(input_ids=doc).logits for doc in tokens.split(lengths, dim=1)], dim=1)
        whole = model(input_ids=tokens).logits
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert (whole - alone).abs().max() > 1e-3  # without the positions, the documents would see each other


def test_packed_samples_are_refused_where_the_documents_would_see_each_other(root):
    """Qwen3.5's linear attention carries its state on (transformers' torch path takes no document
    boundaries): a packed row's later documents get other logits than alone, so packed data is
    refused in one line."""
    from weft.models import TRANSFORMERS_SPEC

    model = transformers.AutoModelForCausalLM.from_pretrained(root / "qwen3_5").eval()
    lengths = [10, 14]
    tokens = torch.randint(0, 2048, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = TRANSFORMERS_SPEC.backend.forward(model, tokens, torch.cat([torch.arange(n) for n in lengths]))
        alone = torch.cat([model(input_ids=doc).logits for doc in tokens.split(lengths, dim=1)], dim=1)
    assert (packed - alone)[:, lengths[0]:].abs().max() > 1e-3
    for extra, key in ((("--data.format", "prompt_completion"), "data.format = prompt_completion: "),
                       (("--data.document_masking",), "data.document_masking = true: ")):
        with pytest.raises(ConfigError) as refused:
            plan_of(root / "qwen3_5", root / "sft.jsonl", *extra)
        assert str(refused.value).startswith(key) and "\n" not in str(refused.value)
        assert "qwen3_5_text" in str(refused.value)


@pytest.fixture(scope="module")
def packed_gpt_oss(root) -> dict[str, list[float]]:
    """gpt-oss's folder through six steps of short.jsonl's packed samples under each backend."""
    return {backend: run(sft_args(root / "gpt_oss", root / "short.jsonl", root / f"packed_{backend}", "--model.backend",
                                  backend, "--no-checkpoint.enable")) for backend in ("weft", "transformers")}


def test_gpt_oss_trains_on_packed_samples_as_weft_s_own_gpt_oss(root, packed_gpt_oss):
    """Packed prompt/completion samples (three documents to a row) under transformers' code and under
    weft's own gpt-oss (its document masks, sliding windows and sinks: models/gpt_oss): two
    implementations, one loss curve, and one routing balance (tokens per expert counted by weft's MoE
    layers and by the hooks on transformers' routers)."""
    losses = packed_gpt_oss
    assert losses["transformers"] == pytest.approx(losses["weft"], rel=1e-5)
    assert losses["weft"][-1] < losses["weft"][0]
    imbalance = {backend: moe_imbalance(root / f"packed_{backend}") for backend in losses}
    assert list(imbalance["transformers"][0]) == [f"moe/imbalance/model.layers.{i}.mlp.router" for i in (0, 1)]
    assert list(imbalance["weft"][0]) == [f"moe/imbalance/layers.{i}.feed_forward" for i in (0, 1)]
    for theirs, ours in zip(imbalance["transformers"], imbalance["weft"], strict=True):
        assert list(theirs.values()) == pytest.approx(list(ours.values()), rel=1e-6)


def moe_imbalance(dump: Path) -> list[dict[str, float]]:
    """Each logged step's moe/imbalance/<layer> values, from the run's metrics.jsonl."""
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k.startswith("moe/imbalance/")} for line in lines]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_trains_and_exports_the_source_keys_tied_as_they_were(root, one_process, family):
    losses = one_process[family]
    assert len(losses) == 6 and losses[-1] < losses[0]
    source, exported = load_file(root / family / "model.safetensors"), load_file(root / f"one_{family}/hf/model.safetensors")
    assert sorted(exported) == sorted(source)
    # it trained (the router bias is a buffer, exported as loaded)
    assert all(not torch.equal(exported[k], source[k]) for k in source if "norm" not in k and ROUTER_BIAS not in k)
    assert all(torch.equal(exported[k], source[k]) for k in source if ROUTER_BIAS in k)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(root / f"one_{family}" / "hf")
    tied = CONFIGS[family]().tie_word_embeddings
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tied
    imbalance = moe_imbalance(root / f"one_{family}")  # the MoE layer's routing, logged every step
    routed = ["moe/imbalance/model.layers.1.mlp.gate"] if family in CONVERTED else []
    assert len(imbalance) == 6 and all(list(step) == routed and min(step.values(), default=1) >= 1 for step in imbalance)
    config = json.loads((root / f"one_{family}" / "hf" / "config.json").read_text())
    assert config["model_type"] == CONFIGS[family]().model_type and config["dtype"] == "float32"


def test_a_checkpoint_exports_and_decodes_as_the_end_of_run_export(root, one_process, tmp_path, capsys):
    from weft.recipe.export import main as export_main

    checkpoint = root / "one_mistral" / "checkpoint" / "step-6"
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "cli")]) == 0
    cli, at_end = load_file(tmp_path / "cli" / "model.safetensors"), load_file(root / "one_mistral/hf/model.safetensors")
    assert cli.keys() == at_end.keys() and all(torch.equal(cli[k], at_end[k]) for k in cli)
    capsys.readouterr()
    decoded = []
    for source in (["--checkpoint", str(checkpoint)], ["--hf", str(root / "one_mistral" / "hf")]):
        assert generate.main([*source, "--tokenizer", str(SHIPPED_TOKENIZER), "--prompt", "ROMEO:",
                              "--max-new-tokens", "12"]) == 0
        decoded.append(capsys.readouterr().out)
    assert decoded[0] == decoded[1]


def test_a_checkpoint_is_read_by_the_backend_its_run_used(root, more_one_process, tmp_path, capsys):
    """gpt-oss is also an in-repo family: its transformers run's checkpoint (transformers' names) is
    exported and decoded by transformers' code, as its run's config.toml records, not weft's."""
    from weft.recipe.export import main as export_main

    checkpoint = root / "one_gpt_oss" / "checkpoint" / "step-4"
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "cli")]) == 0
    cli, at_end = load_file(tmp_path / "cli" / "model.safetensors"), load_file(root / "one_gpt_oss/hf/model.safetensors")
    assert cli.keys() == at_end.keys() and all(torch.equal(cli[k], at_end[k]) for k in cli)
    capsys.readouterr()
    decoded = []
    for source in (["--checkpoint", str(checkpoint)], ["--hf", str(root / "one_gpt_oss" / "hf"), "--backend", "transformers"]):
        assert generate.main([*source, "--tokenizer", str(SHIPPED_TOKENIZER), "--prompt", "ROMEO:",
                              "--max-new-tokens", "12"]) == 0
        decoded.append(capsys.readouterr().out)
    assert decoded[0] == decoded[1]


@pytest.mark.parametrize("family", ["mistral", "gemma3", *CONVERTED])
def test_the_flops_per_token_are_those_torch_counts_in_a_training_step(root, family):
    """MFU's FLOP count of the built model (tied output, MLA's key and value widths, routed experts at
    top_k of n) against torch's FlopCounterMode over one forward and backward (eager attention and
    experts, so that the counter sees their matrix products: it does not count a grouped multiply)."""
    from torch.utils.flop_counter import FlopCounterMode

    from weft.components.hf import model_args_from_hf_folder
    from weft.models import TRANSFORMERS_SPEC

    model = transformers.AutoModelForCausalLM.from_pretrained(root / family, attn_implementation="eager",
                                                                experts_implementation="eager")
    with FlopCounterMode(display=False) as counter:
        model(TOKENS).logits.sum().backward()
    args = model_args_from_hf_folder(root / family, "transformers")
    ours = TRANSFORMERS_SPEC.flops_per_token(args, 0, TOKENS.shape[1]) * TOKENS.numel()
    assert ours == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_the_start_up_line_names_the_backend_and_the_dry_run_counts_the_meta_model(root, capsys):
    from weft import train

    folder = root / "mistral"
    assert train.main(sft_args(folder, root / "sft.jsonl", root / "dry", "--job.dry_run", "--parallelism.dp_shard",
                               "2", "--job.dry_run_world_size", "2")) == 0
    out = capsys.readouterr().out
    numel = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(folder).parameters())
    assert f"model from_hf_config: {numel:,} parameters, {numel // 2:,} on each rank" in out
    plan = RunPlan.from_config(parse_args(sft_args(folder, root / "sft.jsonl", root / "plan")), 1, device_type="cpu",
                               check_environment=False)
    from weft.recipe.build import backend_line, build_model

    model = build_model(plan, None, None)
    assert backend_line(plan, model) == f"built by transformers {transformers.__version__} (MistralForCausalLM)"


# LoRA on the routed experts too (`experts`: each MoE layer's gate_up_proj and down_proj, PEFT's
# `target_parameters`) beside the linears of LORA_LINEARS, exported (<run>/peft, merged): CONVERTED's
# 6 SFT steps, checkpointed (adapters only) every 3; gpt-oss's (biased, clamped experts used as x @ W)
# 4 steps on text, as packed samples are refused for it. Qwen3.5's (on text too): every block
# linear, its linear-attention layer's in_proj_* and out_proj among them.
EXPERT_LORA = ("--lora.enable", "--lora.rank", "4", "--export.peft_folder", "peft", "--export.hf_folder", "merged")
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA_LINEARS = {**CONVERTED, "gpt_oss": "q_proj,v_proj"}
MOE_LAYERS = {"deepseek_v3": [1], "glm4_moe": [1], "gpt_oss": [0, 1]}


def expert_lora_args(root: Path, family: str, dump: Path, *extra: str) -> list[str]:
    lora = (*EXPERT_LORA, "--lora.target_modules", f"{LORA_LINEARS[family]},experts", *extra)
    if family in MORE:
        return more_args(root, family, dump, *lora)
    return sft_args(root / family, root / "sft.jsonl", dump, *lora)


@pytest.fixture(scope="module")
def expert_lora(root) -> dict[str, list[float]]:
    """Each LoRA run of LORA_LINEARS with adapters on its routed experts, in one process (<root>/lora_<family>)."""
    return {family: run(expert_lora_args(root, family, root / f"lora_{family}")) for family in LORA_LINEARS}


@pytest.mark.parametrize("family", ["gemma3", *LORA_LINEARS, "qwen3_5"])
def test_a_lora_run_exports_a_peft_folder_that_peft_loads_as_the_merged_export(root, tmp_path, family, request, capsys):
    peft = pytest.importorskip("peft")
    lora = ("--lora.enable", "--lora.rank", "4", "--export.peft_folder", "peft")
    if family in CONVERTED:
        with pytest.raises(ConfigError, match=rf"^export.peft_folder = 'peft': PEFT reads a {family} adapter's "
                                              r"down_proj/gate_proj/up_proj as its stacked experts', so the adapter on "
                                              r"model.layers.0.mlp.gate_proj would not load there; set lora.target"):
            plan_of(root / family, root / "sft.jsonl", *lora, world_size=1)
    if family in LORA_LINEARS:
        request.getfixturevalue("expert_lora")  # its linears and its routed experts adapted
        tmp_path = root / f"lora_{family}"
    elif family in MORE:
        run(more_args(root, family, tmp_path, *lora, "--export.hf_folder", "merged"))
        adapted_linears = {key.split(".lora_")[0].rsplit(".", 1)[-1]
                           for key in load_file(tmp_path / "peft" / "adapter_model.safetensors")}
        assert adapted_linears == {*BLOCK_LINEARS, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
    else:
        run(sft_args(root / family, root / "sft.jsonl", tmp_path, *lora, "--export.hf_folder", "merged",
                     "--no-checkpoint.enable"))
    base = transformers.AutoModelForCausalLM.from_pretrained(root / family).eval()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        theirs = adapted(TOKENS).logits
    merged = logits_of(tmp_path / "merged", TOKENS)
    torch.testing.assert_close(theirs, merged, rtol=0, atol=1e-5)
    assert (merged - logits_of(root / family, TOKENS)).abs().max() > 1e-3  # the adapters trained
    assert sorted(load_file(tmp_path / "merged" / "model.safetensors")) == sorted(
        load_file(root / family / "model.safetensors"))
    if family in LORA_LINEARS:  # the experts' adapters are PEFT's target_parameters, trained; the base stayed frozen
        config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
        assert config["target_parameters"] == EXPERT_PARAMETERS and config["r"] == 4 and not config["rank_pattern"]
        source, exported = load_file(root / family / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
        changed = (".mlp.experts.", *(f".{linear}.weight" for linear in LORA_LINEARS[family].split(",")))
        frozen = [k for k in source if not any(n in k for n in changed) or k.endswith("_bias")]  # gpt-oss's biases
        assert frozen and all(torch.equal(exported[k], source[k]) for k in frozen)
        assert any(not torch.equal(exported[k], source[k]) for k in source if ".mlp.experts." in k)
    capsys.readouterr()  # generate.py --adapter puts the PEFT folder on the source as the merged export decodes
    decoded = []
    for source in (["--hf", str(root / family), "--adapter", str(tmp_path / "peft")], ["--hf", str(tmp_path / "merged")]):
        assert generate.main([*source, "--backend", "transformers", "--tokenizer", str(SHIPPED_TOKENIZER),
                              "--prompt", "ROMEO:", "--max-new-tokens", "8"]) == 0
        decoded.append(capsys.readouterr().out.splitlines()[-1])  # after apply_lora's line
    assert decoded[0] == decoded[1]


def test_a_lora_run_on_routed_experts_resumes_bit_for_bit_and_its_checkpoint_exports_as_the_run_did(root, expert_lora,
                                                                                                    tmp_path):
    from weft.recipe.export import main as export_main

    args = expert_lora_args(root, "deepseek_v3", tmp_path / "stopped")
    assert run(args, stop_after=3) + run(args) == expert_lora["deepseek_v3"]
    whole = root / "lora_deepseek_v3"
    assert export_main(["--checkpoint", str(whole / "checkpoint" / "step-6"), "--out", str(tmp_path / "merged"),
                        "--peft-out", str(tmp_path / "peft")]) == 0
    for written in ("merged/model.safetensors", "peft/adapter_model.safetensors"):
        cli, at_end = load_file(tmp_path / written), load_file(whole / written)
        assert cli.keys() == at_end.keys() and all(torch.equal(cli[k], at_end[k]) for k in cli)


def test_a_full_run_s_checkpoint_starts_a_lora_run_whose_peft_folder_loads_on_that_run_s_export(root, one_process,
                                                                                                  more_one_process,
                                                                                                  tmp_path):
    """train -> checkpoint -> LoRA from that checkpoint -> exports: with model.flavor from_hf_config a
    DCP step folder gives the model its run recorded, built by the backend that run used; PEFT's
    adapters from the LoRA run's folder on the full run's export give the merged export's logits."""
    peft = pytest.importorskip("peft")
    from weft.models import TRANSFORMERS_SPEC

    start = root / "one_deepseek_v3" / "checkpoint" / "step-6"  # the step its end-of-run export (hf) holds
    run(run_args(tmp_path / "lora", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(start),
                 "--data.format", "prompt_completion", "--data.dataset_path", str(root / "sft.jsonl"), *FP32,
                 *EXPERT_LORA, "--lora.target_modules", f"{LORA_LINEARS['deepseek_v3']},experts", steps=2, batch=4))
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "one_deepseek_v3" / "hf").eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "lora" / "peft").eval()(TOKENS).logits
    merged = logits_of(tmp_path / "lora" / "merged", TOKENS)
    torch.testing.assert_close(theirs, merged, rtol=0, atol=1e-5)
    assert (merged - logits_of(root / "one_deepseek_v3" / "hf", TOKENS)).abs().max() > 1e-3  # the adapters trained
    # gpt-oss trained under transformers' code: a run from its checkpoint (model.backend auto) keeps that code
    cfg = parse_args(run_args(tmp_path / "plan", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path",
                              str(root / "one_gpt_oss" / "checkpoint" / "step-4")))
    plan = RunPlan.from_config(cfg, 1, device_type="cpu", check_environment=False)
    assert isinstance(plan.model_args, TRANSFORMERS_SPEC.args_type) and plan.model_args.model_type == "gpt_oss"


@pytest.mark.parametrize("family", [*CONVERTED, "gpt_oss"])
def test_adapters_on_routed_experts_compute_what_peft_computes_from_their_folder(root, tmp_path, family):
    """weft's grouped experts in transformers' place, each stacked weight with an adapter (B away from
    zero): the model's logits are those of PEFT's `target_parameters` on transformers' model loaded
    from the PEFT folder, and of the merged folder in transformers; without the adapters, the folder's."""
    peft = pytest.importorskip("peft")
    from weft.components.hf import load_hf_into_model, model_args_from_hf_folder, save_hf_model, save_peft_adapter
    from weft.models import TRANSFORMERS_SPEC
    from weft.parallelisms.lora import LoRAOptions, adapters_off, apply_lora, expert_lora_modules
    from weft.parallelisms.materialize import materialize

    with torch.device("meta"):
        model = TRANSFORMERS_SPEC.build(model_args_from_hf_folder(root / family, "transformers"))
    TRANSFORMERS_SPEC.prepare_expert_parallel(model)
    apply_lora(model, LoRAOptions(rank=4, alpha=8.0, use_rslora=True, target_modules=["experts"]))
    materialize(model, torch.device("cpu"), seed=0)
    load_hf_into_model(model, root / family)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        f"model.layers.{i}.mlp.experts.lora_{f}.{w}" for i in MOE_LAYERS[family] for f in "AB"
        for w in ("gate_up_proj", "down_proj")]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, experts in expert_lora_modules(model):
            for b in experts.lora_B.parameters():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
        ours = model.eval()(TOKENS).logits
        with adapters_off(model):
            torch.testing.assert_close(model(TOKENS).logits, logits_of(root / family, TOKENS), rtol=0, atol=1e-5)
    save_peft_adapter(model, tmp_path / "peft")
    save_hf_model(model, tmp_path / "merged")
    base = transformers.AutoModelForCausalLM.from_pretrained(root / family).eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(TOKENS).logits
    assert (ours - logits_of(root / family, TOKENS)).abs().max() > 1e-2  # the adapters count
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits_of(tmp_path / "merged", TOKENS), ours, rtol=0, atol=1e-5)


LORA_ON_EXPERTS = r"lora.target_modules = \['q_proj', 'experts'\]: "


@pytest.mark.parametrize("family, extra, reason", [
    ("mistral", (), LORA_ON_EXPERTS + r"MistralForCausalLM \(.*\): it has no routed experts, and adapters of routed "
                    r"experts go on weft's experts in their place, which compute plain SwiGLU experts and gpt-oss's; "
                    r"target its linears$"),
    ("deepseek_v3", ("--parallelism.tp", "2"), LORA_ON_EXPERTS + r"adapters of DeepseekV3ForCausalLM \(.*\)'s routed "
                                               r"experts are not split by tensor parallelism yet; set parallelism.tp = 1"),
    ("gpt_oss", ("--parallelism.ep", "2"), r"parallelism.ep = 2: GptOssForCausalLM \(.*\): its experts .* hold "
                                           r"down_proj_bias, gate_up_proj_bias beside gate_up_proj and down_proj"),
])
def test_lora_on_routed_experts_is_refused_where_weft_s_experts_cannot_hold_them(root, family, extra, reason):
    """Where weft's experts in transformers' place do not compute the family's (or it has none), and
    under tp; gpt-oss's adapted experts refuse expert parallelism as its plain ones do."""
    with pytest.raises(ConfigError) as refused:
        plan_of(root / family, root / "sft.jsonl", "--lora.enable", "--lora.target_modules", "q_proj,experts", *extra)
    assert "\n" not in str(refused.value)
    assert re.match(reason, str(refused.value))


BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LoRA's default targets


def test_qlora_trains_as_lora_on_its_nf4_base_and_its_peft_folder_loads_as_the_merged_export(root, tmp_path):
    """lora.quantize_base = nf4 on a Mistral folder (dim 128: NF4 needs 16,384 values a weight): its
    losses are a LoRA run's on the folder with every block linear quantized by torchao and
    dequantized (the weights QLoRA holds), and its PEFT folder loads in `peft` onto that base with
    the logits of its merged export."""
    peft = pytest.importorskip("peft")
    from torchao.quantization import to_nf4

    from weft.parallelisms.lora import NF4_BLOCK, nf4_scaler_block

    torch.manual_seed(0)
    config = transformers.MistralConfig(**{**SHAPE, "hidden_size": 128, "intermediate_size": 128,
                                           "num_key_value_heads": 4, "head_dim": 32}, sliding_window=None)
    transformers.MistralForCausalLM(config).save_pretrained(folder := tmp_path / "mistral")
    tensors = load_file(folder / "model.safetensors")
    for key, tensor in tensors.items():
        if key.rsplit(".", 2)[-2] in BLOCK_LINEARS:
            tensors[key] = to_nf4(tensor, NF4_BLOCK, nf4_scaler_block(tensor.numel())).get_original_weight()
    shutil.copytree(folder, nf4 := tmp_path / "nf4")
    save_file(tensors, nf4 / "model.safetensors", metadata={"format": "pt"})
    lora = ("--lora.enable", "--lora.rank", "4", "--no-checkpoint.enable")
    qlora = run(sft_args(folder, root / "sft.jsonl", tmp_path / "qlora", *lora, "--lora.quantize_base", "nf4",
                         "--export.peft_folder", "peft", "--export.hf_folder", "merged"))
    assert qlora == pytest.approx(run(sft_args(nf4, root / "sft.jsonl", tmp_path / "lora", *lora)), rel=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(nf4).eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "qlora" / "peft").eval()(TOKENS).logits
    merged = logits_of(tmp_path / "qlora" / "merged", TOKENS)
    torch.testing.assert_close(theirs, merged, rtol=0, atol=1e-5)
    assert (merged - logits_of(nf4, TOKENS)).abs().max() > 1e-3  # the adapters trained


@pytest.mark.parametrize("family", ["mistral", "gemma3", *CONVERTED, *MORE])
def test_a_stopped_run_resumes_bit_for_bit(root, one_process, more_one_process, tmp_path, family):
    """Stopped after half its steps (MORE's: 2 of 4 on text), resumed from the checkpoint."""
    if family in MORE:
        args = more_args(root, family, tmp_path, "--checkpoint.enable", "--checkpoint.interval", "2")
        stop, uninterrupted = 2, more_one_process[family]
    else:
        args, stop, uninterrupted = sft_args(root / family, root / "sft.jsonl", tmp_path), 3, one_process[family]
    first = run(args, stop_after=stop)
    assert len(first) == stop and first + run(args) == uninterrupted


PIPELINED = ("mistral", "deepseek_v3")  # pp 2 through transformers' stage (parallelisms/hf_stages.py)
# The families trained under tp 2 from their `_tp_plan`: Gemma 3's declares its q/k norms
# replicated_with_grad_allreduce (whole weights over each rank's heads, gradients summed).
TP_FAMILIES = ("mistral", "gemma3")
# The MoE families under tp 2: their routed experts split by expert (Shard(0), as under ep), the rest as
# their plan declares (GLM-4 MoE's attention by heads, its q/k norms replicated with summed gradients).
TP_EXPERTS = ("deepseek_v3", "glm4_moe")
# MORE's fsdp 2 and tp 2 runs (4 steps on text) keep their last step's checkpoint and an export.
MORE_SAVED = ("--checkpoint.enable", "--checkpoint.interval", "4", "--export.hf_folder", "hf")


def checkpointed_weights(run_folder: Path, step: int) -> dict[str, torch.Tensor]:
    """The weights a run's DCP checkpoint holds (whole tensors, transformers' names), read by torch's converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run_folder / "checkpoint" / f"step-{step}", run_folder / "weights.pt")
    return torch.load(run_folder / "weights.pt", weights_only=False)["model"]


def other_layouts(root: str) -> dict[str, list[float]]:
    """Worker (2 ranks): each family under fsdp 2 with full activation checkpointing (exported),
    MORE's under fsdp 2 and tp 2 (exported, checkpointed), gpt-oss's on packed samples under fsdp 2, Mistral under DDP (dp_replicate 2),
    Mistral and Gemma 3 under tp 2, TP_EXPERTS' under tp 2 (exported), Mistral (on text) under cp 2, PIPELINED's under pp 2,
    the MoE families of CONVERTED under ep 2 (exported), LoRA on the experts of DeepSeek V3 under ep 2
    and pp 2 and of gpt-oss under fsdp 2,
    DeepSeek V3's ep 2 run stopped after 3 steps and resumed, and its one-process checkpoint of
    step 3 (copied to one_to_ep) resumed under ep 2; the multimodal folder around Gemma 3's (exported)
    under fsdp 2."""
    root = Path(root)
    runs = {f"fsdp_{family}": sft_args(root / family, root / "sft.jsonl", root / f"fsdp_{family}",
                                       "--parallelism.dp_shard", "2", "--training.local_batch_size", "2",
                                       "--activation_checkpoint.mode", "full", "--export.hf_folder", "hf")
            for family in FAMILIES}
    runs |= {f"fsdp_{family}": more_args(root, family, root / f"fsdp_{family}", "--parallelism.dp_shard", "2",
                                          "--training.local_batch_size", "2", *MORE_SAVED) for family in MORE}
    runs |= {f"tp_{family}": more_args(root, family, root / f"tp_{family}", "--parallelism.dp_shard", "1",
                                        "--parallelism.tp", "2", *MORE_SAVED) for family in MORE}
    runs["ddp_mistral"] = sft_args(root / "mistral", root / "sft.jsonl", root / "ddp_mistral",
                                   "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1",
                                   "--training.local_batch_size", "2", "--no-checkpoint.enable")
    # gpt-oss's packed samples under fsdp 2: its masks built from the positions inside the sharded model's call
    runs["fsdp_packed_gpt_oss"] = sft_args(root / "gpt_oss", root / "short.jsonl", root / "fsdp_packed_gpt_oss",
                                           "--model.backend", "transformers", "--no-checkpoint.enable",
                                           "--parallelism.dp_shard", "2", "--training.local_batch_size", "2")
    runs["cp_mistral"] = more_args(root, "mistral", root / "cp_mistral", "--parallelism.dp_shard", "1",
                                   "--parallelism.cp", "2")
    runs |= {f"pp_{family}": sft_args(root / family, root / "sft.jsonl", root / f"pp_{family}", "--parallelism.dp_shard",
                                      "1", "--parallelism.pp", "2", "--no-checkpoint.enable") for family in PIPELINED}
    runs |= {f"tp_{family}": sft_args(root / family, root / "sft.jsonl", root / f"tp_{family}",
                                      "--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--export.hf_folder", "hf")
             for family in TP_FAMILIES}
    runs |= {f"tp_{family}": sft_args(root / family, root / "sft.jsonl", root / f"tp_{family}",
                                      "--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--export.hf_folder", "hf")
             for family in TP_EXPERTS}
    runs |= {f"ep_{family}": sft_args(root / family, root / "sft.jsonl", root / f"ep_{family}", "--parallelism.dp_shard",
                                      "2", "--parallelism.ep", "2", "--training.local_batch_size", "2",
                                      "--export.hf_folder", "hf")
             for family in CONVERTED}
    # LoRA with adapters on DeepSeek V3's routed experts: spread with their experts (exported: peft, merged)
    runs["ep_lora_deepseek_v3"] = expert_lora_args(root, "deepseek_v3", root / "ep_lora_deepseek_v3",
                                                   "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
                                                   "--training.local_batch_size", "2", "--no-checkpoint.enable")
    runs["pp_lora_deepseek_v3"] = expert_lora_args(root, "deepseek_v3", root / "pp_lora_deepseek_v3",
                                                   "--parallelism.dp_shard", "1", "--parallelism.pp", "2",
                                                   "--no-checkpoint.enable")
    runs["fsdp_lora_gpt_oss"] = expert_lora_args(root, "gpt_oss", root / "fsdp_lora_gpt_oss", "--parallelism.dp_shard",
                                                 "2", "--training.local_batch_size", "2")
    # the text model of a multimodal folder (Gemma 3's text model with a SigLIP tower) under fsdp 2
    runs["fsdp_gemma3_mm"] = sft_args(root / "gemma3_mm", root / "sft.jsonl", root / "fsdp_gemma3_mm",
                                      "--parallelism.dp_shard", "2", "--training.local_batch_size", "2",
                                      "--export.hf_folder", "hf")
    losses = {name: run(args) for name, args in runs.items()}
    resumed = sft_args(root / "deepseek_v3", root / "sft.jsonl", root / "ep_resumed", "--parallelism.dp_shard", "2",
                       "--parallelism.ep", "2", "--training.local_batch_size", "2")
    losses["ep_resumed"] = run(resumed, stop_after=3) + run(resumed)  # stopped after 3 steps, then resumed
    losses["one_to_ep"] = run(sft_args(root / "deepseek_v3", root / "sft.jsonl", root / "one_to_ep",
                                       "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
                                       "--training.local_batch_size", "2"))
    return losses


@pytest.mark.slow
def test_fsdp2_tp2_and_ep2_equal_one_process_and_their_exports_reload_in_transformers(root, one_process,
                                                                                      more_one_process, expert_lora,
                                                                                      packed_gpt_oss,
                                                                                      capsys):
    shutil.copytree(root / "one_deepseek_v3" / "checkpoint" / "step-3", root / "one_to_ep" / "checkpoint" / "step-3")
    write_multimodal_folder(root / "gemma3", root / "gemma3_mm")  # the gemma3 folder's model as its text model
    losses = run_distributed(other_layouts, 2, str(root), timeout=600)[0]
    assert losses["fsdp_packed_gpt_oss"] == pytest.approx(packed_gpt_oss["transformers"], rel=1e-5)
    for family in MORE:
        assert len(more_one_process[family]) == 4 and more_one_process[family][-1] < more_one_process[family][0]
        source = load_file(root / family / "model.safetensors")
        for layout in ("fsdp", "tp"):  # tp 2: Qwen3.5's whole plan (linear attention's gathered), gpt-oss's embedding
            assert losses[f"{layout}_{family}"] == pytest.approx(more_one_process[family], rel=1e-5)
            # the export holds the source's keys and the weights the run trained (its checkpoint's)
            exported = load_file(root / f"{layout}_{family}" / "hf" / "model.safetensors")
            trained = checkpointed_weights(root / f"{layout}_{family}", 4)
            assert sorted(exported) == sorted(source) and all(torch.equal(exported[k], trained[k]) for k in source)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(root / f"fsdp_{family}" / "hf")  # as exported
        exported = load_file(root / f"fsdp_{family}" / "hf" / "model.safetensors")
        assert all(torch.equal(t, exported[k]) for k, t in reloaded.state_dict().items())
        # gpt-oss's weights: 2e-5 off in a few, as far as one process accumulating 2 x 2 samples (Adam's float noise)
        if family == "qwen3_5":
            single = load_file(root / f"one_{family}" / "hf" / "model.safetensors")
            for key in source:
                torch.testing.assert_close(exported[key], single[key], rtol=0, atol=1e-5)
            torch.testing.assert_close(logits_of(root / f"fsdp_{family}" / "hf", TOKENS),
                                       logits_of(root / f"one_{family}" / "hf", TOKENS), rtol=0, atol=1e-5)
    assert losses["ddp_mistral"] == pytest.approx(one_process["mistral"], rel=1e-5)
    for family in FAMILIES:
        assert losses[f"fsdp_{family}"] == pytest.approx(one_process[family], rel=1e-5)
        source = load_file(root / family / "model.safetensors")
        exported = load_file(root / f"fsdp_{family}" / "hf" / "model.safetensors")
        single = load_file(root / f"one_{family}" / "hf" / "model.safetensors")
        assert sorted(exported) == sorted(source)
        for key in source:
            torch.testing.assert_close(exported[key], single[key], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits_of(root / f"fsdp_{family}" / "hf", TOKENS),
                                   logits_of(root / f"one_{family}" / "hf", TOKENS), rtol=0, atol=1e-5)
    for family in TP_FAMILIES:
        assert losses[f"tp_{family}"] == pytest.approx(one_process[family], rel=1e-5)
        # the norms' trained weights too: a q/k norm's gradient from this rank's heads alone moves the
        # losses by 1e-6 only, its weights by 1e-2 (Adam amplifies the split layers' float noise to 3e-5)
        exported = load_file(root / f"tp_{family}" / "hf" / "model.safetensors")
        single = load_file(root / f"one_{family}" / "hf" / "model.safetensors")
        assert sorted(exported) == sorted(single)
        for key in (key for key in single if key.endswith("norm.weight")):
            torch.testing.assert_close(exported[key], single[key], rtol=0, atol=1e-5)
    for family in PIPELINED:  # two stages (embedding and a layer; a layer, the norm and the head), packed samples
        assert losses[f"pp_{family}"] == pytest.approx(one_process[family], rel=1e-5)
    text = run(more_args(root, "mistral", root / "one_text_mistral"))  # cp 2 trains on text: packing is refused
    assert losses["cp_mistral"] == pytest.approx(text, rel=1e-5)
    assert losses["ep_resumed"] == losses["ep_deepseek_v3"]  # bit for bit
    from weft.recipe.export import main as export_main  # `weft export` of the ep run's checkpoint (grouped experts)

    assert export_main(["--checkpoint", str(root / "ep_deepseek_v3" / "checkpoint" / "step-6"), "--out",
                    str(root / "ep_cli")]) == 0
    cli, at_end = (load_file(root / folder / "model.safetensors") for folder in ("ep_cli", "ep_deepseek_v3/hf"))
    assert cli.keys() == at_end.keys() and all(torch.equal(cli[k], at_end[k]) for k in cli)
    # the ep run's checkpoint holds transformers' names: it resumes in one process, and the reverse
    shutil.copytree(root / "ep_deepseek_v3" / "checkpoint" / "step-3", root / "ep_to_one" / "checkpoint" / "step-3")
    ep_to_one = run(sft_args(root / "deepseek_v3", root / "sft.jsonl", root / "ep_to_one"))
    assert len(ep_to_one) == 3 and ep_to_one == pytest.approx(one_process["deepseek_v3"][3:], rel=1e-5)
    assert len(losses["one_to_ep"]) == 3 and losses["one_to_ep"] == pytest.approx(losses["ep_deepseek_v3"][3:], rel=1e-5)
    capsys.readouterr()
    decoded = []  # and generate.py reads it as it reads the run's export
    for source in (["--checkpoint", str(root / "ep_deepseek_v3" / "checkpoint" / "step-6")],
                   ["--hf", str(root / "ep_deepseek_v3" / "hf")]):
        assert generate.main([*source, "--tokenizer", str(SHIPPED_TOKENIZER), "--prompt", "ROMEO:",
                              "--max-new-tokens", "12"]) == 0
        decoded.append(capsys.readouterr().out)
    assert decoded[0] == decoded[1]
    # The multimodal folder's text model trains as the text folder; its export is the source folder's
    # keys, the towers as they were, and transformers' multimodal class computes the text run's export.
    assert losses["fsdp_gemma3_mm"] == pytest.approx(one_process["gemma3"], rel=1e-5)
    source, exported = (load_file(root / folder / "model.safetensors") for folder in ("gemma3_mm", "fsdp_gemma3_mm/hf"))
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[k], source[k]) for k in source if not k.startswith("language_model."))
    multimodal = transformers.Gemma3ForConditionalGeneration.from_pretrained(root / "fsdp_gemma3_mm" / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(multimodal(TOKENS).logits, logits_of(root / "one_gemma3" / "hf", TOKENS),
                                   rtol=0, atol=1e-5)
    for family in CONVERTED:  # weft's grouped experts spread over 2 ranks, the rest sharded by FSDP
        assert losses[f"ep_{family}"] == pytest.approx(one_process[family], rel=1e-5)
        exported = load_file(root / f"ep_{family}" / "hf" / "model.safetensors")
        single = load_file(root / f"one_{family}" / "hf" / "model.safetensors")
        assert sorted(exported) == sorted(single)
        for key in single:
            torch.testing.assert_close(exported[key], single[key], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits_of(root / f"ep_{family}" / "hf", TOKENS),
                                   logits_of(root / f"one_{family}" / "hf", TOKENS), rtol=0, atol=1e-5)
    # the experts' adapters under ep 2, pp 2 (DeepSeek V3) and fsdp 2 (gpt-oss): one process's losses and
    # merged export, and PEFT reads the ep run's folder so
    ep_lora = root / "ep_lora_deepseek_v3"
    for layout, family in (("ep_lora", "deepseek_v3"), ("pp_lora", "deepseek_v3"), ("fsdp_lora", "gpt_oss")):
        assert losses[f"{layout}_{family}"] == pytest.approx(expert_lora[family], rel=1e-5)
        exported, single = (load_file(folder / "merged" / "model.safetensors")
                            for folder in (root / f"{layout}_{family}", root / f"lora_{family}"))
        assert sorted(exported) == sorted(single)
        for key in single:
            torch.testing.assert_close(exported[key], single[key], rtol=0, atol=1e-5)
    peft = pytest.importorskip("peft")
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "deepseek_v3").eval()
        theirs = peft.PeftModel.from_pretrained(base, ep_lora / "peft").eval()(TOKENS).logits
    torch.testing.assert_close(theirs, logits_of(ep_lora / "merged", TOKENS), rtol=0, atol=1e-5)
    for family in TP_EXPERTS:  # each rank holds 4 of the 8 routed experts and every token
        assert losses[f"tp_{family}"] == pytest.approx(one_process[family], rel=1e-5)
        exported = load_file(root / f"tp_{family}" / "hf" / "model.safetensors")
        single = load_file(root / f"one_{family}" / "hf" / "model.safetensors")
        assert sorted(exported) == sorted(load_file(root / family / "model.safetensors"))
        for key in single:
            torch.testing.assert_close(exported[key], single[key], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits_of(root / f"tp_{family}" / "hf", TOKENS),
                                   logits_of(root / f"one_{family}" / "hf", TOKENS), rtol=0, atol=1e-5)
    # the tp run's checkpoint of step 3 (experts Shard(0), attention split by heads) resumes in one process
    shutil.copytree(root / "tp_glm4_moe" / "checkpoint" / "step-3", root / "tp_to_one" / "checkpoint" / "step-3")
    tp_to_one = run(sft_args(root / "glm4_moe", root / "sft.jsonl", root / "tp_to_one"))
    assert len(tp_to_one) == 3 and tp_to_one == pytest.approx(one_process["glm4_moe"][3:], rel=1e-5)


def plan_of(folder: Path, data: Path, *extra: str, world_size: int = 2) -> RunPlan:
    cfg = parse_args(run_args(folder.parent / "plan", "--model.flavor", "from_hf_config",
                              "--checkpoint.initial_load_path", str(folder), "--data.dataset_path", str(data),
                              "--model.backend", "transformers", *extra))
    return RunPlan.from_config(cfg, world_size, device_type="cpu", check_environment=False)


@pytest.mark.slow  # inductor compiles the two blocks' graphs: 20 s
def test_compiled_blocks_train_as_eager(root, one_process):
    """compile.enable: each of transformers' decoder layers compiled whole (fullgraph, inductor), the
    same six steps as the eager run."""
    losses = run(sft_args(root / "mistral", root / "sft.jsonl", root / "compiled", "--compile.enable",
                          "--no-checkpoint.enable"))
    assert losses == pytest.approx(one_process["mistral"], rel=1e-5)


@pytest.mark.parametrize("family", ["mistral", "deepseek_v3"])
def test_float8_converts_the_linears_weft_s_filter_lets_through(root, family):
    """float8.enable on transformers' own nn.Linear layers as weft's filter decides: the head kept by the
    default filter_fqns ("output" names lm_head here), a linear whose dims are not multiples of 16 kept
    (DeepSeek V3's kv_a_proj_with_mqa, 32 -> 24), the router (not a Linear) and stacked experts left
    alone. On CPU float8 cannot multiply: the numbers are the GPU runbook's (benchmarks/results/README.md)."""
    from weft.components.hf import model_args_from_hf_folder
    from weft.float8 import converted_modules
    from weft.models import TRANSFORMERS_SPEC
    from weft.recipe.build import build_model

    with torch.device("meta"):
        plain = TRANSFORMERS_SPEC.build(model_args_from_hf_folder(root / family, "transformers"))
    linears = {name: m for name, m in plain.named_modules() if type(m) is torch.nn.Linear}
    eligible = {name for name, m in linears.items() if m.in_features % 16 == 0 and m.out_features % 16 == 0}
    assert "lm_head" in eligible and (family == "mistral" or eligible != set(linears))
    float8 = ("--float8.enable", "--float8.min_dim", "16")
    plan = plan_of(root / family, root / "sft.jsonl", *float8, world_size=1)
    assert set(converted_modules(build_model(plan, None, None))) == eligible - {"lm_head"}
    unfiltered = plan_of(root / family, root / "sft.jsonl", *float8, "--float8.filter_fqns", "", world_size=1)
    assert set(converted_modules(build_model(unfiltered, None, None))) == eligible


SWAPPED = {  # MoE families whose folders hold one tensor per expert, Mixtral's under another module name
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=16, norm_topk_prob=True),
}


@pytest.mark.parametrize("family", [*CONVERTED, *SWAPPED])
def test_grouped_experts_in_transformers_place_give_its_logits_and_export_the_folder(root, tmp_path, family):
    """What expert parallelism trains: weft's grouped experts swapped in for transformers' on meta
    hold its state's names and shapes, and loaded from the folder's per-expert tensors, compute the
    folder's logits and export its keys."""
    from weft.components.hf import load_hf_into_model, model_args_from_hf_folder, save_hf_model
    from weft.models import TRANSFORMERS_SPEC
    from weft.parallelisms.materialize import materialize

    folder = root / family
    if family in SWAPPED:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(SWAPPED[family]()).save_pretrained(folder := tmp_path / family)
    args = model_args_from_hf_folder(folder, "transformers")
    with torch.device("meta"):
        model = TRANSFORMERS_SPEC.build(args)
    as_built = {name: t.shape for name, t in model.state_dict().items()}
    TRANSFORMERS_SPEC.prepare_expert_parallel(model)
    assert any(type(m).__name__ == "TransformersRoutedExperts" for m in model.modules())
    assert {name: t.shape for name, t in model.state_dict().items()} == as_built  # a checkpoint's keys in every layout
    materialize(model, torch.device("cpu"), seed=0)
    load_hf_into_model(model, folder)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS).logits, logits_of(folder, TOKENS), rtol=0, atol=1e-5)
    save_hf_model(model, tmp_path / "out")
    exported, source = load_file(tmp_path / "out" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert sorted(exported) == sorted(source) and all(torch.equal(exported[k], source[k]) for k in source)


def test_ep_is_refused_for_experts_weft_s_grouped_experts_do_not_compute(root):
    """gpt-oss's experts have biases (and clamp their activations): not plain SwiGLU experts."""
    with pytest.raises(ConfigError, match=r"^parallelism.ep = 2: GptOssForCausalLM \(model_type gpt_oss, built by "
                                          r"transformers\): its experts \(model.layers.0.mlp.experts\) hold "
                                          r"down_proj_bias, gate_up_proj_bias beside gate_up_proj and down_proj, .*; "
                                          r"set parallelism.ep = 1$"):
        plan_of(root / "gpt_oss", root / "sft.jsonl", "--parallelism.dp_shard", "2", "--parallelism.ep", "2")
    assert plan_of(root / "glm4_moe", root / "sft.jsonl", "--parallelism.dp_shard", "2", "--parallelism.ep", "2")


@pytest.mark.parametrize("family, extra, reason", [
    ("gemma3", (), "its attention has sliding-window layers (sliding_window 8), and the context-parallel core "),
    ("gpt_oss", (), "its attention adds learned sinks to the softmax, and the context-parallel core "),
    ("qwen3_5", (), "its linear-attention layers run a recurrence along the sequence, and the context-parallel "),
    ("mistral", ("--data.format", "prompt_completion"), "data.format = prompt_completion packs samples into rows"),
    ("mistral", ("--data.document_masking",), "data.document_masking = true: "),
])
def test_cp_is_refused_where_the_plain_causal_core_would_compute_another_model(root, family, extra, reason):
    """parallelism.cp swaps every attention layer's core for weft's plain causal one (cp 2 of Mistral
    equals one process: the fsdp 2 test): sliding windows, sinks, linear attention and packed rows
    are refused in one line naming why."""
    with pytest.raises(ConfigError) as refused:
        plan_of(root / family, root / "sft.jsonl", "--model.backend", "transformers", "--parallelism.dp_shard", "1",
                "--parallelism.cp", "2", *extra)
    message = str(refused.value)
    assert message.startswith("parallelism.cp = 2: ") and reason in message and "\n" not in message


@pytest.mark.parametrize("family, reason", [
    ("gemma3", "its attention has sliding-window layers (sliding_window 8), and its pipeline stage "),
    ("qwen3_5", "its linear-attention layers run a recurrence along the sequence, and its pipeline stage "),
])
def test_pp_is_refused_where_the_stage_s_one_causal_mask_would_compute_another_model(root, family, reason):
    """A pipeline stage of a transformers model gives every layer one causal mask and one rotary table
    (Mistral and DeepSeek V3 under pp 2 equal one process: the fsdp 2 test): refused otherwise."""
    with pytest.raises(ConfigError) as refused:
        plan_of(root / family, root / "sft.jsonl", "--model.backend", "transformers", "--parallelism.dp_shard", "1",
                "--parallelism.pp", "2")
    message = str(refused.value)
    assert message.startswith("parallelism.pp = 2: ") and reason in message and "\n" not in message


@pytest.mark.parametrize("key", ["moe.bias_update_rate", "moe.load_balance_coeff"])
def test_weft_s_moe_balancing_is_refused_for_transformers_routers(root, key):
    """The routers are counted for the metrics (tests/models/test_transformers_routing.py), not steered."""
    with pytest.raises(ConfigError) as refused:
        plan_of(root / "deepseek_v3", root / "sft.jsonl", f"--{key}", "0.001")
    assert str(refused.value).startswith(f"{key} = 0.001: DeepseekV3ForCausalLM") and "\n" not in str(refused.value)


def test_tp_is_refused_where_apply_tp_cannot_split_the_declared_plan(root, tmp_path):
    """DeepSeek V3's and GLM-4 MoE's experts split by expert (trained under tp 2 in the fsdp 2 test):
    refused where tp does not divide them, beside ep and with compile (their share of the tokens is cut
    on the host); a style apply_tp does not translate (Llama 4 text's transposed experts,
    packed_rowwise) is refused naming the family and the style; OLMo 2's plan is translated."""
    configs = {"deepseek_six": transformers.DeepseekV3Config(  # 6 routed experts, 3 a group
        **{**MOE, "n_routed_experts": 6}, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=2, topk_group=1, first_k_dense_replace=1),
        "llama4_text": transformers.Llama4TextConfig(**SHAPE, intermediate_size_mlp=64, num_local_experts=4),
        "olmo2": transformers.Olmo2Config(**SHAPE)}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ConfigError, match=r"^parallelism.tp = 4: apply_tp: tp_mesh size 4 does not divide the 6 "
                                          r"experts of model.layers.1.mlp.experts; each rank holds as many whole "
                                          r"experts as the others$"):
        plan_of(tmp_path / "deepseek_six", root / "sft.jsonl", "--parallelism.dp_shard", "1", "--parallelism.tp", "4",
                world_size=4)
    assert plan_of(tmp_path / "deepseek_six", root / "sft.jsonl", "--parallelism.dp_shard", "1",
                   "--parallelism.tp", "2")
    with pytest.raises(ConfigError, match=r"^parallelism.tp = 2 with parallelism.ep = 2: Glm4MoeForCausalLM \(model_"
                                          r"type glm4_moe, built by transformers\) keeps every token on each tp rank "):
        plan_of(root / "glm4_moe", root / "sft.jsonl", "--parallelism.dp_shard", "2", "--parallelism.tp", "2",
                "--parallelism.ep", "2", world_size=4)
    with pytest.raises(ConfigError, match=r"^compile.enable = true with parallelism.tp = 2: DeepseekV3ForCausalLM "
                                          r"\(model_type deepseek_v3, built by transformers\) splits its experts by "):
        plan_of(root / "deepseek_v3", root / "sft.jsonl", "--parallelism.dp_shard", "1", "--parallelism.tp", "2",
                "--compile.enable")
    with pytest.raises(ConfigError, match=r"^parallelism.tp = 2: apply_tp: Llama4ForCausalLM \(model_type llama4_text\) "
                                          r"declares the tensor-parallel style 'packed_rowwise' for layers.\*.feed_"
                                          r"forward.experts.gate_up_proj \(.*\), which weft does not translate; train "
                                          r"it without tensor parallelism \(FSDP or HSDP shard it\)$"):
        plan_of(tmp_path / "llama4_text", root / "sft.jsonl", "--parallelism.dp_shard", "1", "--parallelism.tp", "2")
    # OLMo 2's colwise_gather_output q/k/v and rowwise_split_input o_proj (tests/parallelisms/test_tp.py: tp 2's
    # loss and gradients are one process's)
    assert plan_of(tmp_path / "olmo2", root / "sft.jsonl", "--parallelism.dp_shard", "1", "--parallelism.tp", "2")
    assert plan_of(root / "gemma3", root / "sft.jsonl", "--parallelism.dp_shard", "1", "--parallelism.tp", "2")


def test_tp_is_refused_for_a_family_without_a_plan_and_custom_code_without_the_flag(root, tmp_path):
    folder = tmp_path / "stablelm"
    folder.mkdir()
    config = transformers.StableLmConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2).to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"^parallelism.tp = 2: StableLmForCausalLM \(model_type stablelm, built "
                                          r"by transformers\) declares no tensor-parallel plan \(_tp_plan\); set "
                                          r"parallelism.tp = 1$"):
        plan_of(folder, root / "sft.jsonl", "--parallelism.dp_shard", "1", "--parallelism.tp", "2")
    (folder / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModelForCausalLM": "modeling.Model"}}))
    with pytest.raises(ConversionError, match=r"^checkpoint.initial_load_path: HF folder .*: config.json has auto_map "
                                              r".*model.trust_remote_code = true \(generate.py --trust-remote-code\)$"):
        plan_of(folder, root / "sft.jsonl", world_size=1)


def test_a_family_whose_tensors_transformers_converts_otherwise_is_refused_naming_it(root, tmp_path, capsys):
    """transformers splits HRM's gate_up_proj on load (a Chunk, not a stack of experts): refused in one line."""
    folder = tmp_path / "hrm_text"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "hrm_text"}))
    with pytest.raises(ConversionError, match=r"^checkpoint.initial_load_path: HF folder .*: model_type hrm_text: "
                                              r"transformers converts its checkpoint's tensors on load \(mlp.gate_up"):
        plan_of(folder, root / "sft.jsonl", world_size=1)
    assert generate.main(["--hf", str(folder), "--prompt", "ROMEO:"]) == 2
    refusal = capsys.readouterr().err
    assert "model_type hrm_text: transformers converts" in refusal and refusal.count("\n") == 1


CUSTOM_CONFIG = "from transformers import MistralConfig\n\n\nclass TinyConfig(MistralConfig):\n    model_type = 'tiny_custom'\n"
CUSTOM_MODEL = ("from transformers import MistralForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
                "class TinyForCausalLM(MistralForCausalLM):\n    config_class = TinyConfig\n")


def test_a_folder_with_its_own_code_runs_only_when_trusted(root, tmp_path, capsys):
    folder = tmp_path / "custom"
    shutil.copytree(root / "mistral", folder)
    (folder / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "tiny_custom", "architectures": ["TinyForCausalLM"],
               "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}}
    (folder / "config.json").write_text(json.dumps(config))
    prompt = ["--prompt", "ROMEO:", "--max-new-tokens", "8"]
    assert generate.main(["--hf", str(folder), *prompt]) == 2
    refusal = capsys.readouterr().err
    assert refusal.startswith("weft: error: HF folder") and "auto_map" in refusal and refusal.count("\n") == 1
    assert generate.main(["--hf", str(folder), "--trust-remote-code", *prompt]) == 0
    trusted = capsys.readouterr().out
    assert generate.main(["--hf", str(root / "mistral"), *prompt]) == 0  # the same weights under Mistral's code
    assert trusted == capsys.readouterr().out


def test_the_weft_backend_still_refuses_another_family(root):
    with pytest.raises(ConversionError, match="model_type is mistral, not llama"):
        plan_of(root / "mistral", root / "sft.jsonl", "--model.backend", "weft", world_size=1)


def data_args(root: Path, data: str, tmp_path: Path) -> tuple[str, ...]:
    """Packed chats rendered by a tokenizer folder's ChatML template (assistant turns supervised), or
    a mixture of two text sources (3:1), each file written for the test."""
    if data == "chat":
        tokenizer = build_qwen3_tokenizer_folder(tmp_path / "tokenizer")
        chats = write_jsonl(tmp_path / "chat.jsonl", make_chats(64))
        return ("--data.format", "chat", "--data.dataset_path", str(chats), "--model.tokenizer_path", str(tokenizer),
                "--training.seq_len", "96")
    sources = []
    for i, name in enumerate(("speeches", "answers")):
        records = [{"text": m["messages"][-1 - i]["content"]} for m in make_chats(64, seed=i)]
        sources.append(f"{write_jsonl(tmp_path / f'{name}.jsonl', records)}:{3 - 2 * i}")
    return "--data.format", "text", "--data.mixture", ",".join(sources)


@pytest.mark.parametrize("data", ["prompt_completion", "chat", "mixture"])
def test_a_llama_folder_trains_alike_under_either_backend(root, tmp_path, data):
    """weft's own Llama and transformers' LlamaForCausalLM, from one folder, through the same six
    steps (packed prompt/completion samples, packed chats, a mixture of text sources): two
    implementations, one loss curve."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(tmp_path / "llama")
    extra = () if data == "prompt_completion" else data_args(root, data, tmp_path)
    losses = {backend: run(sft_args(tmp_path / "llama", root / "sft.jsonl", tmp_path / backend, "--model.backend",
                                    backend, "--no-checkpoint.enable", *extra)) for backend in ("weft", "transformers")}
    assert losses["transformers"] == pytest.approx(losses["weft"], rel=1e-5)
    assert losses["weft"][-1] < losses["weft"][0]


def test_auto_builds_with_weft_where_weft_implements_the_model_type():
    from weft.models import TRANSFORMERS_SPEC, spec_for_flavor, spec_for_hf_config

    qwen3 = spec_for_flavor("debugmodel_qwen3")
    assert spec_for_hf_config({"model_type": "qwen3"}, "auto") is qwen3
    assert spec_for_hf_config({"model_type": "qwen3"}, "transformers") is TRANSFORMERS_SPEC
    assert spec_for_hf_config({"model_type": "mistral"}, "auto") is TRANSFORMERS_SPEC
    assert spec_for_hf_config({"model_type": "mistral"}, "weft") is spec_for_flavor("debugmodel")  # Llama's refuses it
