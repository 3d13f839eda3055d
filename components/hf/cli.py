"""`python -m weft.components.hf export ...`: export a DCP checkpoint to a Hugging Face folder."""

from __future__ import annotations

import math

from weft.components.hf.export import export_run_checkpoint
from weft.errors import OneLineParser, UserError, report_user_error
from weft.models import flavors


def main(argv: list[str] | None = None, prog: str = "python -m weft.components.hf") -> int:
    """Parse the command line, export, and return the exit status (2 for a user's mistake)."""
    parser = OneLineParser(prog=prog, description="Hugging Face interop: export a DCP checkpoint to a folder.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    export = commands.add_parser("export", help="DCP checkpoint step folder -> Hugging Face folder of its family (LlamaForCausalLM, Qwen3ForCausalLM, ...)")
    export.add_argument("--checkpoint", required=True, help="DCP step folder, e.g. outputs/checkpoint/step-1000")
    export.add_argument("--flavor", choices=list(flavors()),
                        help="model flavor it was trained as (default: what the run recorded in <dump_folder>/hf_files)")
    export.add_argument("--out", required=True, help="new (or empty) output folder")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the weights")
    export.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    opts = parser.parse_args(argv)
    if not (math.isfinite(opts.max_shard_gb) and opts.max_shard_gb > 0):
        parser.error(f"--max-shard-gb: expected a positive number, got {opts.max_shard_gb}")
    try:
        export_run_checkpoint(opts.checkpoint, opts.out, flavor=opts.flavor, dtype=opts.dtype,
                              max_shard_bytes=int(opts.max_shard_gb * 2**30))
    except UserError as e:
        return report_user_error(e)
    print(f"exported {opts.checkpoint} ({opts.flavor or 'as recorded by the run'}, {opts.dtype}) to {opts.out}")
    return 0
