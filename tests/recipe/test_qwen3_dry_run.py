"""The dry run of every published Qwen3 flavor prints its parameter counts (total, and active per
token for Qwen3-MoE) as issue 37 gives them from transformers and the model cards."""

import pytest

from weft import train
from tests.models.test_qwen3 import PUBLISHED


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_the_dry_run_prints_the_published_parameter_counts(flavor, capsys):
    argv = ["--job.config_file", "debug_model", "--model.flavor", flavor, "--job.dry_run",
            "--job.dry_run_world_size", "8", "--job.dry_run_device_memory_gib", "100000"]
    assert train.main(argv) == 0
    total, active = PUBLISHED[flavor]
    counts = f"{total:,} parameters" + (f" ({active:,} active per token)" if active != total else "")
    assert f"model {flavor}: {counts}, " in capsys.readouterr().out
