"""Context parallelism: load-balanced layout, exact attention and gradients, model parity, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing import assert_close

from weft.layers.attention import CausalAttention
from weft.models.llama import ModelArgs, Transformer
from weft.parallelisms.cp import ContextParallelAttention, apply_cp, load_balanced_indices, shard_sequence

from tests.support.dist_utils import run_distributed

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_load_balanced_indices_partition_the_sequence_into_mirrored_chunks(cp):
    seq_len = 48
    chunk = seq_len // (2 * cp)
    shards = [load_balanced_indices(seq_len, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(seq_len))
    for r, shard in enumerate(shards):
        assert shard.dtype == torch.int64
        assert torch.equal(shard[:chunk], torch.arange(r * chunk, (r + 1) * chunk))
        assert torch.equal(shard[chunk:], torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
    causal_work = {int((shard + 1).sum()) for shard in shards}  # query at position p sees p + 1 keys
    assert len(causal_work) == 1


def test_load_balanced_indices_rejects_indivisible_length():
    with pytest.raises(ValueError, match=r"divisible by 2·cp = 8, got seq_len 30"):
        load_balanced_indices(30, 4, 0)


# ---------------------------------------------------------------------------------------------
# Attention core: exact output and gradients against single-device SDPA
# ---------------------------------------------------------------------------------------------


def _attention_parity_worker(seq_len: int) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    generator = torch.Generator().manual_seed(0)
    batch, n_heads, n_kv_heads, head_dim = 2, 8, 2, 16
    q = torch.randn(batch, n_heads, seq_len, head_dim, generator=generator)
    k = torch.randn(batch, n_kv_heads, seq_len, head_dim, generator=generator)
    v = torch.randn(batch, n_kv_heads, seq_len, head_dim, generator=generator)
    grad_out = torch.randn(batch, n_heads, seq_len, head_dim, generator=generator)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    expected.backward(grad_out)

    (q_local, k_local, v_local, grad_local), positions = shard_sequence(mesh, q, k, v, grad_out, seq_dim=2)
    local = [t.requires_grad_() for t in (q_local, k_local, v_local)]
    # Under CommDebugMode (a TorchDispatchMode, like FlopCounterMode): K and V travel together in
    # one all-gather forward and come back in one reduce-scatter backward.
    with CommDebugMode() as comm:
        out = ContextParallelAttention(mesh)(*local)
        out.backward(grad_local)
    assert comm.get_total_counts() == 2

    assert_close(out, expected[:, :, positions], **TOLERANCE)
    for name, mine, reference in zip("qkv", local, full):
        expected_grad = reference.grad[:, :, positions]
        assert_close(mine.grad, expected_grad, **TOLERANCE, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("cp, seq_len", [(2, 32), (4, 64)])
def test_attention_matches_single_device_sdpa_with_grouped_query_heads(cp, seq_len):
    run_distributed(_attention_parity_worker, cp, seq_len)


# ---------------------------------------------------------------------------------------------
# Whole model
# ---------------------------------------------------------------------------------------------


def _model_parity_worker(seq_len: int) -> None:
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model = Transformer(TINY)
    model.init_weights(seed=0)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (2, seq_len), generator=generator)
    labels = torch.randint(0, TINY.vocab_size, (2, seq_len), generator=generator)

    expected_logits = reference(tokens)
    F.cross_entropy(expected_logits.flatten(0, 1), labels.flatten()).backward()

    apply_cp(model, mesh)
    (local_tokens, local_labels), positions = shard_sequence(mesh, tokens, labels)
    logits = model(local_tokens, positions)
    F.cross_entropy(logits.flatten(0, 1), local_labels.flatten()).backward()
    assert_close(logits, expected_logits[:, positions], rtol=1e-5, atol=1e-5)

    for (name, param), expected_param in zip(model.named_parameters(), reference.parameters()):
        grad = param.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        assert_close(grad / cp, expected_param.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    # Packed documents: the core's masks are built once per micro-batch (not per block), and the
    # logits equal the single-device model's with the same documents.
    docs = (torch.arange(seq_len) >= seq_len // 3).long() + (torch.arange(seq_len) >= seq_len // 2).long()
    docs = docs.expand(2, seq_len)
    expected_logits = reference(tokens, document_ids=docs)
    (local_tokens, local_docs), positions = shard_sequence(mesh, tokens, docs)
    builds, build = [], ContextParallelAttention.document_mask
    ContextParallelAttention.document_mask = lambda self, ids: builds.append(1) or build(self, ids)
    try:
        logits = model(local_tokens, positions, document_ids=local_docs)
    finally:
        ContextParallelAttention.document_mask = build
    assert len(builds) == 1 and TINY.n_layers > 1
    assert_close(logits, expected_logits[:, positions], rtol=1e-5, atol=1e-5)


def test_transformer_with_cp_matches_single_device_logits_and_gradients():
    """Causal, and with packed documents (their masks built once per micro-batch)."""
    run_distributed(_model_parity_worker, 2, 32)


def _compiled_model_worker(seq_len: int) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    eager = apply_cp(Transformer(TINY), mesh)
    eager.init_weights(seed=0)
    compiled = copy.deepcopy(eager)
    for block in compiled.layers.values():
        block.forward = torch.compile(block.forward, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, TINY.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))
    (local_tokens,), positions = shard_sequence(mesh, tokens)  # builds the masks compiled code needs
    logits = compiled(local_tokens, positions)  # first, so that no eager forward builds them
    expected = eager(local_tokens, positions)
    expected.square().mean().backward()
    logits.square().mean().backward()
    assert_close(logits, expected, **TOLERANCE)
    for mine, reference in zip(compiled.parameters(), eager.parameters()):
        assert_close(mine.grad, reference.grad, **TOLERANCE)


def test_transformer_with_cp_compiles_with_fullgraph_blocks():
    run_distributed(_compiled_model_worker, 2, 32)


# ---------------------------------------------------------------------------------------------
# Errors: one line, identical on every rank, raised before any collective
# ---------------------------------------------------------------------------------------------


class SlidingWindowAttention(CausalAttention):
    """A core with a mask of its own, which context parallelism must not silently replace."""


def _error_worker() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    attention = ContextParallelAttention(mesh)
    def heads(n_heads: int, seq_len: int) -> torch.Tensor:
        return torch.zeros(1, n_heads, seq_len, 8)

    attempts = {
        "indivisible": lambda: shard_sequence(mesh, torch.zeros(2, 30)),
        "odd": lambda: attention(heads(4, 3), heads(2, 3), heads(2, 3)),
        "mismatch": lambda: attention(heads(4, 4), heads(2, 6), heads(2, 6)),
        "no_core": lambda: apply_cp(nn.Sequential(nn.Linear(4, 4)), mesh),
        "subclass": lambda: apply_cp(nn.ModuleDict({"core": SlidingWindowAttention()}), mesh),
    }
    messages = {}
    for case, attempt in attempts.items():
        with pytest.raises(ValueError) as error:
            attempt()
        messages[case] = str(error.value)
    dist.barrier()  # every rank got here: none is left waiting inside a collective
    return messages


def test_errors_are_raised_identically_on_every_rank():
    rank0, rank1 = run_distributed(_error_worker, 2)
    assert rank0 == rank1
    assert all("\n" not in message for message in rank0.values())
    assert "divisible by 2·cp = 4, got seq_len 30" in rank0["indivisible"]
    assert "got q 3, k 3, v 3" in rank0["odd"]
    assert "got q 4, k 6, v 6" in rank0["mismatch"]
    assert "found no attention to make context-parallel" in rank0["no_core"]
    assert "core (SlidingWindowAttention)" in rank0["subclass"]


def test_positions_are_made_once_per_shape_not_copied_each_micro_batch():
    """Under CP every micro-batch needs the same positions: shard_sequence hands back one tensor
    on the batch's device (no host-to-device copy per micro-batch), equal to load_balanced_indices."""
    class Mesh:  # what shard_sequence reads of a CP mesh
        def size(self):
            return 2

        def get_local_rank(self):
            return 1

    batches = [torch.arange(32).reshape(2, 16) + i for i in range(3)]
    results = [shard_sequence(Mesh(), batch) for batch in batches]
    assert all(positions is results[0][1] for _, positions in results)
    assert torch.equal(results[0][1], load_balanced_indices(16, 2, 1))
    for (shards, _), batch in zip(results, batches):
        assert torch.equal(shards[0], batch[:, load_balanced_indices(16, 2, 1)])
