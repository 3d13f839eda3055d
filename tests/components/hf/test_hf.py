"""Hugging Face interop: names, the rotary permutation, config.json, export and import in any layout."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from weft.components.checkpoint.checkpointer import CheckpointError
from weft.components.hf import ConversionError, export_to_hf, load_hf_into_model
from weft.models.llama import LLAMA_FLAVORS, ModelArgs, RopeScaling, Transformer
from weft.models.llama.hf_mapping import (
    hf_config,
    hf_to_weft_name,
    model_args_from_hf_config,
    permute_for_hf,
    unpermute_from_hf,
    weft_to_hf_name,
)
from weft.parallelisms.fsdp import FSDPOptions, apply_fsdp
from weft.parallelisms.materialize import materialize
from weft.parallelisms.tp import apply_tp
from weft.recipe.export import main as export_main

from tests.support.dist_utils import run_distributed

# Checkpoints here are saved by one process without a process group, as DCP warns each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, max_seq_len=64)
TIED = replace(TINY, tie_embeddings=True)
# Llama 3.1 scaling with a short original context, so that all three frequency bands occur.
SCALED = replace(TINY, rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=32))


def tiny_model(args: ModelArgs, seed: int) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model


def save_checkpoint(state: dict[str, torch.Tensor], folder: Path, *, complete: bool = True) -> Path:
    """A model-only DCP checkpoint in the format of components/checkpoint/checkpointer.py."""
    dcp.save({"model": state}, checkpoint_id=str(folder), no_dist=True)
    if complete:
        (folder / "COMPLETE").write_text("done\n")
    return folder


def weights(model: Transformer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> tuple[dict[str, torch.Tensor], Path]:
    """(weights of a TINY model, the HF folder exported from its checkpoint)."""
    root = tmp_path_factory.mktemp("tiny")
    model = tiny_model(TINY, seed=1)
    export_to_hf(save_checkpoint(model.state_dict(), root / "step-1"), root / "hf", model_args=TINY)
    return weights(model), root / "hf"


# ---------------------------------------------------------------------------------------------
# Names, permutation, config
# ---------------------------------------------------------------------------------------------


def test_names_map_both_ways():
    names = list(weights(tiny_model(TINY, 0)))
    hf_names = [weft_to_hf_name(n) for n in names]
    assert [hf_to_weft_name(n) for n in hf_names] == names
    assert set(hf_names) == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        *(f"model.layers.{i}.{part}.weight" for i in range(2) for part in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.down_proj", "mlp.up_proj", "input_layernorm", "post_attention_layernorm",
        )),
    }
    assert weft_to_hf_name("layers.7.feed_forward.w1.weight") == "model.layers.7.mlp.gate_proj.weight"
    assert weft_to_hf_name("layers.7.feed_forward.w2.weight") == "model.layers.7.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="rope_cos"):
        weft_to_hf_name("rope_cos")


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_permutation_then_inverse_is_identity(n_heads):
    w = torch.randn(n_heads * 16, 24)
    permuted = permute_for_hf(w, n_heads)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_from_hf(permuted, n_heads), w)
    # Within each head: the even rows, then the odd rows.
    assert torch.equal(permuted[:8], w[0:16:2]) and torch.equal(permuted[8:16], w[1:16:2])


def rotate_adjacent_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Meta/weft convention, plain math: (x[2i], x[2i+1]) rotated by angles[:, i]."""
    out = x.clone()
    even, odd = x[..., 0::2], x[..., 1::2]
    out[..., 0::2] = even * angles.cos() - odd * angles.sin()
    out[..., 1::2] = even * angles.sin() + odd * angles.cos()
    return out


def rotate_half_style(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Hugging Face convention, plain math: (x[i], x[i + d/2]) rotated by angles[:, i]."""
    half = x.shape[-1] // 2
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated_half * sin


def test_permuted_weights_with_rotate_half_give_weft_attention_scores():
    torch.manual_seed(0)
    n_heads, n_kv_heads, head_dim, dim, seq = 4, 2, 16, 32, 12
    x = torch.randn(seq, dim, dtype=torch.float64)
    wq = torch.randn(n_heads * head_dim, dim, dtype=torch.float64)
    wk = torch.randn(n_kv_heads * head_dim, dim, dtype=torch.float64)
    freqs = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)  # [seq, head_dim/2]

    def scores(wq, wk, rotate):
        q = rotate((x @ wq.T).view(seq, n_heads, head_dim).transpose(0, 1), angles)
        k = rotate((x @ wk.T).view(seq, n_kv_heads, head_dim).transpose(0, 1), angles)
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=0)  # each kv head serves consecutive q heads
        return q @ k.transpose(-1, -2)

    weft = scores(wq, wk, rotate_adjacent_pairs)
    hf = scores(permute_for_hf(wq, n_heads), permute_for_hf(wk, n_kv_heads), rotate_half_style)
    torch.testing.assert_close(hf, weft, rtol=1e-12, atol=1e-12)
    # Without the permutation the conventions disagree.
    assert not torch.allclose(scores(wq, wk, rotate_half_style), weft)


def test_hf_config_fields():
    config = hf_config(LLAMA_FLAVORS["llama3_8b"], torch.bfloat16)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (4096, 14336, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (32, 8, 128256)
    assert config["rope_theta"] == 500000.0 and config["max_position_embeddings"] == 131072
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    assert "rope_scaling" not in hf_config(LLAMA_FLAVORS["llama2_7b"])


@pytest.mark.parametrize("flavor", sorted(LLAMA_FLAVORS))
def test_model_args_from_hf_config_inverts_hf_config(flavor):
    args = LLAMA_FLAVORS[flavor]
    back = model_args_from_hf_config(hf_config(args))
    assert hf_config(back) == hf_config(args)


@pytest.mark.parametrize("intermediate_size", [1, 100, 170, 171, 1000])
def test_any_intermediate_size_is_expressible(intermediate_size):
    config = hf_config(TINY) | {"intermediate_size": intermediate_size}  # 8/3·64 rounds to 170
    assert model_args_from_hf_config(config).ffn_hidden_dim == intermediate_size


def test_model_args_from_transformers_style_rope_parameters():
    # Configs saved by transformers >= 5 keep theta and scaling in one `rope_parameters` dict.
    config = hf_config(SCALED)
    config["rope_parameters"] = config.pop("rope_scaling") | {"rope_theta": config.pop("rope_theta")}
    assert model_args_from_hf_config(config) == model_args_from_hf_config(hf_config(SCALED))


# ---------------------------------------------------------------------------------------------
# Export and import on one device
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [TINY, TIED, SCALED], ids=["gqa", "tied", "rope_scaling"])
def test_round_trip_is_bit_identical(tmp_path, args):
    original = tiny_model(args, seed=1)
    export_to_hf(save_checkpoint(original.state_dict(), tmp_path / "step-1"), tmp_path / "hf", model_args=args)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not args.tie_embeddings
    restored = tiny_model(args, seed=2)
    load_hf_into_model(restored, tmp_path / "hf")
    assert_bitwise_equal(weights(restored), weights(original))
    assert restored.output.weight is restored.tok_embeddings.weight or not args.tie_embeddings


def test_sharded_export_round_trip(tmp_path, tiny_export):
    original, _ = tiny_export
    save_checkpoint(original, tmp_path / "step-1")
    export_to_hf(tmp_path / "step-1", tmp_path / "hf", model_args=TINY, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == files
    assert set(index["weight_map"]) == {weft_to_hf_name(n) for n in original}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in original.values())
    for file in files:  # every shard within the limit, unless it holds one larger tensor alone
        shard = load_file(tmp_path / "hf" / file)
        assert len(shard) == 1 or sum(t.numel() * 4 for t in shard.values()) <= 40_000
    restored = tiny_model(TINY, seed=2)
    load_hf_into_model(restored, tmp_path / "hf")
    assert_bitwise_equal(weights(restored), original)


def test_bfloat16_export(tmp_path, tiny_export):
    original, fp32_dir = tiny_export
    export_to_hf(save_checkpoint(original, tmp_path / "step-1"), tmp_path / "hf", model_args=TINY,
                 dtype=torch.bfloat16)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    bf16, fp32 = load_file(tmp_path / "hf" / "model.safetensors"), load_file(fp32_dir / "model.safetensors")
    assert all(torch.equal(bf16[name], fp32[name].to(torch.bfloat16)) for name in fp32)


# ---------------------------------------------------------------------------------------------
# Sharded layouts (2 gloo processes)
# ---------------------------------------------------------------------------------------------


def import_into_sharded_model(layout: str, hf_dir: str, reference: str) -> tuple[list[str], int]:
    """Worker: meta → transform → to_empty → load_hf_into_model, like train.py; returns (names of
    parameters whose full tensor differs from the reference, number of DTensor parameters)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(TINY)
    if layout == "tp":
        apply_tp(model, mesh)
    else:
        apply_fsdp(model, mesh, FSDPOptions(param_dtype=torch.float32))
    model.to_empty(device="cpu")
    load_hf_into_model(model, hf_dir)
    want = load_file(reference)
    differ = [name for name, p in model.named_parameters() if not torch.equal(p.full_tensor(), want[name])]
    return differ, sum(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_import_into_sharded_model(tmp_path, tiny_export, layout):
    original, hf_dir = tiny_export
    save_file(original, tmp_path / "reference.safetensors")
    for differ, n_dtensors in run_distributed(import_into_sharded_model, 2, layout, str(hf_dir),
                                              str(tmp_path / "reference.safetensors")):
        assert differ == []
        assert n_dtensors > 0  # TP leaves the norms replicated as plain tensors; FSDP shards all


def save_fsdp_checkpoint(folder: str, seed: int) -> None:
    """Worker: a TINY model initialised under FSDP 2, saved as a model-only DCP checkpoint."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(TINY)
    apply_fsdp(model, mesh, FSDPOptions(param_dtype=torch.float32))
    materialize(model, "cpu", seed=seed)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        (Path(folder) / "COMPLETE").write_text("done\n")


def test_export_of_fsdp_checkpoint_equals_single_device_export(tmp_path):
    run_distributed(save_fsdp_checkpoint, 2, str(tmp_path / "fsdp"), 3)
    export_to_hf(tmp_path / "fsdp", tmp_path / "hf_fsdp", model_args=TINY)
    export_to_hf(save_checkpoint(tiny_model(TINY, seed=3).state_dict(), tmp_path / "single"),
                 tmp_path / "hf_single", model_args=TINY)
    for file in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf_fsdp" / file).read_bytes() == (tmp_path / "hf_single" / file).read_bytes()


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [SCALED, replace(SCALED, tie_embeddings=True)], ids=["gqa_rope_scaling", "tied"])
def test_transformers_logits_match(tmp_path, args):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(args, seed=1)
    export_to_hf(save_checkpoint(model.state_dict(), tmp_path / "step-1"), tmp_path / "hf", model_args=args)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(tokens), hf_model(tokens).logits
    assert want.abs().max() > 1  # logits of a size where 1e-5 is a meaningful tolerance
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_export_refuses_unfinished_or_missing_checkpoint(tmp_path, tiny_export):
    save_checkpoint(tiny_export[0], tmp_path / "step-1", complete=False)
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-1 has no COMPLETE file"):
        export_to_hf(tmp_path / "step-1", tmp_path / "hf", model_args=TINY)
    with pytest.raises(CheckpointError, match=r"no checkpoint folder at .*step-2"):
        export_to_hf(tmp_path / "step-2", tmp_path / "hf", model_args=TINY)
    assert not (tmp_path / "hf").exists()


def test_export_refuses_other_shapes(tmp_path, tiny_export):
    save_checkpoint(tiny_export[0], tmp_path / "step-1")
    with pytest.raises(CheckpointError, match=r"model\.tok_embeddings\.weight has shape \[128, 64\], "
                                              r"model_args expects \[256, 64\]"):
        export_to_hf(tmp_path / "step-1", tmp_path / "hf", model_args=replace(TINY, vocab_size=256))
    with pytest.raises(CheckpointError, match=r"flavor debugmodel expects \[2048, 256\]"):
        export_to_hf(tmp_path / "step-1", tmp_path / "hf", flavor="debugmodel")
    with pytest.raises(CheckpointError, match=r"has model tensors not in model_args: layers\.1\."):
        export_to_hf(tmp_path / "step-1", tmp_path / "hf", model_args=replace(TINY, n_layers=1))
    assert not (tmp_path / "hf").exists()


def test_export_never_overwrites(tmp_path, tiny_export):
    save_checkpoint(tiny_export[0], tmp_path / "step-1")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("mine")
    with pytest.raises(ConversionError, match=r"output folder .*hf exists and is not empty"):
        export_to_hf(tmp_path / "step-1", tmp_path / "hf", model_args=TINY)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["config.json"]
    assert (tmp_path / "hf" / "config.json").read_text() == "mine"


def test_import_refuses_another_architecture(tmp_path):
    config = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=f"^HF folder {tmp_path}: model_type is mistral, not llama$"):
        load_hf_into_model(tiny_model(TINY, 0), tmp_path)


def test_import_refuses_another_shape(tiny_export):
    _, hf_dir = tiny_export
    with pytest.raises(ConversionError, match=f"^HF folder {hf_dir}: num_hidden_layers is 2, the model has 3$"):
        load_hf_into_model(tiny_model(replace(TINY, n_layers=3), 0), hf_dir)
    with pytest.raises(ConversionError, match="rope_theta is 10000.0, the model has 500000.0"):
        load_hf_into_model(tiny_model(SCALED, 0), hf_dir)


def test_import_names_missing_tensors_and_leaves_model_alone(tmp_path, tiny_export):
    _, hf_dir = tiny_export
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    model = tiny_model(TINY, 0)
    before = weights(model)
    missing = r"lacks tensors model\.layers\.1\.mlp\.up_proj\.weight, lm_head\.weight$"
    with pytest.raises(ConversionError, match=missing):
        load_hf_into_model(model, tmp_path)
    assert_bitwise_equal(weights(model), before)


def test_import_refuses_model_on_meta(tiny_export):
    with torch.device("meta"):
        model = Transformer(TINY)
    with pytest.raises(ConversionError, match="meta device"):
        load_hf_into_model(model, tiny_export[1])


def test_command_line(tmp_path, tiny_export, capsys):
    save_checkpoint(tiny_export[0], tmp_path / "step-1")
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(tmp_path / "step-1"), "--flavor", "debugmodel", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "flavor debugmodel expects" in err

    debug = Transformer(LLAMA_FLAVORS["debugmodel"])
    save_checkpoint(debug.state_dict(), tmp_path / "step-2")
    assert export_main(["--checkpoint", str(tmp_path / "step-2"), "--flavor", "debugmodel", "--out", str(out),
                 "--dtype", "bfloat16", "--max-shard-gb", "0.005"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == 2 * sum(p.numel() for p in debug.parameters())

    with pytest.raises(SystemExit) as exit_info:
        export_main(["--checkpoint", str(tmp_path / "step-2"), "--flavor", "nope", "--out", str(out)])
    assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1

    # Without --flavor the run's record decides; a checkpoint without one (this one) is refused.
    assert export_main(["--checkpoint", str(tmp_path / "step-2"), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--flavor: not given, and no hf_files/config.json recorded" in err
    assert not (tmp_path / "none").exists()


# ---------------------------------------------------------------------------------------------
# Any Llama-shaped config.json (models/llama/hf_mapping.py, components/hf/load.py)
# ---------------------------------------------------------------------------------------------

ODD_SHAPE = {"model_type": "llama", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 72,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 64,
             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}


def test_config_fields_no_flavor_has_give_transformers_logits():
    """head_dim != hidden_size / heads, an intermediate_size no multiplier gives, tied embeddings,
    llama3 rope scaling in transformers 5's rope_parameters: weft's model equals transformers'."""
    transformers = pytest.importorskip("transformers")
    from weft.models.llama.hf_mapping import from_hf_tensor

    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ODD_SHAPE)).eval()
    args = model_args_from_hf_config(ODD_SHAPE)
    assert (args.head_dim, args.ffn_hidden_dim, args.norm_eps, args.tie_embeddings) == (16, 72, 1e-6, True)
    ours = tiny_model(args, 0)
    state = theirs.state_dict()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(from_hf_tensor(name, state[weft_to_hf_name(name)], args))
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))  # past the original 16
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)
    assert theirs.num_parameters() == sum(p.numel() for p in ours.parameters())


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias is True; weft's Llama supports only False"),
    ({"mlp_bias": True}, "mlp_bias is True"),
    ({"hidden_act": "gelu"}, "hidden_act is gelu"),
    ({"attention_dropout": 0.1}, "attention_dropout is 0.1"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type is yarn"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type is dynamic"),
    ({"model_type": "mistral"}, "model_type is mistral, not llama"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures is ['LlamaForSequenceClassification']"),
    ({"head_dim": 15}, "head_dim 15 is odd"),
    ({"num_key_value_heads": 3}, "n_heads 4 is not divisible by n_kv_heads 3"),
])
def test_unrepresentable_config_is_refused_naming_the_field(change, message):
    from weft.models.llama.hf_mapping import HFConfigError

    with pytest.raises(HFConfigError) as error:
        model_args_from_hf_config(ODD_SHAPE | change)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_model_args_for_run_reads_or_checks_the_folder(tmp_path):
    """from_hf_config takes the folder's model; a flavor must match it (today's message, plus how to
    take the folder's); from_hf_config without a Hugging Face folder is refused."""
    from weft.components.config import ConfigError
    from weft.components.hf import model_args_for_run

    (tmp_path / "config.json").write_text(json.dumps(ODD_SHAPE))
    assert model_args_for_run("from_hf_config", str(tmp_path)) == model_args_from_hf_config(ODD_SHAPE)
    with pytest.raises(ConversionError, match=rf"^checkpoint.initial_load_path: HF folder {tmp_path}: hidden_size is 48, "
                                              r"the model has 256 \(model.flavor = from_hf_config takes the folder's\)$"):
        model_args_for_run("debugmodel", str(tmp_path))
    with pytest.raises(ConfigError, match="model.flavor = from_hf_config: checkpoint.initial_load_path must be a Hugging"):
        model_args_for_run("from_hf_config", "")
    assert model_args_for_run("debugmodel", "") == LLAMA_FLAVORS["debugmodel"]


@pytest.mark.parametrize("args", [TIED, SCALED], ids=["tied", "scaled"])
def test_live_model_export_equals_checkpoint_export(tmp_path, args):
    """save_hf_model on a one-device model writes the files export_to_hf writes from its
    checkpoint, byte for byte in the tensors, with the same config.json."""
    from weft.components.hf import save_hf_model

    model = tiny_model(args, 3)
    export_to_hf(save_checkpoint(model.state_dict(), tmp_path / "step-1"), tmp_path / "from_checkpoint",
                 model_args=args, max_shard_bytes=20_000)
    save_hf_model(model, tmp_path / "live", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "live").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "from_checkpoint").iterdir()) and len(files) > 3
    for name in files:
        if name.endswith(".safetensors"):
            live, saved = load_file(tmp_path / "live" / name), load_file(tmp_path / "from_checkpoint" / name)
            assert live.keys() == saved.keys() and all(torch.equal(live[k], saved[k]) for k in live)
        else:
            assert (tmp_path / "live" / name).read_text() == (tmp_path / "from_checkpoint" / name).read_text()
