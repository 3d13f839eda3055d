"""`generate`: completions of a batch of prompts by a model as it is laid out for training, with a
KV cache (its spec's `Backend.decoding`).

Each batch of rows is left-padded to its longest prompt and prefilled in one forward; then each step
feeds every running row's last token (positions counting from its first real token) and draws the
next one. A row that stopped (a stop token id, a stop string, the length limit) takes no new token:
its slot is fed as padding, which nothing attends to. Results come back in input order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from weft.generation.batches import plan_batches
from weft.generation.cpu_linears import weights_first_linears
from weft.generation.errors import GenerationError
from weft.generation.layouts import distributed, gathered, most, refuse_layout, sequence_multiple
from weft.generation.sampling import SamplingParams, completion_generator, next_tokens
from weft.models import spec_for_args


@dataclass(frozen=True)
class Completion:
    """One completion: the generated tokens (the stop token, or the token ending a stop string,
    included), the log-probability of each (log softmax(logits / temperature) over the whole
    vocabulary; temperature 0: of the logits), and why it ended: "stop" or "length"."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class _Row:
    """One completion under way: its prompt, its generator, what it generated so far."""

    prompt: list[int]
    generator: torch.Generator
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


def generate(model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int = 1,
             stop_token_ids: Collection[int] = (), decode: Callable[[list[int]], str] | None = None,
             max_batch_sequences: int | None = None, max_batch_tokens: int | None = None,
             prompt_indices: Sequence[int] | None = None, compile: bool = False,
             progress: Callable[[int, int], None] | None = None) -> list[list[Completion]]:
    """[prompt][j]: the n completions of each prompt (token ids). Completion j of prompt p draws from
    its own CPU generator seeded from (params.seed, prompt_indices[p], j) (default indices 0..P-1),
    so it depends on no batch, batch size or layout. stop_token_ids (EOS among them) and params.stop
    (stop strings, matched in `decode(token_ids)` of the completion) end a completion. Batches hold at
    most max_batch_sequences rows and max_batch_tokens KV-cache slots (rows x (longest prompt +
    max_completion_length)). compile: the decode step runs torch.compile'd (weft's cache keeps its shapes
    static: one graph for every step). `progress(completions done, tokens generated)` is called after each batch. Under several
    ranks every rank calls it (a rank's prompts may be none) and all take the same forwards.
    The model runs in eval mode and no_grad, and is left as it was."""
    prompts = [list(prompt) for prompt in prompts]
    indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
    _check(model, prompts, params, n, decode, max_batch_sequences, max_batch_tokens, indices)
    refuse_layout(model)
    decoding = spec_for_args(model.args).backend.decoding
    rows = [_Row(prompt, completion_generator(params.seed, index, j), [], [])
            for prompt, index in zip(prompts, indices) for j in range(n)]
    batches = plan_batches([len(row.prompt) for row in rows], params.max_completion_length, max_batch_sequences,
                           max_batch_tokens)
    device = next(iter(model.parameters())).device
    modes = {module: module.training for module in model.modules()}
    model.eval()
    # what runs each decode step: weft's cache keeps its shapes, one graph; transformers' grows, a dynamic one
    stepper = torch.compile(model) if compile else model
    done = generated = 0
    try:
        with torch.no_grad(), gathered(model), (weights_first_linears(model) if not compile else nullcontext()):
            for b in range(most(len(batches), device)):  # a rank with fewer batches joins the others' forwards
                batch = [rows[i] for i in batches[b]] if b < len(batches) else [_Row([0], torch.Generator(), [], [])]
                _decode(batch, model, stepper, decoding, params, set(stop_token_ids), decode, device)
                if b < len(batches):
                    done, generated = done + len(batch), generated + sum(len(row.token_ids) for row in batch)
                    if progress is not None:
                        progress(done, generated)
    finally:
        for module, training in modes.items():
            module.train(training)
    completions = [Completion(row.token_ids, row.logprobs, row.finish_reason) for row in rows]
    return [completions[p * n:(p + 1) * n] for p in range(len(prompts))]


def _decode(rows: list[_Row], model: nn.Module, stepper: nn.Module, decoding, params: SamplingParams,
            stop_ids: set[int], decode: Callable[[list[int]], str] | None, device: torch.device) -> None:
    """Complete one batch of rows in place: prefill, then a token per step (by `stepper`: the model,
    or the model compiled) until every row (of every rank) stopped."""
    multiple = sequence_multiple(model)  # under tensor parallelism each forward's tokens split evenly
    longest = -(-max(len(row.prompt) for row in rows) // multiple) * multiple
    tokens = torch.zeros(len(rows), longest, dtype=torch.long)
    valid = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, longest - len(row.prompt):] = torch.tensor(row.prompt)
        valid[i, longest - len(row.prompt):] = True
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    tokens, positions, valid = tokens.to(device), positions.to(device), valid.to(device)
    cache = decoding.start(model, len(rows), longest + (params.max_completion_length - 1) * multiple)
    try:
        logits = _whole(decoding.forward(model, tokens, positions, valid, cache))
        positions = positions[:, -1:]
        for _ in range(params.max_completion_length):
            running = [i for i, row in enumerate(rows) if row.finish_reason is None]
            tokens = torch.zeros(len(rows), multiple, dtype=torch.long)  # the new token last, padding before it
            if running:
                drawn, logprobs = next_tokens(logits[running], params, [rows[i].generator for i in running])
                tokens[running, -1] = drawn
                for i, token, logprob in zip(running, drawn.tolist(), logprobs.tolist()):
                    _append(rows[i], token, logprob, params, stop_ids, decode)
            still = torch.tensor([row.finish_reason is None for row in rows])
            if not most(int(still.any()), device):
                break
            positions = positions + 1
            valid = torch.zeros(len(rows), multiple, dtype=torch.bool)
            valid[:, -1] = still
            logits = _whole(decoding.forward(stepper, tokens.to(device), positions.expand(-1, multiple),
                                             valid.to(device), cache))
    finally:
        decoding.finish(model, cache)


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """The logits as a plain tensor (tensor parallelism's loss_parallel leaves them split by vocabulary)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _append(row: _Row, token: int, logprob: float, params: SamplingParams, stop_ids: set[int],
            decode: Callable[[list[int]], str] | None) -> None:
    """Add a drawn token to its row and end the row where it stops it or reaches the length limit."""
    row.token_ids.append(token)
    row.logprobs.append(logprob)
    if token in stop_ids or (params.stop and any(stop in decode(row.token_ids) for stop in params.stop)):
        row.finish_reason = "stop"
    elif len(row.token_ids) == params.max_completion_length:
        row.finish_reason = "length"


def _check(model: nn.Module, prompts: list[list[int]], params: SamplingParams, n: int, decode,
           max_batch_sequences: int | None, max_batch_tokens: int | None, indices: list[int]) -> None:
    """Refuse (GenerationError) any argument `generate` cannot run with, before anything runs."""
    if not isinstance(params, SamplingParams):
        raise GenerationError(f"params must be SamplingParams, got {type(params).__name__}")
    if not prompts and not distributed():  # a rank may have none: it joins the others' forwards
        raise GenerationError("prompts is empty: expected at least one prompt")
    for name, value in (("n", n), ("max_batch_sequences", max_batch_sequences), ("max_batch_tokens", max_batch_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise GenerationError(f"{name} must be an integer >= 1, got {value!r}")
    if params.stop and decode is None:
        raise GenerationError(f"stop strings {list(params.stop)} need decode (token ids -> text), got None")
    if len(indices) != len(prompts):
        raise GenerationError(f"prompt_indices has {len(indices)} entries; expected one per prompt ({len(prompts)})")
    max_seq_len = model.args.max_seq_len
    vocab = getattr(model.args, "vocab_size", None)
    for p, prompt in enumerate(prompts):
        if not prompt:
            raise GenerationError(f"prompt {indices[p]} is empty: expected at least one token id")
        if len(prompt) + params.max_completion_length > max_seq_len:
            raise GenerationError(f"prompt {indices[p]} has {len(prompt)} tokens; with max_completion_length "
                                  f"{params.max_completion_length} that is {len(prompt) + params.max_completion_length} "
                                  f"positions, beyond the model's max_seq_len {max_seq_len}")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < (vocab or 2**63)]
        if bad:
            raise GenerationError(f"prompt {indices[p]} holds token id {bad[0]!r}, outside the vocabulary [0, {vocab})")
        if max_batch_tokens is not None and len(prompt) + params.max_completion_length > max_batch_tokens:
            raise GenerationError(f"max_batch_tokens {max_batch_tokens} cannot hold prompt {indices[p]} "
                                  f"({len(prompt)} tokens) plus max_completion_length {params.max_completion_length}")
