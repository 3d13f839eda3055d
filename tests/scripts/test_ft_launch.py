"""The fault-tolerance launchers (scripts/ft_groups.sh, slurm_ft.sbatch) with stub
`torchrun`, `torchft_lighthouse`, `scontrol` and `srun` on PATH: each torchrun command they would
run is read back by torchrun's own argument parser, its training arguments by weft's, and checked
against what the groups need (one replica_id each, their own dump folders, one lighthouse)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from torch.distributed.run import get_args_parser

from weft.components.config import parse_args

LAUNCH = Path(__file__).resolve().parents[2] / "scripts"

STUBS = {
    "torchrun": 'echo "torchrun gpus=$CUDA_VISIBLE_DEVICES node=$SLURM_NODEID $(printf "%q " "$@")"',
    "torchft_lighthouse": 'echo "lighthouse $*"',
    "scontrol": 'printf "gpu-07\\ngpu-08\\n"',
    # srun: the lighthouse's line, or the group command once per node, as SLURM runs it there
    "srun": 'if [[ "$*" == *torchft_lighthouse* ]]; then echo "srun $*"; exit; fi\n'
            'while [[ "$1" == --* ]]; do shift; done\n'
            'for node in 0 1; do SLURM_NODEID=$node "$@"; done',
}


def run(tmp_path: Path, script: str, *args: str, **env: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    environment = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[07-08]",
                   "SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "h100:8", "SLURM_SUBMIT_DIR": str(tmp_path),
                   "WEFT_DIR": str(tmp_path), **env}
    out = subprocess.run(["bash", str(LAUNCH / script), *args], env=environment, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def groups(lines: list[str]) -> list[tuple[str, object, object]]:
    """(the torchrun stub's prefix, torchrun's arguments, weft's config) of each group's command."""
    found = []
    for line in lines:
        if line.startswith("torchrun "):
            prefix, _, argv = line.partition(" ")[2].partition(" node=")
            node, _, argv = argv.partition(" ")
            args = get_args_parser().parse_args(shlex.split(argv))
            assert args.training_script == "train.py"
            found.append((f"{prefix} node={node}", args, parse_args(args.training_script_args)))
    return found


def test_local_groups_each_own_id_folder_and_gpus(tmp_path):
    lines = run(tmp_path, "ft_groups.sh", "debug_model", "--training.steps", "7",
                REPLICA_GROUPS="3", PROCS="2", DUMP="/runs/x", MIN_GROUPS="2")
    assert [line for line in lines if line.startswith("lighthouse")] == [
        "lighthouse --bind 127.0.0.1:29510 --min_replicas 2 --join_timeout_ms 60000 --heartbeat_timeout_ms 5000"]
    found = groups(lines)
    assert sorted(prefix for prefix, _, _ in found) == ["gpus=0,1 node=", "gpus=2,3 node=", "gpus=4,5 node="]
    by_id = {cfg.fault_tolerance.replica_id: (args, cfg) for _, args, cfg in found}
    assert sorted(by_id) == [0, 1, 2]
    for g, (args, cfg) in by_id.items():
        ft = cfg.fault_tolerance
        assert (args.nproc_per_node, args.max_restarts, args.standalone) == ("2", 3, True)
        assert ft.enable and (ft.replica_groups, ft.min_replica_groups) == (3, 2)
        assert ft.lighthouse == "http://127.0.0.1:29510" and cfg.job.dump_folder == f"/runs/x/group_{g}"
        assert cfg.training.steps == 7


def test_slurm_one_group_per_node_and_a_lighthouse_on_the_first(tmp_path):
    lines = run(tmp_path, "slurm_ft.sbatch")
    assert [line for line in lines if line.startswith("srun")] == [
        "srun --nodes=1 --ntasks=1 --nodelist=gpu-07 --overlap torchft_lighthouse --bind [::]:29510 "
        "--min_replicas 1 --join_timeout_ms 60000 --heartbeat_timeout_ms 5000"]
    found = groups(lines)
    assert sorted(cfg.fault_tolerance.replica_id for _, _, cfg in found) == [0, 1]
    for _, args, cfg in found:
        ft = cfg.fault_tolerance
        assert (args.nproc_per_node, args.max_restarts) == ("8", 3)
        assert (ft.replica_groups, ft.lighthouse) == (2, "http://gpu-07:29510")
        assert cfg.job.dump_folder == f"./outputs/group_{ft.replica_id}" and cfg.checkpoint.enable
