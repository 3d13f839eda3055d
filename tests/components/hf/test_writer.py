"""components/hf/writer.py holds about one layer's tensors plus one file's buffer, never the model:
the tensors a source hands it are counted while their storage is alive (weakref finalizers)."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import load_file

from weft.components.hf.writer import live_source, model_adapters, write_model
from weft.models.llama import ModelArgs, Transformer
from weft.parallelisms import ParallelizeOptions, parallelize
from weft.parallelisms.lora import LoRAOptions
from weft.parallelisms.materialize import materialize

ARGS = ModelArgs(dim=64, n_layers=16, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, max_seq_len=64)


@pytest.mark.parametrize("merged", [False, True])
def test_the_writer_holds_one_layer_and_one_file_not_the_model(tmp_path, merged):
    with torch.device("meta"):
        model = Transformer(ARGS)
    model = materialize(parallelize(model, None, ParallelizeOptions(lora=LoRAOptions(rank=4, alpha=8.0))), "cpu", seed=0)
    shapes, source = live_source(model)
    if not merged:  # the base alone
        shapes = {name: shape for name, shape in shapes.items() if ".lora_" not in name}
    alive, peak = [0], [0]

    def counted(names):
        for name, tensor in source(names):
            tensor = tensor.clone()  # a tensor of the source's own, as a gather or a DCP read makes
            alive[0] += tensor.nbytes
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(tensor.untyped_storage(), lambda n=tensor.nbytes: alive.__setitem__(0, alive[0] - n))
            yield name, tensor
            del tensor

    total = sum(p.nbytes for p in model.parameters())
    largest = max(p.nbytes for p in model.parameters())
    max_file = total // 16
    write_model(tmp_path / "out", ARGS, shapes, counted, adapters=model_adapters(model) if merged else None,
                max_shard_bytes=max_file)
    files = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(files) > 10 and all(sum(t.nbytes for t in load_file(str(f)).values()) <= max(max_file, largest)
                                   for f in files)
    # at most one file's buffer plus the layer being written (W, A, B): far below the model. Unmerged,
    # the buffer holds the source's tensors themselves, so the count reaches about one file.
    assert peak[0] <= max_file + 3 * largest and peak[0] < total / 5
    assert merged or peak[0] > max_file / 2

