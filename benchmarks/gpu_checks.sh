#!/usr/bin/env bash
# The runbook's GPU checks (benchmarks/results/README.md), grouped so that one group fits one
# 10-minute call of a lent single-GPU machine. Every command's output goes, with the command at
# its top, into $OUT/<group>.log (default OUT: benchmarks/results/tmp).
#   bash benchmarks/gpu_checks.sh <group>     groups: throughput, e2e, memory, lora, more, share, moe,
#                                             observe, data, simulated; still to run (issues 37, 38,
#                                             40, 49, 58): perf, perf_ab, moe_block, qwen3, qlora_moe, newer,
#                                             generation
# BUDGET=<seconds> skips the steps that would start after that many seconds (one call's limit).
# PRINT=1 prints each step's command instead of running it (no GPU, nothing installed; the tests
# parse what it prints: tests/benchmarks/test_gpu_checks.py).
# Needs: torch with CUDA, torchao (PYTHONPATH may point at a folder of carried wheels' contents).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/tmp}
PRINT=${PRINT:-}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
group=$1
LOG=$OUT/$group.log
if [[ -n $PRINT ]]; then LOG=/dev/null; else
    mkdir -p "$OUT"
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit  # weft's one import root
fi

BUDGET=${BUDGET:-100000}
step() {  # step SECONDS COMMAND...: run it under a time limit, log its command and exit code
    local limit=$1; shift
    if [[ -n $PRINT ]]; then printf '%q ' "$@"; echo; return; fi
    if (( SECONDS + 20 > BUDGET )); then echo "### skipped (budget): $*" >>"$LOG"; return; fi
    (( SECONDS + limit > BUDGET )) && limit=$(( BUDGET - SECONDS ))
    { echo; echo "### $(date -u +%FT%TZ) \$ $*"; } >>"$LOG"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    echo "### exit $?" >>"$LOG"
}

[[ -n $PRINT ]] || { echo "# group $group on $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)";
  python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, 'cuda', torch.version.cuda)"; } >"$LOG" 2>&1

# Two ranks sharing the one GPU (--parallelism.share_gpus) with tp, cp or pp > 1 crashed in gloo
# (first H100 session); the plan now refuses them: those steps expect exit 2 and its one line.

# Llama 3.1 8B QLoRA on a seeded base and the shipped corpus (no weights on the device machine)
Q="--job.config_file llama3_8b_qlora --checkpoint.initial_load_path '' --checkpoint.enable false
   --model.tokenizer_path assets/tokenizer/shakespeare.model --data.format text
   --data.dataset_path assets/data/shakespeare --validation.enable false --training.steps 6
   --training.gradient_accumulation_steps 1 --metrics.log_freq 1"

case $group in
perf)  # issue 40 items 1-2: the three rows the targets name and transformers, one step of each profiled
    # (traces in /tmp: too large to carry back), each row's time by category, the targets
    # --layers 7: the 2026-11-24 shape on any GPU (an H200 would fit 16 and double each row's time)
    step 570 python3 benchmarks/gpu_throughput.py --layers 7 --steps 5 --warmup 2 --row-timeout 140 \
        --configs bf16_compile float8_tensorwise_compile float8_rowwise_compile hf_compile \
        --profile-dir /tmp/perf_traces --out "$OUT/perf.jsonl"
    ;;
perf_ab)  # issue 40: every candidate beside the row it changes, one run (the "/without variant" column)
    step 580 python3 benchmarks/gpu_throughput.py --layers 7 --steps 4 --warmup 2 --row-timeout 110 --configs \
        bf16_compile bf16_compile+reshard_never float8_tensorwise_compile float8_tensorwise_compile+float8_output \
        float8_tensorwise_compile+auto_filter float8_tensorwise_compile+fsdp_float8 float8_rowwise_compile \
        float8_rowwise_compile+float8_output float8_rowwise_compile+auto_filter --out "$OUT/perf_ab.jsonl"
    ;;
moe_block)  # issue 40 item 3: the Scout MoE block against the dense block of its active size
    for variant in "" "--compile"; do
        step 200 python3 benchmarks/moe.py --device cuda --dtype bfloat16 --shape scout --repeats 10 \
            --profile /tmp/moe_traces $variant
    done
    step 120 python3 benchmarks/moe.py --device cuda --dtype bfloat16 --shape scout --repeats 10 --tokens 16384
    ;;
qwen3)  # issue 37 item 6: Qwen3-0.6B at its SFT shape (qwen3_0_6b_sft.toml: 2 x 4096) against transformers;
    # the debug Qwen3 MoE under ep 2 as rank 0 of a simulated two-rank job (one GPU)
    step 420 python3 benchmarks/gpu_throughput.py --flavor qwen3_0_6b --seq-len 4096 --batch-size 2 \
        --steps 5 --warmup 2 --row-timeout 130 --configs bf16_compile autocast_compile hf_compile bf16_eager \
        --out "$OUT/qwen3.jsonl"
    step 120 python3 train.py --job.config_file debug_moe --model.flavor debugmodel_qwen3_moe \
        --job.simulate_world_size 2 --parallelism.ep 2 --training.steps 10 --metrics.log_freq 1 \
        --training.mixed_precision_param bfloat16 --checkpoint.enable false --job.dump_folder /tmp/qwen3_ep
    ;;
qlora_moe)  # issue 38 item 5: Scout cut to 2 blocks, QLoRA with and without expert adapters
    S="--model.flavor llama4_scout --training.seq_len 2048 --training.local_batch_size 1
       --training.mixed_precision_param bfloat16 --activation_checkpoint.mode full"
    eval step 300 python3 benchmarks/lora.py --layers 2 --modes lora qlora lora_experts qlora_experts -- $S
    M="--job.config_file llama4_scout_qlora --checkpoint.initial_load_path '' --checkpoint.enable false
       --model.tokenizer_path assets/tokenizer/shakespeare.model --data.format text
       --data.dataset_path assets/data/shakespeare --validation.enable false --training.steps 4
       --training.gradient_accumulation_steps 1 --metrics.log_freq 1"
    eval step 120 python3 benchmarks/memory_check.py --layers 2 -- $M
    eval step 120 python3 benchmarks/memory_check.py --layers 2 -- $M --lora.target_modules wq,wk,wv,wo,w1,w2,w3,experts
    ;;
newer)  # issue 49 item 3: the transformers backend beside weft's Qwen3, DPO's step beside SFT's, Muon's
    # beside AdamW's (llama3_1b, bf16 Newton-Schulz), gpt-oss's sink attention beside SDPA
    step 150 python3 benchmarks/hf_backend.py --dim 2048 --layers 8 --seq-len 1024 --steps 6 --repeats 1
    step 150 python3 benchmarks/preference.py --flavor llama3_1b --seq-len 1024 --batch 4 --steps 6 --repeats 1
    for optimizer in AdamW Muon; do
        step 90 python3 train.py --job.config_file debug_model --model.flavor llama3_1b \
            --training.seq_len 2048 --training.local_batch_size 2 --training.steps 12 --metrics.log_freq 4 \
            --training.mixed_precision_param bfloat16 --optimizer.name $optimizer \
            --optimizer.muon_ns_dtype bfloat16 --checkpoint.enable false --job.dump_folder /tmp/newer/$optimizer
    done
    step 120 python3 benchmarks/gpt_oss.py --device cuda --dtype bfloat16 --flavor gpt_oss_20b --seq 4096
    ;;
generation)  # issue 58 item 3: the engine against transformers' generate at batch 64 on an 8B-class shape
    # (4 of Llama 3.1 8B's blocks, bf16), eager and with the decode step compiled; one GRPO step's split
    # (generate / score / train) on Qwen3-0.6B's shape, random weights, bf16
    for variant in "" "--compile"; do
        step 200 python3 benchmarks/generation.py --device cuda --dtype bfloat16 --models llama3_8b_4layers \
            --prompts 64 --new-tokens 128 --repeats 2 --baseline-prompts 1 $variant
    done
    step 150 python3 benchmarks/rl_step.py --flavors qwen3_0_6b debugmodel_qwen3_moe --prompts 16 \
        --completion-tokens 256 --steps 3 --device-args "--training.mixed_precision_param bfloat16"
    ;;
moe)  # Llama 4: the grouped multiply and the MoE block on one Scout layer; the debug MoE on CUDA
    step 150 python3 benchmarks/moe.py --device cuda --dtype bfloat16 --shape scout --repeats 10
    step 60 python3 benchmarks/moe.py --device cuda --dtype bfloat16 --shape cpu --repeats 10
    step 90 python3 train.py --job.config_file debug_moe --training.steps 30 --metrics.log_freq 5 \
        --training.mixed_precision_param bfloat16 --job.dump_folder /tmp/moe/eager
    step 150 python3 train.py --job.config_file debug_moe --training.steps 30 --metrics.log_freq 5 \
        --training.mixed_precision_param bfloat16 --compile.enable --job.dump_folder /tmp/moe/compiled
    ;;
throughput)
    step 560 python3 benchmarks/gpu_throughput.py --steps 5 --warmup 2 --row-timeout 150 \
        --out "$OUT/gpu_throughput.jsonl"
    ;;
e2e)
    D=/tmp/e2e
    step 150 python3 train.py --job.config_file debug_model --compile.enable --float8.enable \
        --float8.min_dim 16 --checkpoint.enable --checkpoint.interval 10 --training.steps 30 \
        --metrics.log_freq 1 --job.dump_folder $D/a
    cp -r $D/a $D/b && rm -rf $D/b/checkpoint/step-30
    step 120 python3 train.py --job.config_file debug_model --compile.enable --float8.enable \
        --float8.min_dim 16 --checkpoint.enable --checkpoint.interval 10 --training.steps 30 \
        --metrics.log_freq 1 --job.dump_folder $D/b
    step 60 python3 generate.py --checkpoint $D/a/checkpoint/step-30 --prompt "ROMEO:" --max-new-tokens 40
    step 60 python3 generate.py --checkpoint $D/a/checkpoint/step-30 --prompt "ROMEO:" --max-new-tokens 40 --dtype float32
    step 60 python3 train.py --job.config_file debug_model --training.steps 3 --job.dump_folder $D/c
    step 60 python3 train.py --job.config_file debug_model --training.steps 3 --job.dump_folder $D/d \
        --float8.enable --float8.recipe rowwise --float8.min_dim 16
    step 90 python3 -m torch.distributed.run --nproc_per_node 2 train.py --job.config_file debug_model \
        --parallelism.pp 2 --parallelism.dp_shard 1 --parallelism.share_gpus \
        --training.mixed_precision_param float32 --training.steps 20 --metrics.log_freq 1 --job.dump_folder $D/pp
    step 60 python3 train.py --job.config_file debug_model --training.mixed_precision_param float32 \
        --training.steps 20 --metrics.log_freq 1 --job.dump_folder $D/one
    step 90 python3 -m torch.distributed.run --nproc_per_node 2 train.py --job.config_file debug_model \
        --parallelism.dp_shard 1 --parallelism.tp 2 --parallelism.share_gpus --training.steps 10 \
        --metrics.log_freq 1 --job.dump_folder $D/tp
    step 60 python3 -m pytest -q -x tests/models/test_llama.py -k flex
    ;;
memory)
    for ac in none selective full; do
        step 120 python3 benchmarks/memory_check.py --layers 4 -- --job.config_file llama8b \
            --parallelism.dp_shard 1 --training.steps 4 --activation_checkpoint.mode $ac
    done
    step 120 python3 benchmarks/memory_check.py --layers 4 -- --job.config_file llama8b \
        --parallelism.dp_shard 1 --training.steps 4 --float8.enable
    step 150 python3 benchmarks/memory_check.py --layers 4 -- --job.config_file llama8b \
        --job.simulate_world_size 8 --training.steps 4
    ;;
lora)
    step 300 python3 benchmarks/lora.py -- --model.flavor llama3_1b --training.seq_len 2048 \
        --training.mixed_precision_param bfloat16 --activation_checkpoint.mode full
    eval step 240 python3 train.py $Q
    eval step 60 python3 train.py $Q --job.dry_run --job.dry_run_device_memory_gib 80
    PYTHONFAULTHANDLER=1 step 90 python3 -m torch.distributed.run --nproc_per_node 2 train.py \
        --job.config_file debug_model --parallelism.dp_shard 1 --parallelism.tp 2 \
        --parallelism.share_gpus --training.steps 10 --metrics.log_freq 1 --job.dump_folder /tmp/tp
    ;;
more)
    eval step 150 python3 train.py $Q --lora.quantize_base "''"
    eval step 150 python3 train.py $Q --lora.quantize_base "''" --job.dry_run --job.dry_run_device_memory_gib 80
    for s in Interleaved1F1B ZBVZeroBubble; do
        step 90 python3 -m torch.distributed.run --nproc_per_node 2 train.py --job.config_file debug_model \
            --parallelism.pp 2 --parallelism.dp_shard 1 --parallelism.share_gpus --parallelism.pp_schedule $s \
            --training.mixed_precision_param float32 --training.steps 20 --metrics.log_freq 1 --job.dump_folder /tmp/pp$s
    done
    step 150 python3 train.py --job.config_file llama8b --job.simulate_world_size 8 --training.steps 20 \
        --metrics.log_freq 5 --checkpoint.enable false --float8.enable --job.dump_folder /tmp/f8
    ;;
share)  # which layouts two ranks sharing one GPU (gloo on CUDA tensors) can run
    for layout in "--parallelism.dp_shard 2" "--parallelism.dp_replicate 2 --parallelism.dp_shard 1" \
                  "--parallelism.dp_shard 1 --parallelism.cp 2"; do
        step 60 python3 -m torch.distributed.run --nproc_per_node 2 train.py --job.config_file debug_model \
            --parallelism.share_gpus --training.steps 5 --metrics.log_freq 1 --job.dump_folder /tmp/share $layout
        rm -rf /tmp/share
    done
    ;;
observe)  # issues 29 and 30 on one GPU: CUDA tests, memory snapshots, CUDA traces, loader vs step
    step 120 python3 -m pytest -q -rs tests/models/test_llama4.py tests/models/test_llama.py -k "cuda"
    S=/tmp/snap
    step 90 python3 train.py --job.config_file llama8b --model.flavor llama3_1b --job.dump_folder $S \
        --training.steps 4 --metrics.log_freq 1 --activation_checkpoint.mode full --checkpoint.enable false \
        --profiling.enable_memory_snapshot --profiling.memory_snapshot_freq 2 --no-compile.enable
    ls -la $S/memory_snapshot/* >>"$LOG" 2>&1
    step 60 python3 -m torch.cuda._memory_viz stats $S/memory_snapshot/step-2/rank-0.pickle
    step 90 python3 train.py --job.config_file llama8b --model.flavor llama3_1b --job.dump_folder $S \
        --training.steps 4 --metrics.log_freq 1 --activation_checkpoint.mode none --checkpoint.enable false \
        --training.local_batch_size 64 --profiling.enable_memory_snapshot --profiling.memory_snapshot_freq 2 --no-compile.enable
    ls -la $S/memory_snapshot/step-1-oom >>"$LOG" 2>&1
    step 90 python3 train.py --job.config_file llama8b --model.flavor llama3_1b --job.dump_folder /tmp/oom \
        --training.steps 4 --activation_checkpoint.mode none --checkpoint.enable false \
        --training.local_batch_size 64 --no-compile.enable  # expect exit 1 (was 134: the data thread)
    P=/tmp/prof
    step 90 python3 train.py --job.config_file debug_model --job.dump_folder $P --training.steps 10 \
        --metrics.log_freq 1 --checkpoint.enable false --profiling.enable --profiling.freq 10 \
        --profiling.warmup 3 --profiling.active 1
    step 30 python3 -c "import gzip, json, collections, glob; f = sorted(glob.glob('$P/profile_traces/*/*.json.gz')); print(f)
e = json.load(gzip.open(f[-1]))['traceEvents']; print(collections.Counter(x.get('cat') for x in e))
print(sorted({x['name'] for x in e if x['name'] in ('forward', 'backward', 'optimizer')}))"
    step 60 python3 -m weft.components.data.prepare --source assets/data/shakespeare \
        --tokenizer assets/tokenizer/shakespeare.model --out /tmp/shards --workers 8
    for d in /tmp/shards assets/data/shakespeare; do
        step 60 python3 train.py --job.config_file debug_model --training.steps 20 --metrics.log_freq 5 \
            --checkpoint.enable false --data.dataset_path $d --job.dump_folder /tmp/data$RANDOM
    done
    step 120 python3 benchmarks/data_loader.py --flavor llama3_1b --seq-len 2048 --batch 1 --repeats 2
    step 120 python3 benchmarks/profiling.py --flavor llama3_1b --seq-len 2048 --batch 1 --steps 20 --repeats 2
    step 90 python3 train.py --job.config_file debug_moe --training.steps 20 --metrics.log_freq 5 \
        --training.mixed_precision_param bfloat16 --float8.enable --float8.min_dim 16 \
        --checkpoint.enable false --job.dump_folder /tmp/moe_f8
    ;;
data)  # issue 30 on one GPU: the loaders (shards, a mixture, Parquet start-up) against a 1B step; a mixture trains
    step 150 python3 benchmarks/data_loader.py --flavor llama3_1b --seq-len 2048 --batch 1 --repeats 2
    step 60 python3 -m weft.components.data.prepare --source assets/data/shakespeare \
        --tokenizer assets/tokenizer/shakespeare.model --out /tmp/web --workers 8
    step 90 python3 train.py --job.config_file debug_model --training.steps 20 --metrics.log_freq 5 \
        --training.mixed_precision_param bfloat16 --checkpoint.enable false --job.dump_folder /tmp/mixture \
        --data.mixture /tmp/web:3,assets/data/shakespeare:1
    ;;
simulated)  # issue 22's one-GPU checks of two-rank layouts (a fake process group: job.simulate_world_size)
    R="python3 train.py --job.config_file debug_model --job.simulate_world_size 2 --training.steps 5 \
       --metrics.log_freq 1 --checkpoint.enable false --training.mixed_precision_param bfloat16"
    eval step 90 $R --parallelism.fsdp_cpu_offload --job.dump_folder /tmp/sim/offload
    eval step 90 $R --parallelism.dp_shard 1 --parallelism.tp 2 --float8.enable --float8.min_dim 16 \
        --float8.filter_fqns output,layers.1.feed_forward.w2 --job.dump_folder /tmp/sim/float8_tp
    eval step 120 $R --parallelism.dp_shard 1 --parallelism.tp 2 --compile.enable --job.dump_folder /tmp/sim/compile_tp
    ;;
*) echo "unknown group $group" >&2; exit 2 ;;
esac
[[ -n $PRINT ]] || tail -c 6000 "$LOG"
