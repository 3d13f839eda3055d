"""The run's configuration, as people read it: one dataclass per TOML section, one field per key.

Each field carries a one-line help string and its constraints (choices, bounds, a check) in its
metadata; components/config/parser.py reads them to merge command line, TOML file and defaults,
validate every value and print --help. Add a key here and it is parsed, validated and documented.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weft.models import BACKENDS, flavors


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    check: tuple[Callable[[Any], bool], str] | None = None,
    without_enable: bool = False,
) -> Any:
    """A dataclass field with help and constraints; ``check`` is (predicate, "what it must be").

    In a section with an ``enable`` switch, a key may differ from its default only while the
    section is enabled, unless ``without_enable`` says it acts on its own (see the parser)."""
    metadata = {"help": help, "choices": choices, "min": min, "max": max, "gt": gt, "lt": lt, "check": check,
                "without_enable": without_enable}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _is_op_or_positive_int(value: str) -> bool:
    return value == "op" or (value.isdecimal() and int(value) > 0)


# A path or name that must not be empty: "" would mean the current folder (train on every text
# file under it, or write outputs into it), which no one means.
_NOT_EMPTY = (lambda value: value.strip() != "", "a non-empty path or name")

# Tokens one device holds in one micro-batch (local_batch_size x seq_len). 2**24 is far beyond
# what any model's activations fit in; a larger value is a typo that would otherwise allocate
# for minutes before failing.
MAX_MICRO_BATCH_TOKENS = 2**24


@dataclass
class Job:
    config_file: str = opt("", "TOML file: a path, or a bare name found in train_configs/ ('.toml' optional)")
    dump_folder: str = opt("./outputs", "Folder for every output of the run: logs, TensorBoard (tb/), checkpoints",
                           check=_NOT_EMPTY)
    description: str = opt("", "Free text shown in the startup summary")
    simulate_world_size: int = opt(
        0, "Run rank 0 of a job of this many ranks in this one process, collectives faked: its memory and step "
           "time are real, its losses meaningless (0: off)", min=0)
    dry_run: bool = opt(
        False, "Plan the run in one process without devices: build every transform on the meta device, print the "
               "layout, parameters per rank and a per-device memory estimate, write nothing")
    dry_run_world_size: int = opt(
        0, "World size the dry run plans for (0: job.simulate_world_size if set, else the product of the "
           "parallelism degrees, pp included, dp_shard -1 counting as 1)",
        min=0)
    dry_run_ep_imbalance: float = opt(
        1.25, "Under parallelism.ep, the tokens the busiest rank's experts receive over the mean, as the dry run "
              "plans for (the training log's ep_imbalance measures it; 1: perfectly even)", min=1)
    dry_run_device_memory_gib: str = opt(
        "", "Device memory the dry run checks the estimate against: GiB ('80') or a GPU name ('h100', 'a100-40gb', "
            "'4090'); exit 2 if it does not fit ('': no check)")


# model.flavor's value for "the shape in config.json of the Hugging Face folder checkpoint.initial_load_path".
FROM_HF_CONFIG = "from_hf_config"


@dataclass
class Model:
    flavor: str = opt(
        "debugmodel", f"Model architecture and size: a built-in flavor (a Hugging Face checkpoint.initial_load_path "
        f"must match it), or '{FROM_HF_CONFIG}' to read them from that folder's config.json",
        choices=(*flavors(), FROM_HF_CONFIG))
    tokenizer_path: str = opt(
        "", "SentencePiece .model file or Hugging Face tokenizer folder; empty: the folder of "
        "checkpoint.initial_load_path if it has a tokenizer.json, else assets/tokenizer/shakespeare.model")
    backend: str = opt(
        "auto", f"Who builds the model of a Hugging Face folder (model.flavor = {FROM_HF_CONFIG}): 'weft' (its own "
        "Llama, Llama 4 and Qwen3), 'transformers' (transformers' modeling code, any causal LM it has), or 'auto' "
        "(weft where it implements the folder's model_type, else transformers)", choices=BACKENDS)
    trust_remote_code: bool = opt(
        False, "With the transformers backend, run the modeling code a folder ships (config.json auto_map); "
        "off, such a folder is refused")


@dataclass
class Training:
    steps: int = opt(1000, "Number of optimizer steps to train", min=1)
    seq_len: int = opt(2048, "Tokens per training sample", min=1)
    local_batch_size: int = opt(8, "Samples per data-parallel rank per micro-step", min=1)
    gradient_accumulation_steps: int = opt(1, "Micro-steps accumulated per optimizer step", min=1)
    max_norm: float = opt(1.0, "Clip gradients to this global L2 norm; 0 disables clipping", min=0)
    seed: int = opt(0, "Random seed for weight initialization and data order", min=0, max=2**63 - 1)
    deterministic: bool = opt(False, "Use deterministic algorithms (reproducible, slower)")
    mixed_precision_param: str = opt(
        "bfloat16", "Dtype FSDP computes parameters in", choices=("float32", "bfloat16"))
    mixed_precision_reduce: str = opt(
        "float32", "Dtype FSDP reduces gradients in", choices=("float32", "bfloat16"))
    on_nonfinite: str = opt(
        "stop", "A step whose loss or gradient norm is NaN or infinite: stop (exit 2, no checkpoint of it), or skip "
        "its optimizer step (weights, optimizer state and LR schedule untouched)", choices=("stop", "skip"))
    max_skipped_steps: int = opt(
        3, "With on_nonfinite = skip: stop after this many consecutive skipped steps", min=1)
    objective: str = opt(
        "auto", "What a step trains: next_token (pretraining, SFT), preference ([preference]), grpo ([rl], online RL "
        "on data.format = prompts) or distillation ([distillation], on prompts); auto: preference for data.format = preference, grpo for prompts, else next_token")


# Pipeline schedules of torch.distributed.pipelining (torch 2.13), by the names get_schedule_class takes.
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")


@dataclass
class Parallelism:
    pp: int = opt(1, "Pipeline-parallel degree: the model is cut into stages across this many ranks (outermost dim)",
                  min=1)
    pp_schedule: str = opt(
        "1F1B", "Pipeline schedule; Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV "
        "put several stages on each rank", choices=PIPELINE_SCHEDULES)
    pp_microbatches: int = opt(
        0, "Micro-batches each local batch is split into for the pipeline (0: one per sample)", min=0)
    pp_stages_per_rank: int = opt(
        0, "Pipeline stages on each rank (0: 1 for GPipe and 1F1B, 2 for the schedules that need several)", min=0)
    dp_replicate: int = opt(1, "Data-parallel replicas (DDP, or the outer dimension of HSDP)", min=1)
    dp_shard: int = opt(
        -1, "FSDP shard degree; -1 takes what the other degrees leave of the world",
        check=(lambda v: v == -1 or v >= 1, "-1 or >= 1"))
    cp: int = opt(1, "Context-parallel degree", min=1)
    tp: int = opt(1, "Tensor-parallel degree", min=1)
    ep: int = opt(1, "Expert-parallel degree: ranks each MoE layer's experts are spread over, borrowed from "
                  "dp_shard x cp x tp (divides it and the experts, a multiple of tp)", min=1)
    fsdp_reshard_after_forward: str = opt(
        "default", "When FSDP frees gathered parameters after forward", choices=("default", "always", "never"))
    fsdp_cpu_offload: bool = opt(
        False, "Keep FSDP's sharded parameters, gradients and optimizer state in CPU memory (needs dp_shard x cp > 1)")
    share_gpus: bool = opt(
        False, "Processes of a node share GPUs (tests on one GPU): collectives on gloo, slow; off: one GPU each, NCCL")
    loss_parallel: bool = opt(True, "With tp > 1, compute the loss on vocabulary-sharded logits")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer: AdamW on every parameter, or Muon on the hidden matrices and AdamW on "
                    "the rest (embeddings, output, norms, biases; docs/muon.md)", choices=("AdamW", "Muon"))
    lr: float = opt(3e-4, "Peak learning rate (with Muon: of the parameters AdamW updates)", gt=0)
    beta1: float = opt(0.9, "Decay rate of the first-moment estimate", min=0, lt=1)
    beta2: float = opt(0.95, "Decay rate of the second-moment estimate", min=0, lt=1)
    eps: float = opt(1e-8, "Term added to the denominator for numerical stability", gt=0)
    weight_decay: float = opt(0.1, "Decoupled weight decay coefficient", min=0)
    implementation: str = opt(
        "auto", "Optimizer kernel implementation", choices=("auto", "foreach", "fused", "for-loop"))
    muon_lr: float = opt(0.02, "Muon: peak learning rate of the matrices (the schedule scales it as lr)", gt=0)
    muon_momentum: float = opt(0.95, "Muon: momentum of the matrices' gradient average", min=0, lt=1)
    muon_nesterov: bool = opt(True, "Muon: Nesterov momentum (the gradient plus the momentum)")
    muon_weight_decay: float = opt(0.1, "Muon: decoupled weight decay of the matrices", min=0)
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations per update", min=1, max=99)
    muon_ns_dtype: str = opt(
        "bfloat16", "Muon: dtype Newton-Schulz computes in (float32: exact comparisons, slower)",
        choices=("bfloat16", "float32"))
    muon_adjust_lr: str = opt(
        "original", "Muon: learning rate of a [rows, cols] matrix: original, muon_lr sqrt(max(1, rows/cols)); "
        "match_rms_adamw, muon_lr 0.2 sqrt(max(rows, cols)), an AdamW-tuned lr reused",
        choices=("original", "match_rms_adamw"))
    muon_per_head: bool = opt(
        False, "Muon: orthogonalise attention's q, k, v and output projections head by head (weft's models)")
    muon_owner_ranks: bool = opt(
        False, "Muon: a sharded matrix's Newton-Schulz runs on one owner rank and its result is scattered back "
        "(divides the work, adds a scatter); off: every rank sharing a matrix computes it")
    muon_exclude: list[str] = opt(
        [], "Muon: parameter name patterns (fnmatch, e.g. '*.router.*') left to AdamW besides embeddings, output, "
        "norms and biases")


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warmup from 0 to the peak learning rate", min=0)
    decay_type: str = opt("linear", "Shape of the decay after warmup", choices=("linear", "cosine"))
    min_lr_ratio: float = opt(0.0, "Final learning rate as a fraction of the peak", min=0, max=1)


@dataclass
class Data:
    dataset_path: str = opt("assets/data/shakespeare", "A .txt or .jsonl file (either may be compressed: .gz, "
                            ".zst), a .parquet or .arrow file, or a folder of them, or a folder of token shards "
                            "(its manifest.json; python -m weft.components.data.prepare)", check=_NOT_EMPTY)
    text_field: str = opt("text", "Field of each JSONL record, or column of each Parquet/Arrow row, that holds the "
                          "text", check=_NOT_EMPTY)
    format: str = opt(
        "text", "text: packed raw text, every token supervised; chat: JSONL {messages: [{role, content}]}, loss on "
        "assistant turns; prompt_completion: JSONL {prompt, completion} (or instruction/input/output), loss on the "
        "completion; preference: JSONL {prompt, chosen, rejected}, trained by [preference]'s objective; prompts: "
        "JSONL/Parquet/Arrow rows with a prompt (and columns the reward functions read), for [rl]'s online RL",
        choices=("text", "chat", "prompt_completion", "preference", "prompts"))
    document_masking: bool = opt(
        False, "format text: attention stays within each document and positions restart at each BOS "
        "(chat and prompt_completion samples are always masked this way)")
    long_samples: str = opt(
        "truncate", "Chat / prompt_completion samples longer than seq_len + 1 tokens: cut to fit, or skip; "
        "either is counted in the log", choices=("truncate", "drop"))
    allow_changed_data: bool = opt(
        False, "Resume even if a data file changed since the checkpoint was saved (logged); by default that "
        "stops the run, naming the file")
    mixture: list[str] = opt(
        [], "Weighted sources, each 'PATH:WEIGHT' (PATH as data.dataset_path, which it replaces; WEIGHT > 0): "
        "windows drawn from each in proportion to its weight, within one window per rank at every step")


@dataclass
class Validation:
    enable: bool = opt(False, "Evaluate the loss on a held-out dataset during training")
    dataset_path: str = opt("", "A data file (as data.dataset_path), or a folder of them, read in data.format unless "
                            "validation.format is set; or a folder of token shards")
    format: str = opt("", "Format of the validation data; empty: data.format",
                      choices=("", "text", "chat", "prompt_completion", "preference", "prompts"))
    mixture: list[str] = opt(
        [], "With data.mixture: one validation path per source, in data.mixture's order; one loss per source "
        "(in place of validation.dataset_path)")
    freq: int = opt(100, "Evaluate every N steps (and after the last step)", min=1)
    steps: int = opt(10, "Global batches (as in training, accumulation included) evaluated each time: always the first ones of the dataset", min=1)


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every N steps", min=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard scalars under <dump_folder>/tb/")
    slow_rank_threshold: float = opt(
        1.2, "Name the slowest rank in the log line when its own step time (compute plus its data wait) "
        "exceeds the median rank's by this ratio; 0: never",
        check=(lambda v: v == 0 or v >= 1, "0 (off) or a ratio >= 1"))
    enable_wandb: bool = opt(False, 'Send the TensorBoard scalars to Weights & Biases from rank 0 (pip install "weft[wandb]")')
    wandb_project: str = opt("weft", "Weights & Biases project", check=_NOT_EMPTY)
    wandb_run_name: str = opt("", "Weights & Biases run name; empty: the dump folder's name")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints and resume from the latest one")
    interval: int = opt(500, "Save a checkpoint every N steps", min=1)
    keep_latest_k: int = opt(0, "Keep only the newest K checkpoints; 0 keeps all", min=0)
    async_mode: str = opt("disabled", "Save in the background while training continues", choices=("disabled", "async"))
    load_step: int = opt(-1, "Step to resume from; -1 loads the latest complete checkpoint", min=-1)
    on_save_error: str = opt(
        "stop", "A save that fails (disk full, quota, I/O error): stop (exit 2), or train on and try again at the "
        "next interval; either way the partial folder is removed", choices=("stop", "continue"))
    folder: str = opt("checkpoint", "Checkpoint folder, relative to dump_folder", check=_NOT_EMPTY,
                      without_enable=True)
    initial_load_path: str = opt(
        "", "Weights to start from when dump_folder has no checkpoint: a DCP checkpoint folder or a Hugging Face folder",
        without_enable=True)
    create_seed_checkpoint: bool = opt(
        False, "Only initialise the model on one process and save it as step-0, the seed every layout can start from",
        without_enable=True)


@dataclass
class Comm:
    init_timeout_seconds: float = opt(
        600.0, "Seconds a collective may wait while the ranks start, load, compile (the first step), save and "
        "validate", gt=0)
    train_timeout_seconds: float = opt(
        300.0, "Seconds a collective may wait during training steps; a rank silent for longer ends the run",
        gt=0)
    trace_buf_size: int = opt(
        0, "Entries of torch's flight recorder per rank: each rank's last collectives, written to trace_folder when "
           "an NCCL collective times out (0: weft sets nothing; torch's defaults and TORCH_FR_* variables apply)",
        min=0)
    trace_folder: str = opt(
        "comm_traces", "With trace_buf_size > 0: folder of the flight recorder's dumps, one rank_<N> file per rank "
                       "(relative to dump_folder)", check=_NOT_EMPTY)


@dataclass
class Export:
    hf_folder: str = opt(
        "", "After the last step, write the model as a Hugging Face folder here (weights, config.json, tokenizer, "
            "generation_config.json; relative to dump_folder; a new or empty folder); '': no export")
    peft_folder: str = opt(
        "", "With lora.enable: after the last step, write the adapters as a PEFT adapter folder here (relative to "
            "dump_folder; a new folder); with lora.enable, hf_folder gets the merged model")
    dtype: str = opt("float32", "dtype of the exported weights", choices=("float32", "bfloat16"))
    max_shard_gib: float = opt(5.0, "Largest safetensors file of the export, in GiB", gt=0)


@dataclass
class Float8:
    enable: bool = opt(False, "Train linear layers with float8 matmuls")
    recipe: str = opt("tensorwise", "Float8 scaling granularity", choices=("tensorwise", "rowwise"))
    enable_fsdp_float8_all_gather: bool = opt(False, "All-gather FSDP parameters in float8 to halve traffic")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute float8 scales for all FSDP parameters in one fused step after each optimizer step")
    filter_fqns: list[str] = opt(["output"], "Module names kept in high precision ('output' also names lm_head, "
                                 "the head of a model the transformers backend builds)")
    min_dim: int = opt(1024, "Keep linear layers with a dimension below this in high precision (too small to gain)",
                       min=16)
    auto_filter: bool = opt(False, "Also keep in high precision the linears torchao's size filter for the recipe "
                                   "says are too small to gain (Llama 3 8B: wk, wv)")


@dataclass
class Lora:
    enable: bool = opt(False, "Fine-tune low-rank adapters (LoRA) on a frozen base instead of every weight")
    rank: int = opt(8, "Rank of each adapter (the inner dimension of B A)", min=1)
    alpha: float = opt(16.0, "Adapter scale numerator: output += alpha / rank * B A x", gt=0)
    dropout: float = opt(0.0, "Dropout on the adapters' input", min=0, lt=1)
    target_modules: list[str] = opt([], "Linear layers given adapters: last names (wq) or globs; empty: every block linear")
    use_rslora: bool = opt(False, "Scale by alpha / sqrt(rank) (rank-stabilised LoRA) instead of alpha / rank")
    quantize_base: str = opt("", "Store the frozen base linears in NF4 (QLoRA)", choices=("", "nf4"))


@dataclass
class Preference:
    loss: str = opt(
        "sigmoid", "With data.format = preference: sigmoid (DPO), ipo, simpo (reference-free, margin gamma) or orpo "
        "(reference-free, NLL plus beta times the odds-ratio loss)", choices=("sigmoid", "ipo", "simpo", "orpo"))
    beta: float = opt(0.1, "DPO's beta (IPO: its tau; SimPO: the reward scale; ORPO: the odds-ratio weight lambda)",
                      gt=0)
    label_smoothing: float = opt(
        0.0, "sigmoid and simpo: the probability that a pair's labels are flipped (conservative DPO)", min=0, lt=0.5)
    gamma: float = opt(0.5, "simpo: the target reward margin gamma", min=0)
    reference_path: str = opt(
        "", "The reference model: a Hugging Face folder or a weft checkpoint; empty: the run's own starting weights "
        "(under LoRA, the model with its adapters switched off)")
    precompute_reference: bool = opt(
        False, "Compute the reference's log-probabilities of every pair the run will train and validate on in a first "
        "pass, then free the reference: training holds no copy of it")
    truncation: str = opt(
        "keep_start", "A pair longer than seq_len + 1 tokens: keep_start cuts the answers' ends, keep_end cuts the "
        "prompt's start, drop skips it; a pair no rule fits is skipped; both are counted in the log",
        choices=("keep_start", "keep_end", "drop"))


# An empty stop string would end every completion at once ("\n\n" is a stop string: no strip).
_STOP_STRINGS = (lambda value: all(item != "" for item in value), "a list of non-empty strings")


@dataclass
class Sampling:
    max_completion_length: int = opt(256, "New tokens at most per completion (the stop token included)", min=1)
    temperature: float = opt(1.0, "Softmax temperature of each draw; 0: greedy (the most likely token)", min=0)
    top_p: float = opt(1.0, "Draw from the smallest set of tokens whose probabilities add up to top_p (nucleus); "
                       "1: off", gt=0, max=1)
    top_k: int = opt(0, "Draw from the top_k most likely tokens only; 0: off", min=0)
    min_p: float = opt(0.0, "Drop the tokens less likely than min_p times the most likely one; 0: off", min=0, max=1)
    seed: int = opt(0, "Seed of the draws: completion j of prompt p draws from its own generator seeded from "
                    "(seed, p, j), whatever the batch or layout", min=0, max=2**63 - 1)
    stop: list[str] = opt([], "Stop strings: a completion ends with the token that completes one (EOS and the "
                          "tokenizer's end-of-turn tokens always stop)", check=_STOP_STRINGS)


_FINITE_NUMBERS = (lambda value: all(abs(item) < float("inf") for item in value), "a list of finite numbers")


@dataclass
class Rl:
    num_generations: int = opt(8, "Completions sampled per prompt (a group); a round's completions divide by it", min=1)
    reward_functions: list[str] = opt(
        [], "Reward functions: built-ins (math_answer, format) or 'module:function' (a module on the path, or a "
        "path to a .py file), called as TRL calls them: f(prompts, completions, completion_ids, **columns)")
    reward_weights: list[float] = opt(
        [], "One weight per reward function (the reward is their weighted sum); empty: 1 each", check=_FINITE_NUMBERS)
    answer_tag: str = opt("answer", "The built-in rewards' tag: the answer is read from <answer_tag>...</answer_tag>",
                          check=_NOT_EMPTY)
    loss_type: str = opt(
        "dapo", "dapo: token sum over the optimizer step's tokens; grpo: mean of sequence means; bnpo: micro-batch "
        "token mean; dr_grpo: sum over rows x max_completion_length; cispo: clipped importance weights, "
        "gradient through log-probabilities", choices=("dapo", "grpo", "bnpo", "dr_grpo", "cispo"))
    importance_sampling_level: str = opt(
        "token", "token: a ratio per token; sequence (GSPO): each sequence's mean log-ratio at every token",
        choices=("token", "sequence"))
    epsilon: float = opt(0.2, "The ratio's lower clip: 1 - epsilon (and the upper one without epsilon_high)", min=0)
    epsilon_high: float = opt(0.0, "The ratio's upper clip, 1 + epsilon_high (cispo: the cap on the ratio); 0: "
                              "epsilon", min=0)
    beta: float = opt(0.0, "Weight of the k3 KL to the reference model; 0: no reference model", min=0)
    reference_path: str = opt(
        "", "With beta > 0: the reference, a Hugging Face folder or a weft checkpoint; empty: the run's starting "
        "weights (under LoRA, the model with its adapters off)")
    scale_rewards: str = opt(
        "group", "Advantages divided by the group's reward std (group), the round's (batch), or not (none)",
        choices=("group", "batch", "none"))
    num_iterations: int = opt(1, "Optimizer passes over each round's completions (mu)", min=1)
    steps_per_generation: int = opt(1, "Optimizer steps one generation round's completions are split over", min=1)
    mask_truncated_completions: bool = opt(
        False, "Leave completions cut at max_completion_length out of the loss")
    max_batch_sequences: int = opt(
        0, "Generation: sequences decoded together at most (a round's share runs in pieces); 0: all at once", min=0)


@dataclass
class Distillation:
    teacher_path: str = opt(
        "", "With training.objective = distillation: the teacher, a Hugging Face folder or a weft checkpoint step "
        "(of any family weft builds; the student's vocabulary)")
    teacher_flavor: str = opt(
        FROM_HF_CONFIG, f"The teacher's architecture and size: a built-in flavor, or '{FROM_HF_CONFIG}' to read them "
        "from teacher_path (its config.json, or the one its weft run recorded)", choices=(*flavors(), FROM_HF_CONFIG))
    teacher_backend: str = opt(
        "auto", "Who builds the teacher of a Hugging Face folder, as model.backend", choices=BACKENDS)
    beta: float = opt(
        1.0, "Generalized JSD's beta: 0 is KL(teacher || student), 1 KL(student || teacher), between them the "
        "divergence of each to their mixture", min=0, max=1)
    chunk_positions: int = opt(
        512, "Positions whose fp32 distributions (both models') exist at once in the divergence and its backward",
        min=1)


@dataclass
class Moe:
    bias_update_rate: float = opt(
        0.0, "MoE balancing: after each step, move each expert's routing bias by this much towards equal load "
        "(auxiliary-loss-free, as DeepSeek-V3; 1e-3 there); 0: off, routing as the checkpoint does, which a "
        "Hugging Face Llama 4 export keeps (it has no routing bias)", min=0)
    load_balance_coeff: float = opt(
        0.0, "MoE balancing: add this times Switch Transformer's load-balancing loss (1 when even) of every MoE "
        "layer to the training loss (0.01 there); 0: off", min=0)


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block and the loss")


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Recompute activations in backward to save memory", choices=("none", "full", "selective"))
    selective_option: str = opt(
        "op", "'op' saves matmul outputs and recomputes the rest; a positive N checkpoints every N-th block",
        check=(_is_op_or_positive_int, "'op' or a positive integer"))


@dataclass
class Profiling:
    enable: bool = opt(
        False, "Trace one window of steps in every profiling.freq with torch.profiler: a Chrome trace per rank, "
        "<dump_folder>/<profiling.folder>/step-N/rank-R.json.gz (N: the window's last step)")
    freq: int = opt(100, "Profile one window in every N steps; windows end at the steps divisible by N", min=1)
    warmup: int = opt(3, "Steps the profiler runs before each window's recorded steps, not recorded (0: none)", min=0)
    active: int = opt(1, "Steps recorded in each window (its last ones)", min=1)
    folder: str = opt("profile_traces", "Trace folder, relative to dump_folder", check=_NOT_EMPTY)
    record_shapes: bool = opt(False, "Record each op's input shapes in the traces")
    with_stack: bool = opt(False, "Record each op's Python stack in the traces (larger traces, slower steps)")
    enable_memory_snapshot: bool = opt(
        False, "CUDA only: record the allocator's history (Python stacks) from the first step and write a snapshot "
        "per rank every memory_snapshot_freq steps and when a training step runs out of memory, under "
        "<dump_folder>/memory_snapshot/", without_enable=True)
    memory_snapshot_freq: int = opt(100, "Write a memory snapshot every N steps", min=1, without_enable=True)
    memory_snapshot_max_entries: int = opt(
        100000, "Allocations and frees each memory snapshot keeps (the latest ones)", min=1, without_enable=True)


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False, "Train as one of several replica groups under torchft: each group is its own torchrun job, "
        "gradients are averaged across the live groups, a group that dies is left out and heals from a live peer "
        "when it comes back (pip install \"weft[ft]\")")
    replica_id: int = opt(0, "This group's index, 0 .. replica_groups - 1", min=0)
    replica_groups: int = opt(2, "How many replica groups train together (each reads its own share of the data)",
                              min=1)
    min_replica_groups: int = opt(
        1, "A step is committed only while at least this many groups take part in it; fewer: it is retried", min=1)
    lighthouse: str = opt(
        "", "The torchft lighthouse's address, http://host:port; empty: the TORCHFT_LIGHTHOUSE environment variable")
    hostname: str = opt(
        "", "The address other groups reach this group's manager at; empty: this machine's hostname")
    process_group: str = opt(
        "gloo", "Backend of the collectives across groups (nccl needs GPUs)", choices=("gloo", "nccl"))
    connect_timeout_seconds: float = opt(
        30.0, "Seconds to reach the lighthouse and the other groups' managers; no answer: exit 2 naming it", gt=0)
    quorum_timeout_seconds: float = opt(
        120.0, "Seconds a step waits for the quorum of live groups (under diloco: for the groups' next sync)", gt=0)
    timeout_seconds: float = opt(
        60.0, "Seconds a collective across groups or a heal may take before the step is left uncommitted", gt=0)
    semi_sync_method: str = opt(
        "", "'': average gradients across groups at every step; diloco: each group trains alone for sync_steps "
        "steps, then the groups average their pseudo-gradients and take an outer optimizer step",
        choices=("", "diloco"))
    sync_steps: int = opt(20, "Under diloco: inner steps between two syncs across groups (H in the paper)", min=1)
    outer_lr: float = opt(0.7, "Under diloco: the outer SGD's learning rate", gt=0)
    outer_momentum: float = opt(0.9, "Under diloco: the outer SGD's momentum", min=0, lt=1)
    outer_nesterov: bool = opt(True, "Under diloco: Nesterov momentum in the outer SGD")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    export: Export = field(default_factory=Export)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    preference: Preference = field(default_factory=Preference)
    sampling: Sampling = field(default_factory=Sampling)
    rl: Rl = field(default_factory=Rl)
    distillation: Distillation = field(default_factory=Distillation)
    moe: Moe = field(default_factory=Moe)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    profiling: Profiling = field(default_factory=Profiling)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)


