"""``python -m nxhpc.models list|show|make``: the model-directory CLI (``nxhpc.models.cli``)."""
from nxhpc.models.cli import main

raise SystemExit(main())
