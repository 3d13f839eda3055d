"""The frame every decoder family shares: token embedding → blocks → RMSNorm → output projection,
the rotary table beside them, the forward's walk through whatever modules a pipeline stage holds,
order-independent weight initialisation, and the TP plan and pipeline units the transforms ask it
for (its family's spec's). A family's `Transformer` subclasses `Decoder` and gives it its block; the
forward hands each block the rotations and the document mask (a `PreNormBlock`'s inputs), and a
family whose blocks take more writes its own `forward` around `run_blocks` (Llama 4)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import torch
from torch import nn

from weft.layers.init import param_seed, trunc_normal
from weft.models.common.moe import MoE
from weft.models.common.norms import RMSNorm
from weft.models.common.rotary import rope_rotations
from weft.models.common.spec import ModelSpec

# Parameters that write into the residual stream (attention's output, the feed-forwards' down
# projections, routed experts' included): initialised with std scaled by 1/√(2·n_layers).
RESIDUAL_PROJECTIONS = ("wo.weight", "w2.weight", "experts.w2")


class PreNormBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)).
    A family's block makes the four modules (Llama: a SwiGLU; Qwen3: a SwiGLU or an MoE)."""

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, document_ids: torch.Tensor | None = None,
                mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotations, document_ids=document_ids, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Token embedding → n_layers blocks (`block(i)` makes block i) → RMSNorm → output projection to
    logits. `args` is any family's hyper-parameters with vocab_size, dim, n_layers, norm_eps,
    tie_embeddings and what `rope_rotations` reads."""

    spec: ModelSpec | None = None  # the family's, set by `decoder_spec`
    # (h, output) -> what the forward returns instead of output(h), set for one call by `head.forward_head`:
    # a loss that projects the final hidden states chunk by chunk (on-policy distillation)
    head_hook: Callable[[torch.Tensor, nn.Module], object] | None = None

    def __init__(self, args, block: Callable[[int], nn.Module]):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keeps parameter names ("layers.3.attention.wq.weight") stable if blocks are removed.
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Complex: `model.to(dtype)` would keep only its real part; cast parameters, not the model.
        rotations = rope_rotations(args, device=self.tok_embeddings.weight.device)
        self.register_buffer("rope_rotations", rotations, persistent=False)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: [batch, seq] → logits [batch, seq, vocab], each block handed the rotations and the
        document mask (`PreNormBlock`'s inputs); a family whose blocks take more writes its own.

        positions ([seq] or [batch, seq]) give each token's place in its sequence; they default
        to 0..seq-1 and differ when the sequence is split across devices, or when several
        documents are packed into one sample (each restarts at 0). document_ids ([batch, seq])
        make attention block-causal: no token attends to another document. A pipeline stage
        without the embedding is given the previous stage's hidden state as `tokens`, and must
        be given positions when that is split along the sequence.
        """
        if positions is None:
            rotations = self.rope_rotations[: tokens.shape[1]]
        else:
            rotations = self.rope_rotations[positions]
        # Packed documents: the attention core's mask is built once here, outside the (compiled,
        # checkpointed) blocks, and every block uses it.
        mask = None
        if document_ids is not None and len(self.layers):
            core = self.attention_core()
            mask = core.document_mask(document_ids) if hasattr(core, "document_mask") else None
        return self.run_blocks(tokens, rotations, document_ids=document_ids, mask=mask)

    def tensor_parallel_plan(self, **options) -> dict:
        """The plan `apply_tp` splits this model by: its family's `ModelSpec.tp_plan` (`options`:
        loss_parallel, float8_linears, float8_styles)."""
        return self.spec.tp_plan(self, **options)

    def pipeline_units(self) -> list[list[str]]:
        """The modules a pipeline split may not cut, in order: its family's `ModelSpec.pipeline_units`."""
        return self.spec.pipeline_units(self)

    def attention_core(self) -> nn.Module:
        """The first block's attention core (context parallelism may have swapped it): the one that
        builds the masks every block then uses."""
        return next(iter(self.layers.values())).attention.core

    def run_blocks(self, tokens: torch.Tensor, *block_inputs, **block_kwargs) -> torch.Tensor:
        """Embedding, every block (each given the hidden state, then `block_inputs` and
        `block_kwargs`), norm and output: logits, or what a pipeline stage passes on.

        A pipeline stage (parallelisms/pipeline.py) lacks the modules other stages own (None):
        without the embedding its input is the previous stage's hidden state, and without the
        output it returns its own."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, *block_inputs, **block_kwargs)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h) if self.head_hook is None else self.head_hook(h, self.output)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, names: Collection[str] | None = None) -> None:
        """Fill every parameter (or those of `names`) and buffer on the device it lives on.

        Each weight is drawn whole from its own generator, seeded by (seed, parameter name), so
        its values depend on nothing else: not on the order of initialisation, and not on how the
        parameter is later split across devices (a split parameter is filled with its slice of the
        full draw). Linear weights: truncated normal, std 0.02, with the residual projections
        (wo, w2, the experts' down projection) scaled by 1/√(2·n_layers) (GPT-2); embeddings: std 1
        (1/√dim when tied); output: std 1/√dim; norms 1. MoE layers' balancing state: zero.
        """
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if names is not None and name not in names:
                continue
            if name.endswith("norm.weight"):
                param.copy_(torch.ones(param.shape, dtype=param.dtype, device=param.device))
                continue
            if name == "tok_embeddings.weight":
                std = self.args.dim**-0.5 if self.args.tie_embeddings else 1.0
            elif name == "output.weight":
                std = self.args.dim**-0.5
            elif name.endswith(RESIDUAL_PROJECTIONS):
                std = residual_std
            else:
                std = 0.02
            param.copy_(trunc_normal(param.shape, std, param.dtype, param.device, param_seed(seed, name)))
        self.rope_rotations.copy_(rope_rotations(self.args, device=self.rope_rotations.device))
        for module in self.modules():
            if isinstance(module, MoE):  # balancing state: no bias, nothing counted
                module.expert_bias.zero_()
                module.tokens_per_expert.zero_()
