"""nxhpc's one CLI layer: exit codes, errors, argparse types, the signal frame, the report writer.

Modules: :mod:`nxhpc.cli.codes` (the :class:`~nxhpc.cli.codes.Exit` enum, the exception -> code
table, the ``--help`` block of codes), :mod:`nxhpc.cli.args` (argparse types),
:mod:`nxhpc.cli.frame` (:func:`~nxhpc.cli.frame.run_cli`: parse -> call under the signal
frame -> code), :mod:`nxhpc.cli.report` (key=value / ``--json``, atomic saves, the verdict) and
:mod:`nxhpc.cli.main` (the ``nxhpc <command>`` entry point). Every CLI module (``blockrun``,
``denoise``, ``sample``, ``encode``, ``models``, ``ddp``) is parse -> call -> report on these
and imports no private name of another CLI.

Importing this package first repairs one start-up trap (:func:`_repair_shadowed_package`): run
from the directory that holds a checkout named ``nxhpc`` (``git clone ... nxhpc; pip install -e
nxhpc; python -m nxhpc.blockrun tiny``), the clone folder is found first on ``sys.path`` and
becomes a namespace package ``nxhpc`` (setuptools' editable finder only runs after the path
finder), so ``nxhpc/__init__.py`` never ran. The real package is then loaded from this file's
location. Must not: import numpy, the kernels or any model code at import time.
"""
from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["main"]


def _repair_shadowed_package() -> None:
    """If ``sys.modules['nxhpc']`` is a namespace package (no ``__file__``), replace it with the
    regular package this file belongs to, keeping the submodules already imported."""
    ns = sys.modules.get("nxhpc")
    if ns is None or getattr(ns, "__file__", None) is not None:
        return
    pkg_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    init = os.path.join(pkg_dir, "__init__.py")
    if not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("nxhpc", init,
                                                  submodule_search_locations=[pkg_dir])
    if spec is None or spec.loader is None:
        return
    real = importlib.util.module_from_spec(spec)
    for name, mod in list(sys.modules.items()):     # nxhpc.cli (this), nxhpc.blockrun, ...
        if name.startswith("nxhpc.") and name.count(".") == 1:
            setattr(real, name.split(".", 1)[1], mod)
    sys.modules["nxhpc"] = real
    try:
        spec.loader.exec_module(real)
    except BaseException:
        sys.modules["nxhpc"] = ns
        raise


_repair_shadowed_package()


def main(argv=None) -> int:
    """``nxhpc <command> ...`` (see :mod:`nxhpc.cli.main`)."""
    from nxhpc.cli.main import main as _main
    return _main(argv)
