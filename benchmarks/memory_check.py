"""The dry run's memory estimate against the peak a real train.py run allocates on the GPU.

For one config (a train_configs file plus command-line overrides, exactly as train.py takes
them), optionally with fewer layers than its flavor (`--layers`, to fit an 8B-shaped model on
one GPU): first the dry run's estimate (recipe/dry_run.py), then a real `train.train` of a few
steps in this process, then `torch.cuda.max_memory_allocated`, which the training loop's
metrics also log. With `--job.simulate_world_size N` among the overrides the real run is rank 0
of an N-rank job (fake process group: real per-rank shards, compute and memory). Prints one
line: estimate, measured, ratio; the issue's target is within 10%.

    python benchmarks/memory_check.py --layers 4 -- --job.config_file llama8b \\
        --job.simulate_world_size 8 --training.steps 4
    python benchmarks/memory_check.py --layers 2 -- --job.config_file llama8b \\
        --parallelism.dp_shard 1 --float8.enable --activation_checkpoint.mode full --training.steps 4

On a CPU it runs the same code and reports the estimate only (there is no allocator peak to
compare with; tests/components/test_memory.py measures CPU peaks with the profiler instead).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist

from weft import models, train
from weft.components.config import parse_args
from weft.components.memory import GIB
from weft.recipe.dry_run import dry_run


def with_layers(flavor: str, layers: int) -> tuple[models.ModelSpec, ...]:
    """The registry's specs with `flavor` cut to its first `layers` blocks: copies, the registered
    flavors (and every other user of them) stay as they are."""
    spec = models.spec_for_flavor(flavor)
    cut = replace(spec, flavors={**spec.flavors, flavor: replace(spec.flavors[flavor], n_layers=layers)})
    return tuple(cut if s is spec else s for s in models.MODEL_SPECS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="blocks of the flavor to keep (default: all)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py's arguments, after --")
    opts = parser.parse_args()
    argv = [a for a in opts.train_args if a != "--"]
    cfg = parse_args(argv + ["--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"])
    specs = with_layers(cfg.model.flavor, opts.layers) if opts.layers else models.MODEL_SPECS
    with mock.patch.object(models, "MODEL_SPECS", specs):  # the dry run and the run build the cut model
        estimate = dry_run(parse_args(argv + ["--job.dry_run"]))
        if dist.is_initialized():
            dist.destroy_process_group()  # the dry run's fake group; the real run makes its own
        train.train(cfg)
    command = " ".join(["python benchmarks/memory_check.py"] + sys.argv[1:])
    if not torch.cuda.is_available():
        print(f"estimate {estimate.peak / GIB:.2f} GiB ({estimate.peak_phase}); no GPU, nothing measured: {command}")
        return
    measured = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    print(f"estimate {estimate.peak / GIB:.2f} GiB ({estimate.peak_phase}), measured max_memory_allocated "
          f"{measured / GIB:.2f} GiB (reserved {reserved / GIB:.2f} GiB), estimate / measured "
          f"{estimate.peak / measured:.3f} on {torch.cuda.get_device_name()}: {command}")


if __name__ == "__main__":
    main()
