"""scripts/slurm_train.sbatch under a fake SLURM: stub `scontrol` and `srun` on PATH, the
environment sbatch gives a job. The torchrun command srun would run is read back by torchrun's own
argument parser, and its training arguments by weft's."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from torch.distributed.run import get_args_parser

from weft.components.config import parse_args

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/slurm_train.sbatch"

STUBS = {
    # `scontrol show hostnames <list>`: the nodes, one a line, as SLURM expands the list
    "scontrol": 'test "$1 $2 $3" = "show hostnames gpu-[07-08]" && printf "gpu-07\\ngpu-08\\n"',
    # srun: where it runs, what environment it passes on, and its command line, quoted
    "srun": 'echo "cwd=$PWD"; echo "share=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE omp=$OMP_NUM_THREADS"; '
            'for a in "$@"; do printf "%q " "$a"; done; echo',
}


def run_script(tmp_path: Path, **env: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    slurm = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_NNODES": "2",
             "SLURM_JOB_ID": "4242", "SLURM_GPUS_PER_NODE": "h100:8", "SLURM_SUBMIT_DIR": str(tmp_path)}
    out = subprocess.run(["bash", str(SCRIPT)], env={**slurm, **env}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_one_torchrun_per_node_meets_on_the_first_node(tmp_path):
    cwd, environment, command = run_script(tmp_path)
    assert cwd == f"cwd={tmp_path}"
    assert environment == "share=1 omp=8"
    argv = shlex.split(command)
    assert argv[:3] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "torchrun"]
    args = get_args_parser().parse_args(argv[3:])
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("2", "8", 3)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "gpu-07:29500", "4242")
    assert args.training_script == "train.py"
    cfg = parse_args(args.training_script_args)
    assert Path(cfg.job.config_file).stem == "llama8b" and cfg.checkpoint.enable


def test_port_restarts_and_folder_can_be_overridden(tmp_path):
    weft = tmp_path / "weft"
    weft.mkdir()
    cwd, _, command = run_script(tmp_path, RDZV_PORT="29611", MAX_RESTARTS="0", WEFT_DIR=str(weft),
                                 SLURM_GPUS_PER_NODE="4")
    args = get_args_parser().parse_args(shlex.split(command)[3:])
    assert (args.nproc_per_node, args.max_restarts, args.rdzv_endpoint) == ("4", 0, "gpu-07:29611")
    assert cwd == f"cwd={weft}"
