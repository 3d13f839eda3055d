"""Sample text from a trained weft model: a DCP checkpoint step folder or a Hugging Face folder.

    python generate.py --checkpoint outputs/debug_moe/checkpoint/step-100 --flavor debugmodel_moe --prompt "ROMEO:"
    python generate.py --hf llama_hf --prompt "ROMEO:" --temperature 0.8 --top-k 50 --seed 0
    python generate.py --hf Llama-3.1-8B-Instruct --chat --prompt "Who wrote Hamlet?"

Any registered family's model, built by its spec (a --hf folder's config.json, or a --checkpoint's
--flavor, by default the model its run recorded); --chat renders a user message with the chat
template and stops at the end of the assistant's turn. One process, one device (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weft.components.checkpoint.checkpointer import (
    load_model_weights,
    model_tensor_metadata,
    require_complete_checkpoint,
)
from weft.components.config.shipped import SHIPPED_TOKENIZER, shipped_path
from weft.components.data import DataError, HFTokenizer, load_tokenizer
from weft.components.hf import load_hf_into_model, model_args_from_hf_folder
from weft.components.hf.adapters import load_peft_adapter
from weft.components.hf.export import holds_adapters
from weft.components.hf.model_files import recorded_backend, run_hf_files
from weft.components.hf.writer import ExportError
from weft.errors import OneLineParser, UserError, report_user_error
from weft.models import BACKENDS, flavors, spec_for_args
from weft.parallelisms.lora import merge_adapters
from weft.parallelisms.materialize import materialize_for_loading
from weft.parallelisms.precision import DTYPES
from weft.recipe.export import adapter_model


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else a draw from softmax(logits / temperature) over the top_k."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float().cpu() / temperature
    candidates = torch.arange(logits.numel())
    if top_k is not None and top_k < logits.numel():
        logits, candidates = logits.topk(top_k)
    return int(candidates[torch.multinomial(logits.softmax(-1), 1, generator=generator)])


@torch.inference_mode()
def sample(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    *,
    eos_id: int | None = None,
    stop_ids: Collection[int] = (),
) -> list[int]:
    """Continue `prompt_ids` by up to max_new_tokens tokens; return the new tokens only.

    temperature 0 picks the most likely token (greedy); otherwise tokens are drawn from the
    softmax of logits / temperature, restricted to the top_k most likely (None: all), with
    `generator` (a CPU generator) for reproducible draws. Stops after `eos_id` if given, or after
    any of `stop_ids` (e.g. a chat model's end-of-turn tokens). The
    context is the last max_seq_len tokens.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    model.eval()
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-model.args.max_seq_len:]], device=device)
        token = _next_token(logits(model, context)[0, -1], temperature, top_k, generator)
        ids.append(token)
        if token == eos_id or token in stop_ids:
            break
    return ids[len(prompt_ids):]


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for token ids [batch, seq], called as its spec says (weft's or transformers')."""
    forward = spec_for_args(model.args).backend.forward
    return model(ids) if forward is None else forward(model, ids)


def _parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    parser = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="DCP checkpoint step folder, e.g. outputs/checkpoint/step-1000")
    source.add_argument("--hf", help="Hugging Face folder (config.json + safetensors) of a causal LM: one weft "
                                     "implements (LlamaForCausalLM, Llama4ForCausalLM, ...) or any transformers has")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="who builds the --hf model: weft, transformers, or auto (weft where it implements the "
                             "model_type, else transformers); as train.py's model.backend")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="with the transformers backend, run the modeling code a folder ships (auto_map)")
    parser.add_argument("--flavor", default=None, choices=list(flavors()),
                        help="model flavor of --checkpoint (default: the model its run recorded, else debugmodel; "
                             "a --hf folder brings its own config)")
    parser.add_argument("--tokenizer", default=None,
                        help="SentencePiece model file or Hugging Face tokenizer folder (default: the --hf folder "
                             "if it has a tokenizer.json, else assets/tokenizer/shakespeare.model)")
    parser.add_argument("--prompt", default="", help="text to continue (after the BOS token); with --chat, the user message")
    parser.add_argument("--chat", action="store_true", help="render --prompt with the tokenizer's chat template and "
                        "print the assistant's reply, stopping at the end of its turn")
    parser.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument("--adapter", default=None,
                        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) to add to the base")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="dtype of the weights and compute (default: bfloat16 on a GPU, float32 on the CPU)")
    opts = parser.parse_args(argv)
    if opts.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {opts.max_new_tokens}")
    if not (math.isfinite(opts.temperature) and opts.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0, got {opts.temperature}")
    if not 0 <= opts.seed < 2**63:
        parser.error(f"--seed must be in [0, 2**63), got {opts.seed}")
    if opts.top_k is not None and opts.top_k < 1:
        parser.error(f"--top-k must be >= 1, got {opts.top_k}")
    return opts


def main(argv: list[str] | None = None, prog: str = "generate.py") -> int:
    """Command line entry point (`weft generate`); prints the prompt and its continuation."""
    opts = _parse_args(argv, prog)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _generate(opts, device)


def _generate(opts: argparse.Namespace, device: torch.device) -> int:
    try:
        tokenizer = load_tokenizer(_tokenizer_path(opts))
        if opts.chat and (not isinstance(tokenizer, HFTokenizer) or tokenizer.chat_template is None):
            raise DataError(f"--chat: the tokenizer '{_tokenizer_path(opts)}' has no chat template "
                            "(a Hugging Face folder whose tokenizer_config.json has one)")
        hf, checkpoint = opts.hf, opts.checkpoint
        adapted = checkpoint is not None and holds_adapters(require_complete_checkpoint(checkpoint))
        if adapted:
            if opts.flavor is not None:
                raise ExportError(f"--flavor: {checkpoint} holds a LoRA run's adapters; the model is the one "
                                  "its run's config.toml names")
            # base + adapters, built as `weft export` builds them, merged as its merged folder holds them
            model = merge_adapters(adapter_model(Path(checkpoint))[0])
            args = model.args
        elif hf is not None:
            args = model_args_from_hf_folder(hf, opts.backend, opts.trust_remote_code)
        else:
            # Names and shapes before building the model: a flavor larger than the checkpoint
            # would otherwise allocate the whole (wrong) model first, perhaps more than fits.
            args, source = checkpoint_model(checkpoint, opts.flavor)
            with torch.device("meta"):
                shapes = spec_for_args(args).build(args)
            model_tensor_metadata(require_complete_checkpoint(checkpoint), shapes, source)
        if tokenizer.vocab_size > args.vocab_size:
            raise DataError(f"--tokenizer: its vocabulary ({tokenizer.vocab_size}) is larger than the model's "
                            f"({args.vocab_size})")
        dtype = DTYPES[opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
        if adapted:
            model = cast_model(model, dtype, device)
        else:
            model = load_model(args, hf=hf, checkpoint=checkpoint, device=device, dtype=dtype)
        if opts.adapter is not None:  # base + adapter: LoRA layers compute W x + scaling * B A x
            load_peft_adapter(model, opts.adapter)
    except UserError as e:
        return report_user_error(e)

    generator = torch.Generator().manual_seed(opts.seed)
    if opts.chat:
        messages = ([{"role": "system", "content": opts.system}] if opts.system else []) + [
            {"role": "user", "content": opts.prompt}]
        prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
        stops = tokenizer.stop_ids
        new_ids = sample(model, prompt_ids, opts.max_new_tokens, opts.temperature, opts.top_k, generator, stop_ids=stops)
        print(tokenizer.decode(new_ids[:-1] if new_ids and new_ids[-1] in stops else new_ids))
        return 0
    prompt_ids = tokenizer.encode(opts.prompt, bos=True, eos=False)
    new_ids = sample(model, prompt_ids, opts.max_new_tokens, opts.temperature, opts.top_k, generator,
                     eos_id=tokenizer.eos_id)
    print(tokenizer.decode(text_ids(prompt_ids + new_ids, tokenizer)))
    return 0


def text_ids(ids: list[int], tokenizer) -> list[int]:
    """`ids` without a leading BOS and a closing EOS: a Hugging Face folder's tokenizer.json decodes
    them as text ("<s>"), SentencePiece drops them; the printed text is the same from either."""
    start = 1 if ids and ids[0] == tokenizer.bos_id else 0
    end = len(ids) - 1 if len(ids) > start and ids[-1] == tokenizer.eos_id else len(ids)
    return ids[start:end]


def checkpoint_model(checkpoint: str, flavor: str | None) -> tuple[Any, str]:
    """(the hyper-parameters of the model in a DCP step folder, their source for messages): those
    of `flavor` if given, else of the config.json its run recorded, else debugmodel's."""
    recorded = run_hf_files(checkpoint) if flavor is None else None
    if recorded is not None:
        return (model_args_from_hf_folder(recorded, recorded_backend(recorded)),
                f"the model its run recorded in {recorded / 'config.json'}")
    flavor = flavor or "debugmodel"
    return flavors()[flavor], f"--flavor {flavor}"


def load_model(args: Any, *, hf: str | None, checkpoint: str | None, device: torch.device,
               dtype: torch.dtype) -> nn.Module:
    """The model of its family's spec with the weights of a Hugging Face folder (`hf`) or a DCP
    step folder, read on the CPU, cast to `dtype`, then moved to `device`. Only parameters are cast:
    the rotary table is complex, and stays so."""
    with torch.device("meta"):  # no initialisation to pay for: every weight is loaded
        model = spec_for_args(args).build(args)
    materialize_for_loading(model, "cpu")  # buffers as the model fills them (a checkpoint's are read below)
    if hf is not None:
        load_hf_into_model(model, hf)
    else:
        load_model_weights(model, checkpoint)
    return cast_model(model, dtype, device)


def cast_model(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`model` with its parameters in `dtype` (its buffers as they are: the rotary table is
    complex), moved to `device`."""
    for param in model.parameters():
        param.data = param.data.to(dtype)  # in place of the data: tied parameters stay one tensor
    return model.to(device)


def _tokenizer_path(opts: argparse.Namespace) -> str:
    """--tokenizer, else the --hf folder's own tokenizer, else the shipped Shakespeare model."""
    if opts.tokenizer:
        return shipped_path(opts.tokenizer)
    if opts.hf is not None and (Path(opts.hf) / "tokenizer.json").is_file():
        return opts.hf
    return str(SHIPPED_TOKENIZER)


if __name__ == "__main__":
    sys.exit(main())
