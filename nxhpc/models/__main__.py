"""``python -m nxhpc.models list|show|make``: the model-directory CLI."""
from nxhpc.models import main

raise SystemExit(main())
