"""Which of transformers' text-only causal language models the transformers backend trains.

For each model_type of AutoModelForCausalLM's mapping (multimodal ones skipped), writes a tiny random
folder with transformers (2 layers, hidden 64, vocab 2048, 4 experts: the shape keys each config
class has, set where it has them), then runs `generate.py --hf <folder> --backend transformers`
greedily against transformers' `generate` (without the tokens a folder's generation config forces,
forced_bos/eos_token_id: a decoding rule, not the model), and a 2-step train.py run on text with
`--export.hf_folder`, reloaded in transformers (the folder's key set, nothing missing, its tensors).
Prints one line per family: its status and the first line of what failed.

    OMP_NUM_THREADS=1 python benchmarks/hf_families.py [model_type ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from weft import generate, train
from weft.components.config import parse_args
from weft.components.config.shipped import SHIPPED_TOKENIZER
from weft.components.data import load_tokenizer
from weft.errors import UserError

# Shape keys, set where a config class has the key: 2 layers, hidden 64, 4 heads (2 key/value heads
# of 16), a 2048 vocabulary (the shipped tokenizer's), 4 experts (top 2) with a shared one, MLA and
# linear-attention widths, small Mamba heads. DeepSeek sparse attention's indexer with 4 heads: with 2, a
# query's index scores (a ReLU of each head's products, summed) are often exactly 0 for several keys,
# ties torch's top-k breaks one way in transformers' cached generate and another in its forward.
TINY = dict(num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2, hidden_size=64, d_model=64, n_embd=64,
            intermediate_size=128, ffn_dim=128, n_inner=128, ffn_hidden_size=128, num_attention_heads=4, n_head=4,
            num_heads=4, n_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=2048, max_position_embeddings=128,
            n_positions=128, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
            num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_k=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1, num_dense_layers=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_head_dim=16, linear_num_heads=4, mamba_n_heads=4,
            mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=32, hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=2048, rotary_dim=8, index_n_heads=4, index_head_dim=16, index_topk=4,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Families whose layer kinds the generic rule (the first two kinds of layer_types) does not reach.
OVERRIDES = {"granitemoehybrid": {"layer_types": ["mamba", "attention"]}, "bamba": {"attn_layer_indices": [1]},
             "lfm2": {"layer_types": ["conv", "full_attention"]}, "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
             "gemma4_text": {"per_layer_config": {"01": {"head_dim": 32}}}}
MAX_PARAMETERS = 40_000_000  # families whose tiny config stays larger (fixed-size parts) are skipped
PROMPT = "ROMEO: But, soft!"
FP32 = ("--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3")


def text_model_types() -> list[str]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kept = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # a default config transformers itself refuses: tried below, reported there
            kept.append(model_type)
            continue
        if not (hasattr(config, "text_config") or hasattr(config, "vision_config")):
            kept.append(model_type)
    return kept


def tiny_config(model_type: str):
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    keys = {k: v for k, v in TINY.items() if k in defaults}
    for key in ("sliding_window", "attention_chunk_size"):
        if defaults.get(key):
            keys[key] = 8
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):  # two layers of the first two kinds
        if isinstance(defaults.get(key), list) and defaults[key]:
            kinds = list(dict.fromkeys(defaults[key]))
            keys[key] = (kinds * 2)[:2]
    if "kv_lora_rank" in defaults:  # MLA: a key and value head per query head, head_dim the rotary part
        keys |= {"num_key_value_heads": 4} | ({"head_dim": 8} if "head_dim" in defaults else {})
    if "per_layer_config" in defaults:
        keys["per_layer_config"] = {}
    fields = {k: v for k, v in defaults.items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(model_type, **(fields | keys | OVERRIDES.get(model_type, {})))


def check(model_type: str, root: Path) -> tuple[str, str]:
    """(status, what it found) of one family."""
    import transformers
    from safetensors.torch import load_file

    config = tiny_config(model_type)
    with torch.device("meta"):
        numel = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if numel > MAX_PARAMETERS:
        return "skipped", f"its tiny config keeps {numel:,} parameters"
    torch.manual_seed(0)
    folder = root / model_type
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = generate.main(["--hf", str(folder), "--backend", "transformers", "--prompt", PROMPT,
                              "--max-new-tokens", "8"])
    if code != 0:
        return "refused", (err.getvalue().strip().splitlines() or [f"exit {code}"])[-1]
    tokenizer = load_tokenizer(str(SHIPPED_TOKENIZER))
    ids = tokenizer.encode(PROMPT, bos=True, eos=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                    eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id,
                                    forced_bos_token_id=None, forced_eos_token_id=None)
    decoded = "decodes as transformers" if out.getvalue().rstrip("\n") == tokenizer.decode(theirs[0].tolist()) \
        else "decodes otherwise than transformers' generate"

    dump = root / f"run_{model_type}"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        losses = train.train(parse_args([
            "--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--training.steps", "2",
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
            "--no-metrics.enable_tensorboard", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path",
            str(folder), "--model.backend", "transformers", *FP32, "--export.hf_folder", "hf"]))
    source, exported = load_file(folder / "model.safetensors"), load_file(dump / "hf" / "model.safetensors")
    if sorted(source) != sorted(exported):
        return "export differs", f"{decoded}; keys missing {sorted(set(source) - set(exported))[:3]}, " \
                                 f"extra {sorted(set(exported) - set(source))[:3]}"
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(dump / "hf", output_loading_info=True)
    left = {k: sorted(v)[:3] for k, v in info.items() if v and k != "error_msgs"}
    if left:
        return "export differs", f"{decoded}; reloaded with {left}"
    state = reloaded.state_dict()
    changed = [k for k in exported if k in state and not torch.equal(state[k], exported[k])]
    if changed:
        return "export differs", f"{decoded}; transformers' reload changes {changed[:3]}"
    trained = sum(not torch.equal(source[k], exported[k]) for k in source)
    status = "works" if decoded == "decodes as transformers" else "decodes otherwise"
    return status, f"{decoded}; losses {losses[0]:.3f} -> {losses[-1]:.3f}; {trained}/{len(source)} tensors trained"


class _Timeout(Exception):
    pass


def _timeout(*_) -> None:
    raise _Timeout


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="families to try (default: every text-only causal LM)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds a family may take")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    signal.signal(signal.SIGALRM, _timeout)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as root:
        for model_type in opts.model_types or text_model_types():
            signal.alarm(opts.timeout)
            try:
                status, note = check(model_type, Path(root))
            except _Timeout:
                status, note = "timed out", f"over {opts.timeout} s"
            except UserError as e:  # train.py's one-line refusal
                status, note = "refused", str(e)
            except Exception as e:
                frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" not in f.filename]
                where = f" [{Path(frames[-1].filename).name}:{frames[-1].lineno}]" if frames else ""
                status, note = "failed", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}{where}"
            signal.alarm(0)
            counts[status] = counts.get(status, 0) + 1
            print(f"{model_type:24s} {status:17s} {note}", flush=True)
    print(", ".join(f"{status}: {n}" for status, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
