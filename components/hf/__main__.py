import sys

from components.hf.cli import main

sys.exit(main())
