"""``python -m nxhpc.models list | show <id> | make <id> [...]`` (``nxhpc-models``, ``nxhpc
models``): the model-directory CLI.

Owns the CLI only: parse -> the registry / synthetic generator (``nxhpc.models``) -> print.
Exit codes (:data:`EXIT_CODES`, the numbers of :class:`nxhpc.cli.codes.Exit`: 0 ok, 2 usage, 3
not found, 4 bad model file, 5 missing tensor, 7 out of memory, 9 models directory unusable,
130 / 143 signals; no traceback for any of them), the signal frame and the argparse types are
:mod:`nxhpc.cli`'s.
Must not: import the compiled kernels (it works in a source tree whose extension is not
built), or import another CLI.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.cli.codes import Exit, UsageError, codes_epilog
from nxhpc.cli.frame import run_cli
from nxhpc.dit.grade import one_line
from nxhpc.formats.weights import block_geometry
from nxhpc.runtime.checks import check_input_file
from nxhpc.models.modeldir import (FIXTURES_FILE, VAE_FILE, check_models_root,
                                   check_replaceable, write_failed)
from nxhpc.models.qwen3_files import TEXT_ENCODER_KIND
from nxhpc.models.registry import (BUILTINS, DEFAULT_MODEL_ID, builtin_ids,
                                   builtin_current, builtin_spec, ensure_builtin, models_dir,
                                   one_gguf, open_model, resolve_model, resolve_vae,
                                   stderr_progress)
from nxhpc.models.synthetic import SyntheticSpec, make_synthetic
from nxhpc.models.vae_files import VAE_KIND

__all__ = ["main", "build_parser", "EXIT_CODES"]

PROG = "models"

#: The codes this CLI returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "ok",
    Exit.USAGE: "usage error (bad arguments, dims that do not make a runnable block, an "
                "existing --out without --force)",
    Exit.NOT_FOUND: "model not found (id, directory or .gguf file)",
    Exit.BAD_INPUT: "bad model file (malformed or unsupported GGUF or fixtures, an existing "
                    "directory that is not a model)",
    Exit.MISSING: "a tensor or fixture is missing from the model",
    Exit.MODELS_DIR: "the models directory ($NXHPC_MODELS / --models-dir, or --out's parent) "
                     "cannot take the model: not a directory, not writable, or full (nothing "
                     "is left behind)",
    Exit.SHM: "not enough memory: an allocation failed while a model was made (the "
              "address-space limit, ulimit -v, or the machine's memory; nothing half-written "
              "is left behind)",
    Exit.OUTPUT: "stdout's reader went away (`| head`): nothing more is printed",
    Exit.INTERNAL: None,
    Exit.SIGHUP: "hung up by SIGHUP (nothing half-written is left behind)",
    Exit.SIGINT: "interrupted by Ctrl-C / SIGINT (nothing half-written is left behind)",
    Exit.SIGTERM: "terminated by SIGTERM (nothing half-written is left behind)",
}


def _cmd_list(args: argparse.Namespace) -> int:
    root = Path(args.models_dir) if args.models_dir else models_dir()
    print(f"models dir: {one_line(str(root))}")
    print(f"{'id':<11} {'variant':<8} {'D':>5} {'heads':>7} {'FFN':>6} {'L':>2} {'T':>4} "
          f"{'weights(Q8_0)':>13}  status")
    for mid in builtin_ids("block"):
        spec = BUILTINS[mid]
        c = spec.config()
        elems, nbytes = block_geometry("Q8_0")
        q8 = spec.weights_bytes_f32() // 4 // elems * nbytes
        heads = f"{c.n_heads}/{c.n_kv_heads}" if c.n_kv_heads != c.n_heads else str(c.n_heads)
        st = "generated" if builtin_current(root / mid, spec) else "generated on first use"
        flag = " (default)" if mid == DEFAULT_MODEL_ID else ""
        print(f"{mid:<11} {c.variant:<8} {c.dim:>5} {heads:>7} {c.ffn_dim:>6} "
              f"{c.n_layers:>2} {spec.n_tokens:>4} {q8 / 1e6:>10.1f} MB  {st}{flag}")
    print(f"{'denoiser':<13} {'D':>5} {'heads':>7} {'FFN':>6} {'L+refiners':>10} {'cap':>5} "
          f"{'tokens':>6}  layout        status   (python -m nxhpc.denoise)")
    for mid in builtin_ids("denoiser"):
        dspec = BUILTINS[mid]
        c = dspec.config()
        st = "generated" if builtin_current(root / mid, dspec) else "generated on first use"
        print(f"{mid:<13} {c.dim:>5} {c.n_heads:>7} {c.ffn_dim:>6} "
              f"{f'{c.n_layers}+{c.n_noise_refiner}+{c.n_context_refiner}':>10} {c.cap_dim:>5} "
              f"{dspec.n_tokens:>6}  {dspec.layout:<13} {st}")
    print("zimage-dit-<N>l: real Z-Image dims with N = 1..30 main layers (comfyui-q8_0); "
          "zimage-dit-<N>l-q4km: the same weights in the q4_k_m layout")
    print(f"{'text encoder':<13} {'D':>5} {'heads':>7} {'FFN':>6} {'layers':>10} {'vocab':>5} "
          f"{'ctx':>6}  types         status   (python -m nxhpc.encode)")
    for mid in builtin_ids(TEXT_ENCODER_KIND):
        tspec = BUILTINS[mid]
        c = tspec.config()
        st = "generated" if builtin_current(root / mid, tspec) else "generated on first use"
        heads = f"{c.n_heads}/{c.n_kv_heads}x{c.head_dim}"
        print(f"{mid:<13} {c.dim:>5} {heads:>7} {c.ffn:>6} "
              f"{f'{c.n_layers} (runs {c.layers_needed})':>10} {c.vocab:>5} "
              f"{c.context_length:>6}  {tspec.matrix_type:<13} {st}")
    print(f"{'autoencoder':<13} {'channels':<16} {'z':>3} {'dtype':>5}  status   "
          f"(python -m nxhpc.decode)")
    for mid in builtin_ids("vae"):
        vspec = BUILTINS[mid]
        st = "generated" if builtin_current(root / mid, vspec) else "generated on first use"
        chans = "/".join(str(c) for c in vspec.block_out_channels)
        print(f"{mid:<13} {chans:<16} {vspec.latent_channels:>3} {vspec.dtype:>5}  {st}")
    if root.is_dir():
        others = sorted(p.name for p in root.iterdir() if p.is_dir()
                        and not p.name.startswith(".") and p.name not in BUILTINS
                        and builtin_spec(p.name) is None)
        for o in others:                  # a name with a line break, quoted: one row
            print(f"{one_line(o):<11} (directory)")
    return 0


def _describe_text_encoder(d: Path | None, gpath: Path) -> str | None:
    """The report of a Qwen3 text-encoder GGUF (config from its metadata, checked against
    every tensor; tensor types; the tokenizer), or None when the file is not a qwen3 one.
    Reads metadata and shapes only (no kernels, no weights decoded)."""
    from nxhpc.formats.gguf_io import GGUFFile
    from nxhpc.qwen3.config import infer_config
    from nxhpc.qwen3.tokenizer import Qwen3Tokenizer
    with GGUFFile(gpath) as g:
        if g.architecture != "qwen3":
            return None
        table = {n: (g.shape(n), g.type_name(n)) for n in g.names()}
        cfg = infer_config(g.metadata, table, str(g.path))
        tok = Qwen3Tokenizer.from_gguf(g)
        by_type: dict[str, int] = {}
        for n in g.names():
            by_type[g.type_name(n)] = by_type.get(g.type_name(n), 0) + 1
        types = ", ".join(f"{t} {n}" for t, n in sorted(by_type.items()))
        size = gpath.stat().st_size / 1e6
        return "\n".join([
            f"model: {d if d is not None else '(no directory)'}",
            f"text encoder: {cfg.summary()}",
            f"  features    hidden_states[-2]: [L, {cfg.dim}] float32 (python -m nxhpc.encode)",
            f"gguf: {g.path} ({size:.1f} MB), v{g.version}, arch 'qwen3', {len(g.names())} "
            f"tensors ({types})",
            f"tokenizer: {tok.vocab_size} tokens, {len(tok.special_ids)} special"])


def _describe_vae(path: str | os.PathLike) -> str:
    """The report of an autoencoder checkpoint (an ``ae.safetensors`` file or a diffusers VAE
    directory): the decoder's config inferred from its tensors, the layout, dtype and file.
    Reads the header only (no kernels, no weights decoded)."""
    from nxhpc.vae.files import open_vae_file
    with open_vae_file(path) as f:
        cfg = f.config
        n = sum(1 for t in f.st.names() if t.startswith(f.prefix + "decoder."))
        size = f.path.stat().st_size / 1e6
        return "\n".join([
            f"model: {Path(path)}",
            f"autoencoder: FLUX-style decoder, channels {list(cfg.block_out_channels)}, "
            f"z={cfg.latent_channels}, {cfg.out_channels} output channels, "
            f"{cfg.upscale}x upscale, {f.dtype}",
            f"  decode      [{cfg.latent_channels}, h, w] -> [{cfg.out_channels}, "
            f"{cfg.upscale}h, {cfg.upscale}w] float32 (python -m nxhpc.decode)",
            f"file: {f.path} ({size:.1f} MB), {f.layout} layout, {n} decoder tensors"])


def _is_vae(model: str, root_arg: str | None) -> bool:
    """Whether ``model`` names an autoencoder: a built-in one, a ``.safetensors`` file, or a
    directory (or a name under the models directory) holding ``ae.safetensors``."""
    spec = builtin_spec(model) if os.sep not in model else None
    if spec is not None:
        return spec.kind == VAE_KIND
    root = Path(root_arg) if root_arg else models_dir()
    p = Path(model)
    for cand in (p, root / model):
        if cand.is_file() and cand.suffix == ".safetensors" and cand.name != FIXTURES_FILE:
            return True
        if cand.is_dir() and (cand / VAE_FILE).is_file():
            return True
    return False


def _cmd_show(args: argparse.Namespace) -> int:
    if args.gguf is not None and os.path.exists(args.gguf):   # a FIFO, /dev/null: not "missing"
        check_input_file(args.gguf, "--gguf", "a .gguf file")
    if args.gguf is None and _is_vae(args.model, args.models_dir):
        print(_describe_vae(resolve_vae(args.model, args.models_dir)))
        return 0
    d, g = resolve_model(args.model, args.models_dir, args.gguf)
    if g is None and d is not None and not (d / FIXTURES_FILE).is_file() \
            and any(d.glob("*.gguf")):
        g = one_gguf(d)        # a folder a download went into: its only .gguf, any name
    text = _describe_text_encoder(d, g) if g is not None else None
    if text is not None:
        print(text)
        return 0
    with open_model(args.model, models_dir=args.models_dir, gguf_path=g) as m:
        print(m.describe())
    return 0


def _cmd_make(args: argparse.Namespace) -> int:
    root = Path(args.models_dir) if args.models_dir else models_dir()
    custom = {k: getattr(args, k) for k in ("variant", "dim", "n_heads", "n_kv_heads",
                                            "ffn_dim", "n_layers", "n_caption", "grid",
                                            "seed", "adaln_in", "norm_eps", "mask_pad",
                                            "types", "qk_norm_scale")
              if getattr(args, k) is not None}
    if args.no_prefix:
        custom["prefix"] = False
    if args.weights is not None:
        custom["include_weights"] = args.weights
    if args.out is None and (not args.id.strip() or os.sep in args.id or
                             args.id.startswith(".")):
        raise UsageError(f"model id {args.id!r}: an id is a plain name (no {os.sep!r}, not "
                         f"starting with '.'), made under the models directory; give --out DIR "
                         f"to write elsewhere")
    if any(g and not os.path.isabs(g) for g in (args.out, args.models_dir)):
        os.getcwd()   # a removed working directory: the frame's exit 2 saying so, as in every
        #               CLI (the write failed later as exit 9, "cannot write model ... under .")
    say = stderr_progress(args.id)
    base = builtin_spec(args.id)
    if base is not None and base.kind == TEXT_ENCODER_KIND:
        if custom or args.out is not None:
            raise UsageError(f"{args.id!r} is a built-in text encoder: it is generated as it "
                             f"is (no custom fields, no --out)")
        d = ensure_builtin(args.id, root, force=args.force, progress=say)
        print(_describe_text_encoder(d, d / "model.gguf"))
        return 0
    if base is not None and base.kind == VAE_KIND:
        if custom or args.out is not None:
            raise UsageError(f"{args.id!r} is a built-in autoencoder: it is generated as it is "
                             f"(no custom fields, no --out)")
        d = ensure_builtin(args.id, root, force=args.force, progress=say)
        print(_describe_vae(d / VAE_FILE))
        return 0
    if base is not None and not custom and args.out is None:
        d = ensure_builtin(args.id, root, force=args.force, progress=say)
    else:                        # a built-in's spec with custom fields, or a new block model
        base = base or SyntheticSpec()
        if "grid" in custom:
            custom["grid"] = tuple(custom["grid"])
        d = Path(args.out) if args.out else root / args.id
        if builtin_spec(d.name) is not None and \
                os.path.realpath(d.parent) == os.path.realpath(root):
            raise UsageError(f"{d}: the directory of the built-in model {d.name!r}, which is "
                             f"generated again whenever it does not hold that model (a variant "
                             f"written there would be replaced by it); give another id, or "
                             f"--out DIR elsewhere")
        spec = dataclasses.replace(base, **custom)
        src = "(from --out)" if args.out else "(from $NXHPC_MODELS / --models-dir)"
        try:
            check_replaceable(d, args.force)
            spec.validate()
            check_models_root(d.parent, need_bytes=spec.disk_bytes(), what=f"model {args.id!r}",
                              src=src)
            make_synthetic(d, spec, progress=say, replace=args.force)
        except ValueError as e:
            raise UsageError(str(e)) from None
        except FileExistsError as e:
            hint = "" if args.force else " (use --force to replace it)"
            raise UsageError(f"{e}{hint}") from None
        except OSError as e:
            raise write_failed(d.parent, f"model {args.id!r}", e, src) from None
    with open_model(d) as m:
        print(m.describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = types.Parser(
        prog="python -m nxhpc.models",
        description="List, inspect and generate nxhpc model directories "
                    "(model.gguf + fixtures.safetensors).",
        epilog=codes_epilog(EXIT_CODES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=types.directory_path,
                   help=f"model root (default {types.MODELS_DIR_DEFAULT})")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="built-in ids and directories present")
    sh = sub.add_parser("show", help="config (and how it was inferred), files, fixtures")
    sh.add_argument("model", help="model id, model directory, or .gguf file")
    sh.add_argument("--gguf", help="use this GGUF instead of the directory's model.gguf")
    mk = sub.add_parser("make", help="generate a synthetic model (a built-in id, or custom dims)",
                        description="Generate a synthetic model: a built-in id as it is, or its "
                                    "spec (a new id: the default block model's) with the fields "
                                    "given. A built-in denoiser takes --dim, --heads, --ffn, "
                                    "--layers, --caption, --seed and --qk-norm-scale; the other "
                                    "options are for block models only.")
    mk.add_argument("id", help="model id (directory name under the models dir)")
    mk.add_argument("--variant", choices=("zimage", "lumina2"))
    mk.add_argument("--dim", type=types.positive_int)
    mk.add_argument("--heads", dest="n_heads", type=types.positive_int)
    mk.add_argument("--kv-heads", dest="n_kv_heads", type=types.positive_int)
    mk.add_argument("--ffn", dest="ffn_dim", type=types.positive_int)
    mk.add_argument("--layers", dest="n_layers", type=types.positive_int)
    mk.add_argument("--caption", dest="n_caption", type=int, help="caption tokens")
    mk.add_argument("--grid", type=types.grid, help="image token grid FxHxW, e.g. 1x4x8")
    mk.add_argument("--seed", type=types.seed)
    mk.add_argument("--adaln-in", type=types.positive_int)
    mk.add_argument("--eps", dest="norm_eps", type=types.eps,
                    help="RMSNorm eps, a normal float32 number (default 1e-5)")
    mk.add_argument("--mask-pad", type=int, help="mask the last N caption tokens")
    mk.add_argument("--types", help="weight-type policy: q8_0 (default), q4_k_m, sdcpp-q4_0, "
                                    "or one type for every matrix (f32, f16, bf16, q4_0, q4_1, "
                                    "q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k); see "
                                    "nxhpc/formats/layouts.py")
    mk.add_argument("--qk-norm-scale", type=float,
                    help="multiply the q_norm / k_norm weights by this (default 1): the "
                         "attention scores spread by its square (4: sharp heads whose softmax "
                         "weights underflow, as trained models can have)")
    mk.add_argument("--no-prefix", action="store_true",
                    help="write tensor names without 'model.diffusion_model.'")
    mk.add_argument("--weights", action=argparse.BooleanOptionalAction, default=None,
                    help="also store float32 weights in the fixtures (default: if < 64 MB)")
    mk.add_argument("--out", help="output directory (default: <models dir>/<id>)")
    mk.add_argument("--force", action="store_true", help="replace an existing directory")
    for sp in (ls, sh, mk):    # after the command too, as every other CLI takes it anywhere
        sp.add_argument("--models-dir", type=types.directory_path, default=argparse.SUPPRESS,
                        help="model root (the same option as before the command)")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``python -m nxhpc.models list | show <id> | make <id> [...]``."""
    cmds = {"list": _cmd_list, "show": _cmd_show, "make": _cmd_make}
    return run_cli(PROG, build_parser(), argv, lambda args: cmds[args.cmd](args))
