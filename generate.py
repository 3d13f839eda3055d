"""Sample text from a trained weft model (a DCP checkpoint step folder or a Hugging Face folder) with
weft's generation engine: `--prompt` prints the prompt and its continuation (`--chat`: the reply);
`--prompts FILE.jsonl --out FILE.jsonl` writes the completions of every prompt of a file, the prompts
split over torchrun's ranks (each holds the whole model), the file written once by rank 0.

Any registered family's model, built by its spec (a --hf folder's config.json, or a --checkpoint's
--flavor, by default the model its run recorded); a LoRA checkpoint's adapters are merged, --adapter
adds a PEFT folder's. The sampling flags are the [sampling] keys (docs/generation.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weft.components.checkpoint.checkpointer import (
    load_model_weights,
    model_tensor_metadata,
    require_complete_checkpoint,
)
from weft.components.config import Sampling
from weft.components.config.parser import value_rule
from weft.components.config.shipped import SHIPPED_TOKENIZER, shipped_path
from weft.components.data import DataError, HFTokenizer, load_tokenizer
from weft.components.data.prompts import Prompt, check_lengths, encode_prompt, read_prompts
from weft.components.distributed.processes import init_distributed
from weft.components.hf import load_hf_into_model, model_args_from_hf_folder
from weft.components.hf.adapters import load_peft_adapter
from weft.components.hf.export import holds_adapters
from weft.components.hf.model_files import recorded_backend, run_hf_files
from weft.components.hf.writer import ExportError
from weft.components.observe.log import logger, setup_logging
from weft.components.observe.time_left import TimeLeft, clock
from weft.errors import OneLineParser, UserError, report_user_error
from weft.generation import Completion, SamplingParams, generate
from weft.models import BACKENDS, flavors, spec_for_args
from weft.parallelisms.lora import merge_adapters
from weft.parallelisms.materialize import materialize_for_loading
from weft.parallelisms.precision import DTYPES
from weft.recipe.export import adapter_model


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
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="text to continue (after the BOS token), printed with its continuation; "
                                          "with --chat, the user message")
    prompts.add_argument("--prompts", help="JSONL file, one {\"prompt\": text or a list of chat messages} a line: "
                                           "the completions of each go to --out")
    parser.add_argument("--out", help="with --prompts: the JSONL file written, one line per prompt in input order, "
                                      "once every prompt is done (an existing file is replaced whole)")
    parser.add_argument("--chat", action="store_true", help="render --prompt with the tokenizer's chat template and "
                        "print the assistant's reply, stopping at the end of its turn")
    parser.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    parser.add_argument("-n", type=int, default=1, help="completions per prompt (default 1)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="sequences (prompts x n) decoded together at most (default 32)")
    _add_sampling_flags(parser)
    parser.add_argument("--adapter", default=None,
                        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) to add to the base")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="dtype of the weights and compute (default: bfloat16 on a GPU, float32 on the CPU)")
    opts = parser.parse_args(argv)
    _check_flags(parser, opts)
    return opts


# The [sampling] keys as flags (help and bounds from the schema), with the command line's own defaults:
# greedy and 100 tokens, as generate.py always had. --max-new-tokens is --max-completion-length's old name.
_SAMPLING_FIELDS = {f.name: f for f in fields(Sampling)}
_SAMPLING_FLAGS = {"max_completion_length": ("--max-completion-length", "--max-new-tokens"),
                   "temperature": ("--temperature",), "top_p": ("--top-p",), "top_k": ("--top-k",),
                   "min_p": ("--min-p",), "seed": ("--seed",), "stop": ("--stop",)}
_FLAG_DEFAULTS = {"max_completion_length": 100, "temperature": 0.0}


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling", "the keys of the [sampling] config section (docs/generation.md)")
    for name, flags in _SAMPLING_FLAGS.items():
        f = _SAMPLING_FIELDS[name]
        default = _FLAG_DEFAULTS.get(name, f.default if name != "stop" else [])
        kind = {"type": f.type} if name != "stop" else {"action": "append", "metavar": "TEXT"}
        repeat = " (repeat the flag for several)" if name == "stop" else ""
        group.add_argument(*flags, dest=name, default=default, **kind,
                           help=f"{f.metadata['help']}{repeat} (default {default!r})")


def _check_flags(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """Each sampling flag within its [sampling] key's bounds, and the flags that go together."""
    for name, flags in _SAMPLING_FLAGS.items():
        value = getattr(opts, name)
        if (rule := value_rule(_SAMPLING_FIELDS[name], value)) is not None:
            parser.error(f"{flags[0]}: {rule}, got {value!r}")
    for flag, value in (("-n", opts.n), ("--batch-size", opts.batch_size)):
        if value < 1:
            parser.error(f"{flag}: must be >= 1, got {value}")
    if opts.prompt == "":
        parser.error("--prompt: empty; expected the text to continue")
    if (opts.prompts is None) != (opts.out is None):
        parser.error("--prompts and --out go together: the prompts file, and the JSONL file its completions go to")
    if opts.prompts is not None and (opts.chat or opts.system is not None):
        parser.error("--chat and --system apply to --prompt; a --prompts line gives chat messages as its prompt")
    if opts.out is not None and (Path(opts.out).is_dir() or not Path(opts.out).parent.is_dir()):
        parser.error(f"--out: {opts.out} must be a file in an existing folder")


def main(argv: list[str] | None = None, prog: str = "generate.py") -> int:
    """Command line entry point (`weft generate`): prints the prompt and its continuation, or writes
    the completions of a prompts file; under torchrun the prompts are split over the ranks."""
    opts = _parse_args(argv, prog)
    joined = not dist.is_initialized()  # the process group this call joins (under torchrun), and leaves
    try:
        device = init_distributed()
        return _generate(opts, device)
    except UserError as e:
        return report_user_error(e)
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def _generate(opts: argparse.Namespace, device: torch.device) -> int:
    tokenizer = load_tokenizer(_tokenizer_path(opts))
    prompts = read_prompts(opts.prompts, tokenizer) if opts.prompts else [_prompt(opts, tokenizer)]
    params = SamplingParams(**{name: getattr(opts, name) for name in _SAMPLING_FLAGS} | {"stop": tuple(opts.stop)})
    model = _model(opts, tokenizer, device, prompts, params)
    stop_ids = sorted(set(getattr(tokenizer, "stop_ids", ())) | {tokenizer.eos_id})
    run = partial(generate, model, params=params, n=opts.n, stop_token_ids=stop_ids, decode=tokenizer.decode,
                  max_batch_sequences=opts.batch_size)
    if opts.prompts is None:
        for completion in run([prompts[0].token_ids])[0]:
            ids = _without_stop_id(completion, stop_ids)
            print(tokenizer.decode(ids if opts.chat else text_ids(prompts[0].token_ids + ids, tokenizer)))
        return 0
    write_completions(run, prompts, opts.n, tokenizer, stop_ids, Path(opts.out))
    return 0


def _prompt(opts: argparse.Namespace, tokenizer) -> Prompt:
    """--prompt encoded: text after BOS, or with --chat, a user message (after --system's)."""
    if not opts.chat:
        return encode_prompt(opts.prompt, tokenizer, "--prompt")
    if not isinstance(tokenizer, HFTokenizer) or tokenizer.chat_template is None:
        raise DataError(f"--chat: the tokenizer '{_tokenizer_path(opts)}' has no chat template "
                        "(a Hugging Face folder whose tokenizer_config.json has one)")
    messages = ([{"role": "system", "content": opts.system}] if opts.system else []) + [
        {"role": "user", "content": opts.prompt}]
    return encode_prompt(messages, tokenizer, "--prompt")


def _model(opts: argparse.Namespace, tokenizer, device: torch.device, prompts: list[Prompt],
           params: SamplingParams) -> nn.Module:
    """The model of --checkpoint or --hf (with --adapter's LoRA layers) on `device`, after the
    tokenizer's vocabulary and every prompt's length are checked against its hyper-parameters."""
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
    check_lengths(prompts, params.max_completion_length, args.max_seq_len)
    dtype = DTYPES[opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if adapted:
        model = cast_model(model, dtype, device)
    else:
        model = load_model(args, hf=hf, checkpoint=checkpoint, device=device, dtype=dtype)
    if opts.adapter is not None:  # base + adapter: LoRA layers compute W x + scaling * B A x
        load_peft_adapter(model, opts.adapter)
    return model


def _without_stop_id(completion: Completion, stop_ids: Collection[int]) -> list[int]:
    """A completion's tokens without the stop token closing it (a stop string's tokens stay)."""
    ids = completion.token_ids
    return ids[:-1] if completion.finish_reason == "stop" and ids and ids[-1] in stop_ids else ids


def write_completions(run: Callable, prompts: list[Prompt], n: int, tokenizer, stop_ids: Collection[int],
                      out: Path) -> None:
    """Complete this rank's share of `prompts` (a contiguous block; `run`, the engine on the model,
    gets their global indices, so the draws do not depend on the ranks), logging progress, then
    write every prompt's line to `out` on rank 0, in input order, atomically."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    setup_logging(rank)
    first, last = len(prompts) * rank // world, len(prompts) * (rank + 1) // world
    mine = prompts[first:last]
    logger.info(f"generate: {len(prompts)} prompts x {n} completions" +
                (f" over {world} ranks ({len(mine)} prompts on rank 0)" if world > 1 else ""))
    # under torchrun every rank calls the engine, one with no prompts too: the ranks step together
    results = run([p.token_ids for p in mine], prompt_indices=list(range(first, last)), progress=_progress(len(mine) * n))
    lines = [json.dumps({"prompt": prompt.value, "completions": [
        {"text": tokenizer.decode(_without_stop_id(c, stop_ids)), "token_ids": c.token_ids,
         "finish_reason": c.finish_reason} for c in completions]}, ensure_ascii=False)
        for prompt, completions in zip(mine, results)]
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(lines, gathered, dst=0)
        lines = [line for block in gathered or [] for line in block]
    if rank == 0:
        _write_atomically(out, "".join(line + "\n" for line in lines))
        logger.info(f"generate: {len(lines)} lines written to {out}")


def _progress(total: int) -> Callable[[int, int], None]:
    """The engine's progress callback: a log line per batch, completions done, tokens/s, time left."""
    clock_start = time.perf_counter()
    time_left = TimeLeft(0, total)

    def report(done: int, tokens: int) -> None:
        elapsed, left = time_left.at_log(done)
        logger.info(f"generate: {done}/{total} completions, {tokens / max(time.perf_counter() - clock_start, 1e-9):,.1f} "
                    f"tokens/s, {clock(elapsed)} elapsed, {clock(left)} left")
    return report


def _write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it renamed over it: `path` is either as it
    was or whole."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


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
