"""``nxhpc <command> [args]``: one entry point for every nxhpc CLI (``nxhpc blockrun tiny 2``
is ``python -m nxhpc.blockrun tiny 2`` is ``nxhpc-blockrun tiny 2``).

Owns the command table (:data:`COMMANDS`: name -> the CLI module whose ``main(argv)`` runs it)
and the top-level ``--help`` (the commands and the shared exit-code table). Must not: parse a
command's own options (each CLI does) or import a command's module before it is chosen.
"""
from __future__ import annotations

import importlib
import sys

from nxhpc.cli.codes import DEFAULT_TEXT, Exit, codes_epilog
from nxhpc.cli.frame import write_or_drop

__all__ = ["COMMANDS", "main"]

#: command -> (module with ``main(argv) -> int``, one-line summary)
COMMANDS = {
    "blockrun": ("nxhpc.blockrun", "run DiT blocks of a model from the block input and grade "
                                   "the output"),
    "denoise": ("nxhpc.denoise", "one call of the whole Z-Image transformer from a GGUF"),
    "sample": ("nxhpc.sample", "the Z-Image-Turbo sampling loop (caption features -> latents "
                               "[-> PNG])"),
    "encode": ("nxhpc.encode", "a prompt -> Z-Image's caption features (the Qwen3 text "
                               "encoder from a GGUF)"),
    "decode": ("nxhpc.decode", "latents -> a PNG through the FLUX autoencoder's decoder"),
    "generate": ("nxhpc.generate", "a prompt -> a PNG: text encoder, Z-Image sampling, "
                                   "autoencoder"),
    "models": ("nxhpc.models.cli", "list, inspect and generate model directories"),
    "ddp": ("nxhpc.ddp", "bit-reproducible data-parallel training on the Q16 tape"),
}


def _help() -> str:
    width = max(map(len, COMMANDS))
    cmds = "\n".join(f"  {k:<{width}}  {v[1]}" for k, v in COMMANDS.items())
    return (f"usage: nxhpc <command> [args]   (nxhpc <command> --help for its options; "
            f"nxhpc --version)\n\n"
            f"commands:\n{cmds}\n\n"
            + codes_epilog({c: DEFAULT_TEXT[c] for c in Exit})
            + "\n  (every command uses this one table; its --help lists the codes it can "
              "return)\n")


def _version() -> str:
    """``nxhpc X.Y.Z (kernels: the ISA they run, of those this CPU has)``: for a bug report.
    The ISA is ``cpu_features()["best_isa"]`` (``NXHPC_DISABLE_SIMD`` / ``NXHPC_MAX_ISA``
    applied)."""
    import nxhpc
    from nxhpc.runtime.checks import SettingError
    try:
        isas = (f"{nxhpc.cpu_features()['best_isa']}, of "
                f"{', '.join(nxhpc.supported_isas())}")
    except (ImportError, SettingError) as e:  # unbuilt, or a bad NXHPC_MAX_ISA: still a version
        isas = f"not loaded: {e}"
    return f"nxhpc {nxhpc.__version__} (kernels: {isas})\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        write_or_drop(sys.stdout, _version())
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        # `nxhpc --help | head`: quiet, exit 0, as a command's own --help
        write_or_drop(sys.stdout if argv else sys.stderr, _help())
        return 0 if argv else int(Exit.USAGE)
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        write_or_drop(sys.stderr, f"nxhpc: error: unknown command {cmd!r}; choose from "
                                  f"{', '.join(COMMANDS)}\n")
        return int(Exit.USAGE)
    try:
        mod = importlib.import_module(COMMANDS[cmd][0])
    except KeyboardInterrupt:         # Ctrl-C while the command's modules load (before its
        return int(Exit.SIGINT)       # frame handles signals): the code, not a traceback
    return int(mod.main(rest))


if __name__ == "__main__":
    sys.exit(main())
