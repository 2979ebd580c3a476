"""``python -m nxhpc <command> [args]``: the same as the ``nxhpc`` console command."""
import sys

from nxhpc.cli.main import main

sys.exit(main())
