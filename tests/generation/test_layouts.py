"""`generate` on the training model's layouts: two gloo ranks under fsdp 2 (each rank its own prompts,
fewer on one, so that its rows stop sooner), four under HSDP 2x2, ddp 2, tp 2, ep 2 (Qwen3-MoE) and fsdp 2 with LoRA or QLoRA adapters
return, greedy and seeded, the completions one process returns; FSDP gathers each unit's weights once
per call, not once per token; pipeline stages and context parallelism are refused in one line."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from weft.components.distributed.cpu_ranks import run_distributed
from weft.generation import GenerationError, SamplingParams, generate
from weft.models.llama import ModelArgs as LlamaArgs
from weft.models.llama import Transformer as Llama
from weft.models.qwen3 import ModelArgs as Qwen3Args
from weft.models.qwen3 import Transformer as Qwen3
from weft.parallelisms.cp import apply_cp
from weft.parallelisms.ep import apply_ep
from weft.parallelisms.fsdp import FSDPOptions, apply_ddp, apply_fsdp
from weft.parallelisms.lora import LoRAOptions, apply_lora, quantize_lora_base
from weft.parallelisms.tp import apply_tp

LLAMA = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=64)
QWEN3_MOE = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, dense_hidden_dim=48,
                      max_seq_len=64, n_experts=4, top_k=2, moe_hidden_dim=16, norm_topk_prob=True)
PROMPTS = [[3, 14, 15, 9, 26, 5, 35], [2, 7], [18, 28, 18, 28, 45], [61], [9, 9, 4]]
PARAMS = [SamplingParams(max_completion_length=8, temperature=0),
          SamplingParams(max_completion_length=8, temperature=1.0, top_p=0.9, seed=4)]


def tiny(layout: str):
    # QLoRA's NF4 blocks need linears of a multiple of 16384 values
    args = replace(LLAMA, dim=128, n_kv_heads=4, multiple_of=128) if layout == "qlora" else LLAMA
    model = Qwen3(QWEN3_MOE) if layout == "ep" else Llama(args)
    model.init_weights(seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".w" in name or "experts" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    if layout in ("lora", "qlora"):
        apply_lora(model, LoRAOptions(rank=2, quantize_base="nf4" if layout == "qlora" else None))
        with torch.no_grad():  # adapters that change the output
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    if layout == "qlora":
        quantize_lora_base(model, shards=2, log=False)
    return model


def stop_id(completions) -> int:
    """A token the first prompt's greedy completion draws at step 3: stops some rows sooner than others."""
    return completions[0][0][0].token_ids[3]


def layout_worker(layout: str):
    """Worker: one process's completions (greedy, seeded), then the layout's, the all-gathers counted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny(layout)
    one = [generate(model, PROMPTS, params, n=2) for params in PARAMS]
    stop = {stop_id(one)}
    one = [generate(model, PROMPTS, params, n=2, stop_token_ids=stop) for params in PARAMS]
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp" if layout == "tp" else "dp",))
    parallel = copy.deepcopy(model)
    mine = list(range(len(PROMPTS)))
    if layout in ("fsdp", "hsdp", "lora", "qlora"):
        apply_fsdp(parallel, mesh, FSDPOptions(param_dtype=torch.float32))
        mine = mine[rank::world]  # 3 prompts and 2: rank 1 runs out first
    elif layout == "ddp":
        apply_ddp(parallel, mesh)
        mine = mine[rank::world]
    elif layout == "tp":
        apply_tp(parallel, mesh)
    elif layout == "ep":
        apply_ep(parallel, mesh)
        mine = mine[rank::world]
    gathers = []
    all_gather = dist.all_gather_single
    dist.all_gather_single = lambda *a, **k: gathers.append(1) or all_gather(*a, **k)
    try:
        got = [generate(parallel, [PROMPTS[i] for i in mine], params, n=2, stop_token_ids=stop, prompt_indices=mine,
                        max_batch_sequences=3) for params in PARAMS]
    finally:
        dist.all_gather_single = all_gather
    units = sum(hasattr(m, "unshard") for m in parallel.modules())
    expected = [[one[k][i] for i in mine] for k in range(len(PARAMS))]
    same = all(a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
               and max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
               for k in range(len(PARAMS)) for cs, ds in zip(got[k], expected[k]) for a, b in zip(cs, ds, strict=True))
    return same, len(gathers), units, [c.finish_reason for cs in got[0] for c in cs]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "ddp", "tp", "ep", "lora", "qlora"])
def test_a_layout_returns_what_one_process_returns(layout):
    results = run_distributed(layout_worker, 4 if layout == "hsdp" else 2, layout)
    for same, gathers, units, reasons in results:
        assert same
        if layout in ("fsdp", "hsdp", "lora", "qlora"):
            assert units == LLAMA.n_layers + 1 and gathers == 2 * units  # once per call and unit, for 2 calls
    reasons = [reason for *_, rank_reasons in results for reason in rank_reasons]
    assert "stop" in reasons and "length" in reasons


def cp_worker() -> str:
    model = tiny("fsdp")
    apply_cp(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    with pytest.raises(GenerationError) as refused:
        generate(model, [[1, 2]], PARAMS[0])
    return str(refused.value)


@pytest.mark.slow
def test_context_parallelism_is_refused_naming_the_layout():
    for message in run_distributed(cp_worker, 2):
        assert "generation under cp (context parallelism) is not supported" in message


def test_a_pipeline_stage_is_refused_naming_the_layout():
    model = tiny("tp")
    model.output = None
    with pytest.raises(GenerationError, match=r"^generate cannot run a pipeline stage .* under pp \(pipeline"):
        generate(model, [[1, 2]], PARAMS[0])
