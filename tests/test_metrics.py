import torch

from components.metrics import count_parameters, device_peak_flops, flops_per_token
from models.llama import LLAMA_FLAVORS, Transformer


def test_flops_per_token_llama3_8b_by_hand():
    args = LLAMA_FLAVORS["llama3_8b"]
    n = 8_030_261_248
    # 6 x (parameters minus the 128256 x 4096 embedding) + 12 x 32 layers x 32 heads x 128 x 8192
    want = 6 * (n - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, n, 8192) == want
    assert want == 57_914_449_920  # about 58 GFLOPs per token


def test_tied_embedding_counts_as_a_matmul():
    args = LLAMA_FLAVORS["llama3_1b"]
    with torch.device("meta"):
        n = count_parameters(Transformer(args))
    assert flops_per_token(args, n, 1) == 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim


def test_cpu_has_no_peak_flops():
    assert device_peak_flops(torch.device("cpu")) is None
