"""``python -m oprag_server [serve options]`` is ``oprag serve [serve options]``."""

import sys

from .cli import main

sys.exit(main(prog="python -m oprag_server"))
