"""``python -m nxhpc.ddp``: the command-line spelling of :mod:`nxhpc.train.ddp` (kept stable).

Owns nothing but the entry point; the trainer, the ring and the Q16 tape live in ``nxhpc.train``.
"""
from nxhpc.train.ddp import main

if __name__ == "__main__":
    raise SystemExit(main())
