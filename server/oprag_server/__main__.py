"""``python -m oprag_server [serve options]`` is ``oprag serve [serve options]``."""

import sys

from oprag_client.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
