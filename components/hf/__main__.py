import sys

from weft.components.hf.cli import main

sys.exit(main())
