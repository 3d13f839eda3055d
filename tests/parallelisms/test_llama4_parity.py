"""Loss parity for Llama 4: train.py trains the debug MoE under HSDP, tensor and context parallelism, and
under expert parallelism (alone, with cp, with gradient accumulation and with Muon), and fine-tunes it with
LoRA under fsdp, tp and ep, as one process does (fp32, CPU, gloo, 10 steps, the
routing bias moving after every step, so that a token routed differently anywhere would part the
losses), within 1e-5 relative at every step. Without LoRA the flavors are cut to fewer blocks, each kind
kept: Llama 4's 2 are a dense chunked-RoPE block and an MoE NoPE one (the pair its 4 blocks repeat),
Qwen3-MoE's 3 its dense layer 1 between MoE blocks; fewer blocks, fewer per-step hooks and collectives.

seq_len 128 is two of the flavor's 64-token attention chunks: under cp 2 each rank holds two
32-token pieces of the sequence and the chunked layers' masks span the ranks. The Qwen3 flavors
attend over the whole sequence (no chunks), so their layouts and references train at seq_len 64:
under cp 2 each rank still holds two 16-token pieces.

The same sweep runs Qwen3 (`debugmodel_qwen3`) and Qwen3-MoE (`debugmodel_qwen3_moe`, softmax
routing renormalised over the chosen experts, their scores weighing the experts' outputs) under
FSDP, DDP, HSDP, CP, PP and EP with its compositions, each against its own flavor in one process;
and gpt-oss (`debugmodel_gpt_oss`) under FSDP, EP (over the FSDP ranks, also with full AC), TP alone
(experts, their biases and the clamped SwiGLU split by hidden dimension) and with EP, and PP at seq_len 64.
(Qwen3 under tp 2 and tp 2 x ep 2: tests/parallelisms/test_qwen3_tp_plan.py; AC and compile: test_llama4_transforms.py.)"""

from __future__ import annotations

import pytest

from weft.components.config import parse_args

from tests.support.blocks import fewer_blocks
from tests.support.chat_data import write_jsonl
from tests.support.dist_utils import data_parallel_degree, run_by_world_size
from tests.support.preference_data import make_pairs

STEPS, GLOBAL_BATCH, SEQ, QWEN3_SEQ = 10, 4, 128, 64
# Qwen3-MoE keeps 3: under pp 2 x ep 2 each stage needs an MoE block (0 and 2 around dense 1).
BLOCKS = {"debugmodel_moe": 2, "debugmodel_qwen3": 2, "debugmodel_qwen3_moe": 3}

LORA = ["--lora.enable", "--lora.rank", "4"]  # adapters on attention, shared experts and dense layers
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
PREFERENCE = ["--data.format", "preference", "--data.dataset_path", "{root}/pairs.jsonl"]
# name -> (world size, overrides); a layout with LoRA is compared with LoRA in one process.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp2": (2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"]),
    "cp2": (2, ["--parallelism.dp_shard", "1", "--parallelism.cp", "2"]),
    "fsdp2_lora": (2, ["--parallelism.dp_shard", "2", *LORA]),
    "tp2_lora": (2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2", *LORA]),  # shared experts split
    "ep2": (2, ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),  # experts over the 2 FSDP ranks
    "ep2_lora": (2, ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", *LORA]),  # experts frozen, spread
    "ep2_accumulation": (2, ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.local_batch_size", "1",
                             "--training.gradient_accumulation_steps", "2"]),
    # Muon (fp32 Newton-Schulz), each local expert orthogonalised alone (against Muon in one process)
    "ep2_muon": (2, ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", *MUON]),
    # DPO (a frozen reference copy, experts spread like the policy's) on Hamlet's pairs, written to {root}
    "dpo_ep2": (2, ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", *PREFERENCE]),
    "tp2_ep2": (2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--parallelism.ep", "2"]),  # ep = tp's ranks
    "cp2_ep2": (2, ["--parallelism.dp_shard", "1", "--parallelism.cp", "2", "--parallelism.ep", "2"]),
    "fsdp2_tp2": (4, ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"]),
    "hsdp2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),  # experts sharded, replicated
    "fsdp2_tp2_ep4": (4, ["--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--parallelism.ep", "4"]),
    "fsdp2_tp2_ep2": (4, ["--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--parallelism.ep", "2"]),
    # ep 2 borrowed from fsdp 4 (experts FSDP-sharded over the ranks holding the same ones):
    # tests/parallelisms/test_ep.py, through parallelize, with a lone expert per rank split by FSDP
}

QWEN3, QWEN3_MOE = ["--model.flavor", "debugmodel_qwen3"], ["--model.flavor", "debugmodel_qwen3_moe"]
PP2 = ["--parallelism.pp", "2", "--parallelism.pp_microbatches", "2"]
# The dense debug flavor ties its embeddings, which pp refuses (as for Llama): Qwen3-MoE's pp layouts
# carry its attention (q/k norms) and its dense layer 1 through the stages.
LAYOUTS |= {
    "qwen3_fsdp2": (2, [*QWEN3, "--parallelism.dp_shard", "2"]),
    "qwen3_ddp2": (2, [*QWEN3, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]),
    "qwen3_cp2": (2, [*QWEN3, "--parallelism.dp_shard", "1", "--parallelism.cp", "2"]),
    "qwen3_hsdp2x2": (4, [*QWEN3, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
    "qwen3_moe_fsdp2": (2, [*QWEN3_MOE, "--parallelism.dp_shard", "2"]),
    "qwen3_moe_ddp2": (2, [*QWEN3_MOE, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]),
    "qwen3_moe_ep2": (2, [*QWEN3_MOE, "--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
    "qwen3_moe_cp2_ep2": (2, [*QWEN3_MOE, "--parallelism.dp_shard", "1", "--parallelism.cp", "2",
                              "--parallelism.ep", "2"]),
    "qwen3_moe_pp2": (2, [*QWEN3_MOE, *PP2, "--parallelism.dp_shard", "1"]),
    "qwen3_moe_hsdp2x2": (4, [*QWEN3_MOE, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
    "qwen3_moe_fsdp2_tp2_ep2": (4, [*QWEN3_MOE, "--parallelism.dp_shard", "2", "--parallelism.tp", "2",
                                    "--parallelism.ep", "2"]),
    "qwen3_moe_pp2_fsdp2_ep2": (4, [*QWEN3_MOE, *PP2, "--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
}
# gpt-oss (`debugmodel_gpt_oss`): sinks, sliding windows of 32 (the 64-token samples cross them), biased
# attention, router and experts, the clamped SwiGLU. Under tp alone the experts split by hidden dimension
# (b1, b3 with their rows, b2 added once) and the scores weighing their outputs get a summed gradient;
# cp is refused in one line (tests/models/test_gpt_oss.py).
GPT_OSS = ["--model.flavor", "debugmodel_gpt_oss"]
LAYOUTS |= {
    "gpt_oss_fsdp2": (2, [*GPT_OSS, "--parallelism.dp_shard", "2"]),
    "gpt_oss_ep2": (2, [*GPT_OSS, "--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
    "gpt_oss_tp2": (2, [*GPT_OSS, "--parallelism.dp_shard", "1", "--parallelism.tp", "2"]),
    "gpt_oss_tp2_ep2": (2, [*GPT_OSS, "--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--parallelism.ep", "2"]),
    "gpt_oss_pp2": (2, [*GPT_OSS, *PP2, "--parallelism.dp_shard", "1"]),
    "gpt_oss_ep2_full_ac": (2, [*GPT_OSS, "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
                                "--activation_checkpoint.mode", "full"]),
    # Also matched, and left out for the suite's time (4 ranks on 2 cores): fsdp 2 x tp 2 x ep 2.
}


def reference_of(overrides: list[str]) -> str:
    """The one-process run a layout is compared with: its flavor's, with LoRA or Muon if it has them, on
    pairs if it trains on them."""
    flavor = overrides[overrides.index("--model.flavor") + 1] if "--model.flavor" in overrides else "debugmodel_moe"
    return (flavor + ("_lora" if "--lora.enable" in overrides else "") + ("_muon" if "Muon" in overrides else "")
            + ("_dpo" if PREFERENCE[1] in overrides else ""))


def config_args(dump_folder: str, overrides: list[str], dp: int = 1) -> list[str]:
    seq = QWEN3_SEQ if reference_of(overrides).startswith(("debugmodel_qwen3", "debugmodel_gpt_oss")) else SEQ
    return [
        "--job.config_file", "debug_moe", "--job.dump_folder", dump_folder,
        "--training.steps", str(STEPS), "--training.seq_len", str(seq),
        "--training.local_batch_size", str(GLOBAL_BATCH // dp),
        "--moe.bias_update_rate", "0.01", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", *overrides,
    ]


def blocks_of(overrides: list[str]) -> dict[str, int]:
    """The blocks a layout and its reference train: BLOCKS, or all 4 with LoRA (whose adapters on 2 blocks
    learn too little in 10 steps for the reference's check)."""
    return {} if "--lora.enable" in overrides else BLOCKS


def train_layouts(names: list[str], dump_root: str) -> dict[str, list[float]]:
    """Worker: train each layout in turn in this process group; return its losses."""
    from weft import train

    histories = {}
    for name in names:
        world_size, overrides = LAYOUTS[name]
        overrides = [value.format(root=dump_root) for value in overrides]
        cfg = parse_args(config_args(f"{dump_root}/{name}", overrides, data_parallel_degree(world_size, overrides)))
        with fewer_blocks(blocks_of(overrides)):
            histories[name] = train.train(cfg)
    return histories


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[float]]:
    """One process's losses of every flavor the layouts train, fully trained or with LoRA."""
    from weft import train

    def one_process(name: str) -> list[float]:
        flavor, dpo = name.removesuffix("_dpo"), name.endswith("_dpo")
        flavor, muon = flavor.removesuffix("_muon"), flavor.endswith("_muon")
        flavor, lora = flavor.removesuffix("_lora"), flavor.endswith("_lora")
        root = tmp_path_factory.mktemp(f"single_{name}")
        write_jsonl(root / "pairs.jsonl", make_pairs(64))
        overrides = ["--model.flavor", flavor, *(LORA if lora else []), *(MUON if muon else []),
                     *(PREFERENCE if dpo else [])]
        with fewer_blocks(blocks_of(overrides)):
            return train.train(parse_args(config_args(str(root / "run"), [v.format(root=root) for v in overrides])))

    return {name: one_process(name) for name in {reference_of(overrides) for _, overrides in LAYOUTS.values()}}


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory) -> dict[str, list[float]]:
    root = tmp_path_factory.mktemp("moe_layouts")
    write_jsonl(root / "pairs.jsonl", make_pairs(64))
    return run_by_world_size(train_layouts, LAYOUTS, str(root))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, references, layout_losses):
    losses, reference = layout_losses[layout], references[reference_of(LAYOUTS[layout][1])]
    assert len(losses) == len(reference) == STEPS
    assert reference[-1] < reference[0] - 0.3, "the reference run must learn"
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        assert got == pytest.approx(want, rel=1e-5), f"{layout} step {step}: {got} vs {want}"
