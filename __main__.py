"""`python -m weft <command> ...` (and `torchrun ... -m weft train ...`): the `weft` command (cli.py)."""

import sys

from weft.cli import main

sys.exit(main())
