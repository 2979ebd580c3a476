"""Model ids: the built-in registry, the models directory, and resolving an id or path.

Owns: :data:`BUILTINS`, the one table of built-in models (id -> its spec: a
:class:`~nxhpc.models.synthetic.SyntheticSpec`, a block model or a whole denoiser, or a
:class:`~nxhpc.models.qwen3_files.TextEncoderSpec`; each spec's ``kind`` says which; also
``zimage-dit-<N>l`` and ``zimage-dit-<N>l-q4km`` for N = 1..30 main layers), the models root
(``$NXHPC_MODELS``, else ``$XDG_CACHE_HOME/nxhpc/models``, else ``~/.cache/nxhpc/models``),
generating a built-in on first use under a lock (and again when its fingerprint is stale),
:func:`resolve_model` (id | directory | ``.gguf`` -> the directory and GGUF path) and
:func:`open_model` (-> :class:`~nxhpc.models.model.Model`), :func:`open_denoiser` (-> ``nxhpc.dit.denoiser.Denoiser``),
:func:`open_text_encoder` (-> ``nxhpc.qwen3.encoder.TextEncoder``) and :func:`open_vae` (->
``nxhpc.vae.model.VaeDecoder``; the built-in autoencoders are a
:class:`~nxhpc.models.vae_files.VaeSpec` each, kind ``"vae"``): the model code takes
files, never ids. Must not: run kernels.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nxhpc.formats.fixtures import FIXTURES_FILE, FixtureStore
from nxhpc.formats.gguf_io import GGUFFile, ModelError, ModelNotFoundError
from nxhpc.models.model import Model
from nxhpc.models.modeldir import (FILES_MANIFEST, GGUF_FILE, NAMED_FILES, SPEC_FILE,
                                   ModelsDirError, check_models_root, locked, write_failed)
from nxhpc.models.qwen3_files import TEXT_ENCODER_KIND, TextEncoderSpec, make_text_encoder
from nxhpc.models.synthetic import KINDS, SyntheticSpec, make_synthetic
from nxhpc.models.vae_files import VAE_FILE, VAE_KIND, VaeSpec, make_vae_model
from nxhpc.runtime.checks import file_kind

__all__ = ["BUILTINS", "BUILTIN_KINDS", "DEFAULT_MODEL_ID", "models_dir", "builtin_ids",
           "ensure_builtin", "open_model", "open_denoiser", "open_text_encoder",
           "resolve_model", "builtin_spec", "is_builtin", "builtin_current", "stderr_progress",
           "open_vae", "resolve_vae", "opened_model_files"]

#: The kinds of built-in: DiT block models, whole denoisers, text encoders, autoencoders.
BUILTIN_KINDS = (*KINDS, TEXT_ENCODER_KIND, VAE_KIND)
#: A built-in's spec: its ``kind`` says which generator writes it.
BuiltinSpec = SyntheticSpec | TextEncoderSpec | VaeSpec

BUILTINS: dict[str, BuiltinSpec] = {
    # --- block models (python -m nxhpc.blockrun)
    # README default: runs in well under a second; T=45 = 13 caption + 4x8 image tokens
    "tiny": SyntheticSpec(variant="zimage", dim=384, n_heads=6, n_layers=2, n_caption=13,
                          grid=(1, 4, 8), seed=1),
    # Lumina-2 style: GQA 4 query / 2 kv heads of 96, SiLU adaLN from 1024, padded caption mask
    "tiny-gqa": SyntheticSpec(variant="lumina2", dim=384, n_heads=4, n_kv_heads=2,
                              ffn_dim=1024, n_layers=2, n_caption=11, grid=(1, 5, 6),
                              seed=2, mask_pad=3, prefix=False),
    # real head_dim 128 and RoPE axes; T=150 = 22 caption + 8x16 image tokens
    "mid": SyntheticSpec(variant="zimage", dim=768, n_heads=6, n_layers=3, n_caption=22,
                         grid=(1, 8, 16), seed=3),
    # real Z-Image dims (D=3840, 30x128, FFN 10240), T=256 = 32 caption + 14x16 image tokens
    "zimage-1l": SyntheticSpec(variant="zimage", dim=3840, n_heads=30, n_layers=1,
                               n_caption=32, grid=(1, 14, 16), seed=4),
    # --- whole denoisers (python -m nxhpc.denoise / sample)
    # whole denoiser, small dims (D=384, 6x64 heads, FFN 1024, cap_dim 320), 2 layers + 2+2
    # refiners, ComfyUI-GGUF types (layers Q8_0, refiners/embedders BF16, 1-D F32); stored
    # inputs 16x14x10 latents (35 image tokens) + 19 caption rows (both padded) and the float64
    # reference output
    "tiny-dit": SyntheticSpec(dim=384, n_heads=6, n_layers=2, n_refiner=2, cap_dim=320,
                              layout="comfyui-q8_0", seed=11, latent_hw=(14, 10),
                              n_caption=19, timestep=0.6, reference=True),
    # real Z-Image dims with 2 main layers (benchmarks): stored 512x512 inputs, no reference
    "zimage-dit-2l": SyntheticSpec.zimage_dit(2),
    # --- text encoders (python -m nxhpc.encode)
    # a Qwen3 of width 320 (tiny-dit's cap_dim: its features feed tiny-dit), 4 query / 2 kv
    # heads of 64 (H*hd = 256 != D, as in Qwen3-4B), FFN 768, 3 blocks (2 run), the tiny
    # vocab (582 ids, Qwen3's chat tokens), context 1024; every matrix Q8_0, norms F32
    "tiny-te": TextEncoderSpec(dim=320, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=64,
                               ffn=768, vocab=582, context_length=1024, matrix_type="Q8_0",
                               seed=21),
    # --- autoencoders (python -m nxhpc.decode / generate)
    # FLUX-style decoder, small: channels 32/32/64/64, 3 ResNets a level, 32 groups, 16 latent
    # channels, one mid attention; F32 ae.safetensors in the BFL layout, random weights
    "tiny-vae": VaeSpec(seed=0),
}
DEFAULT_MODEL_ID = "tiny"
#: ``zimage-dit-<N>l``: real Z-Image dims with N main layers (1..30), generated on first use;
#: ``zimage-dit-<N>l-q4km``: the same weights (same seed) in the Q4_K_M layout of the ComfyUI
#: Z-Image files (main layers Q4_K, their qkv Q5_K and w2 Q6_K; refiners and embedders BF16).
ZIMAGE_DIT_ID = re.compile(r"zimage-dit-([1-9][0-9]?)l(-q4km)?")


def builtin_spec(model_id: str) -> BuiltinSpec | None:
    """The spec of a built-in id (block model, denoiser, text encoder or autoencoder), or None."""
    if model_id in BUILTINS:
        return BUILTINS[model_id]
    m = ZIMAGE_DIT_ID.fullmatch(model_id)
    if m and 1 <= int(m.group(1)) <= 30:
        n = int(m.group(1))
        return SyntheticSpec.zimage_dit(n, layout="q4_k_m") if m.group(2) else \
            SyntheticSpec.zimage_dit(n)
    return None


def is_builtin(model_id: str) -> bool:
    return builtin_spec(model_id) is not None


def builtin_ids(kind: str | None = None) -> list[str]:
    """The ids of :data:`BUILTINS` (of one ``kind`` of :data:`BUILTIN_KINDS`, if given)."""
    if kind is not None and kind not in BUILTIN_KINDS:
        raise ValueError(f"builtin_ids: kind must be one of {BUILTIN_KINDS} or None, got "
                         f"{kind!r}")
    return [k for k, s in BUILTINS.items() if kind is None or s.kind == kind]


def _builtin_names() -> str:
    return ", ".join([*BUILTINS, "zimage-dit-<N>l", "zimage-dit-<N>l-q4km"])


def models_dir() -> Path:
    """``$NXHPC_MODELS``; else ``$XDG_CACHE_HOME/nxhpc/models``; else ``~/.cache/nxhpc/models``."""
    env = os.environ.get("NXHPC_MODELS")
    if env and not env.strip():          # a directory named " " in the working directory
        raise ModelsDirError(env, f"NXHPC_MODELS={env!r} is blank: unset it (the default) or "
                                  f"give a directory")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nxhpc" / "models"


_models_root = models_dir


def _root_of(given: str | os.PathLike | None) -> Path:
    """The models directory a caller gave (None: :func:`models_dir`). An empty or blank string
    is refused as the CLI's ``--models-dir`` refuses it: ``Path("")`` is the working directory,
    where built-ins were generated without a word."""
    if given is None:
        return _models_root()
    if isinstance(given, (str, bytes)) and not os.fsdecode(given).strip():
        raise ModelsDirError(os.fsdecode(given) or ".", f"models_dir={given!r} is empty: give a "
                             f"directory ('.' for this one), or None for the default")
    return Path(os.fsdecode(given))


def opened_model_files(main: str | os.PathLike | None,
                       directory: str | os.PathLike | None = None) -> list[Path]:
    """The files of a model a run opened that its outputs must never replace: ``main`` (the
    file, or diffusers directory, the loader reads) and the model files beside it and in the
    model ``directory``, if any (:data:`NAMED_FILES`: weights, fixtures, spec, a built-in's
    manifest, ``config.json``; in a diffusers directory's ``vae/`` too), however the model was
    named (an id or a path: the same files). Not the user's other files there -- an earlier
    run's output beside the model may be written again; a built-in generated again passes
    them on (``modeldir.build_model_dir``). Every CLI's outputs go through this one rule.
    ``main`` None: a text encoder's folder whose GGUF is found when it is opened (its only
    ``.gguf``): the folder's model files and every ``.gguf`` in it."""
    if main is None:
        if directory is None:
            return []
        d = Path(directory)
        return opened_model_files(d) + sorted(p for p in d.glob("*.gguf") if p.is_file())
    main = Path(main)
    dirs = [main, main / "vae"] if main.is_dir() else [main.parent]
    if directory is not None and Path(directory) not in dirs:    # a GGUF given apart from it
        dirs.append(Path(directory))
    out = [] if main.is_dir() else [main]
    return out + [d / n for d in dirs for n in NAMED_FILES if (d / n).is_file()]


def _manifest(d: Path) -> dict[str, list]:
    """``{name: [size, sampled sha256]}`` of the model's files in ``d`` (:data:`NAMED_FILES`
    but the manifest): not the user's other files there, which they may change (a user's file
    in the manifest made every later change of it regenerate the model)."""
    from nxhpc.runtime.ranks import file_fingerprint
    return {f.name: list(file_fingerprint(f)) for f in sorted(d.iterdir())
            if f.name in NAMED_FILES and f.is_file() and not f.is_symlink()
            and f.name != FILES_MANIFEST}


def _write_manifest(d: Path) -> None:
    """Record ``d``'s files (atomically: a half-written manifest reads as damaged)."""
    tmp = d / f"{FILES_MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(_manifest(d), indent=1, sort_keys=True))
    os.replace(tmp, d / FILES_MANIFEST)


def builtin_current(d: Path, spec: BuiltinSpec) -> bool:
    """Whether ``d`` holds the model ``spec`` generates: the same fingerprint, the main file
    present, and every generated file as it was written (size and sampled hash,
    :data:`FILES_MANIFEST`; files added later are not looked at; a directory without the
    manifest counts as stale and is generated again)."""
    try:
        info = json.loads((d / SPEC_FILE).read_text())
        main = getattr(spec, "main_file", GGUF_FILE)
        if info.get("fingerprint") != spec.fingerprint() or not (d / main).is_file():
            return False
        from nxhpc.runtime.ranks import file_fingerprint
        files = json.loads((d / FILES_MANIFEST).read_text())
        return bool(files) and all(
            (d / n).is_file() and not (d / n).is_symlink()
            and list(file_fingerprint(d / n)) == v for n, v in files.items())
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def ensure_builtin(model_id: str, root: Path | None = None, force: bool = False,
                   progress: Callable[[str], None] | None = None) -> Path:
    """Return the directory of built-in ``model_id``, generating it first if needed.

    Safe under concurrency: one process generates (under a lock file), others wait -- saying
    so on stderr, with the generator's pid -- and reuse. A directory written by an older
    generator (fingerprint mismatch) is regenerated; temporaries of a generator that was killed
    are swept. A models root that cannot take the model (not a directory, not writable, full)
    raises :class:`~nxhpc.models.modeldir.ModelsDirError` before any work, or -- a write that
    fails anyway -- as soon as it fails, leaving nothing behind.
    """
    spec = builtin_spec(model_id)
    if spec is None:
        raise ModelNotFoundError(f"{model_id!r} is not a built-in model id "
                                 f"(built-ins: {_builtin_names()})")
    root = Path(root) if root is not None else models_dir()
    d = root / model_id
    if not force and builtin_current(d, spec):
        return d
    what = f"built-in model {model_id!r}"
    check_models_root(root, need_bytes=spec.disk_bytes(), what=what)
    try:
        with locked(root, model_id):
            if not force and builtin_current(d, spec):
                return d
            if progress is None and spec.weights_bytes_f32() > 256 << 20:
                progress = stderr_progress(model_id)
            make = {TEXT_ENCODER_KIND: make_text_encoder,
                    VAE_KIND: make_vae_model}.get(spec.kind, make_synthetic)
            make(d, spec, progress=progress, replace=True)
            try:
                _write_manifest(d)
            except OSError as e:              # a full disk at the last, small file
                raise write_failed(root, what, e, left="its files were written but not their "
                                   "manifest, so it is generated again at its next use") \
                    from None
    except FileExistsError as e:
        raise ModelError(f"{what}: {e}") from None
    except ModelsDirError:
        raise
    except OSError as e:
        raise write_failed(root, what, e) from None
    return d


def stderr_progress(model_id: str) -> Callable[[str], None]:
    """A progress callback printing ``[nxhpc.models <id> <seconds>s] <message>`` to stderr; a
    stderr that cannot take it (closed, full, a pipe whose reader left) drops the line: it
    was taken for the model's own write failing ("the file system is full", exit 9)."""
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if sys.stderr is None:                 # print(file=None) would write to stdout
            return
        try:
            print(f"[nxhpc.models {model_id} {time.monotonic() - t0:6.1f}s] {msg}",
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    return say


def _file_kind(p: Path) -> str:
    """What a path that is neither a regular file nor a directory is, in words."""
    try:
        return file_kind(p.stat().st_mode)
    except OSError as e:
        return f"cannot be read: {e.strerror}"


def resolve_model(id_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
                  gguf_path: str | os.PathLike | None = None) -> tuple[Path | None, Path | None]:
    """``(model directory or None, GGUF path or None)`` of an id or path.

    Resolution: a bare name is looked up as ``<models_dir>/<name>`` (built-in ids are generated
    there on first use, and regenerated if stale); otherwise ``id_or_path`` must be a model
    directory or a ``.gguf`` file. ``gguf_path`` overrides the directory's ``model.gguf``.
    """
    root = _root_of(models_dir)
    s = os.fsdecode(id_or_path)                      # a bytes path as the OS would read it
    if not s.strip():
        raise ModelNotFoundError(f"model id {s!r} is empty: give a built-in id "
                                 f"({', '.join(BUILTINS)}), a directory under {root}, or "
                                 f"a model directory or .gguf path ('.' for this directory)")
    p = Path(s)
    d: Path | None = None
    gpath: Path | None = None
    bare = bool(s) and os.sep not in s and not s.startswith(".") and p.suffix != ".gguf"
    if bare and is_builtin(s):
        d = ensure_builtin(s, root)
    elif bare and (root / s).is_dir():
        d = root / s
    elif p.is_dir():
        d = p
    elif p.is_file() and p.suffix == ".gguf":
        gpath = p
    elif p.exists() and not p.is_file():
        raise ModelNotFoundError(
            f"model {s!r} is not a regular file or a directory ({_file_kind(p)}): give a .gguf "
            f"file, a model directory or a built-in id ({_builtin_names()})")
    elif p.is_file() and p.suffix != ".gguf":
        raise ModelNotFoundError(
            f"model {s!r} is a file but not a .gguf file: give a .gguf file (llama.cpp / "
            f"ComfyUI GGUF), a model directory or a built-in id ({_builtin_names()})")
    elif bare and root.exists() and not root.is_dir():
        raise ModelsDirError(root, f"model {s!r} not found: the models directory {root} (from "
                                   f"$NXHPC_MODELS / --models-dir) is not a directory")
    else:
        raise ModelNotFoundError(
            f"model {s!r} not found: not a built-in id ({_builtin_names()}), not a "
            f"directory under {root}, and not a model directory or .gguf file path")
    if gguf_path is not None:
        gpath = Path(gguf_path)
        if not gpath.is_file():
            raise ModelNotFoundError(f"gguf_path {gpath}: no such file")
    elif d is not None and (d / GGUF_FILE).is_file():
        gpath = d / GGUF_FILE
    elif d is not None and os.path.lexists(d / GGUF_FILE):
        # a FIFO, a directory or a dangling link: not "no GGUF" (the fixtures' weights would
        # run in its place without a word)
        raise ModelNotFoundError(f"{d / GGUF_FILE}: {_file_kind(d / GGUF_FILE)}, not a regular "
                                 f"file: the model directory's {GGUF_FILE} must be a GGUF file")
    return d, gpath


def _kind_words(kind: str) -> str:
    """A built-in kind as messages say it."""
    return {"text_encoder": "text encoder", "vae": "autoencoder"}.get(kind, kind)


def _refuse_other_kind(model: str | os.PathLike, kinds: tuple[str, ...], noun: str,
                       listing: str) -> None:
    """ModelNotFoundError when ``model`` is the bare id of a built-in whose kind is not one of
    ``kinds`` (a bare name is an id, as :func:`resolve_model` reads one), before anything is
    generated: ``'tiny-te' is a built-in text encoder model, not {noun} (built-in
    {listing})``."""
    s = os.fsdecode(model) if isinstance(model, (str, bytes, os.PathLike)) else None
    if s is None or os.sep in s or s.startswith("."):    # a path, not an id
        return
    spec = builtin_spec(s)
    if spec is not None and spec.kind not in kinds:
        runs = {"block": "blockrun", "denoiser": "denoise", TEXT_ENCODER_KIND: "encode",
                VAE_KIND: "decode"}.get(spec.kind)
        hint = f"; python -m nxhpc.{runs} runs it" if runs else ""
        raise ModelNotFoundError(f"{s!r} is a built-in {_kind_words(spec.kind)} model, "
                                 f"not {noun} (built-in {listing}{hint})")


def open_denoiser(model: str | os.PathLike, *, workers: int | None = None,
                  models_dir: str | os.PathLike | None = None,
                  gguf_path: str | os.PathLike | None = None, **options: Any) -> Any:
    """Open a whole denoiser (``nxhpc.dit.denoiser.Denoiser``): a GGUF path, a model directory,
    or a built-in id (``tiny-dit``, ``zimage-dit-2l``, ``zimage-dit-<N>l[-q4km]``: generated on
    first use under ``models_dir`` / ``$NXHPC_MODELS``). A directory's GGUF is its
    ``model.gguf``, else its only ``.gguf`` (:func:`one_gguf`); ``gguf_path`` overrides it.
    ``workers``: processes per call (default: the usable CPUs). ``options``: ``spawn``,
    ``stage_timeout``, ``norm_eps``, ``precision``, ``q8_float_weights``, ``reuse_caption``
    (see ``Denoiser``). Raises ``ModelNotFoundError`` / ``ModelFileError`` /
    ``MissingTensorError`` (all :class:`ModelError`) naming what is wrong."""
    from nxhpc.dit.denoiser import Denoiser
    _refuse_other_kind(model, ("denoiser",), "a denoiser", "denoisers: "
                       + ", ".join(builtin_ids("denoiser")) + ", zimage-dit-<N>l")
    d, g = resolve_model(model, models_dir, gguf_path)
    if g is None:             # a folder a download went into: its only .gguf, any name
        g = one_gguf(d, "a denoiser runs from a GGUF file")
    return Denoiser(g, workers=workers, directory=d, **options)


def open_model(id_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
               gguf_path: str | os.PathLike | None = None) -> Model:
    """Open a model by id or path (resolved by :func:`resolve_model`): a block model's or a
    whole denoiser's (their blocks). The id of a built-in of another kind (a text encoder, an
    autoencoder) is refused before anything is generated."""
    _refuse_other_kind(id_or_path, KINDS, "a DiT model",
                       "DiT models: " + ", ".join(builtin_ids("block")) + ", "
                       + ", ".join(builtin_ids("denoiser")))
    d, gpath = resolve_model(id_or_path, models_dir, gguf_path)
    fx = FixtureStore(d / FIXTURES_FILE) if d is not None and (d / FIXTURES_FILE).is_file() \
        else None
    g = GGUFFile(gpath) if gpath is not None else None
    if g is None and fx is None:
        raise ModelNotFoundError(f"{d}: neither {GGUF_FILE} nor {FIXTURES_FILE} found")
    return Model(d, g, fx)


def one_gguf(d: Path, runs_from: str = "") -> Path:
    """The GGUF of a directory: its ``model.gguf``, else its only ``*.gguf`` file (a folder a
    download went into); ModelNotFoundError naming them when there are none or several
    (``runs_from``, if given, follows in brackets: what the model runs from)."""
    if (d / GGUF_FILE).is_file():
        return d / GGUF_FILE
    found = sorted(p for p in d.glob("*.gguf") if p.is_file())
    if len(found) == 1:
        return found[0]
    hint = f" ({runs_from})" if runs_from else ""
    if not found:
        raise ModelNotFoundError(f"{d}: no .gguf file in this directory{hint}")
    names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
    raise ModelNotFoundError(f"{d}: {len(found)} .gguf files ({names}); give the path of the "
                             f"one to use{hint}")


def open_text_encoder(model: str | os.PathLike, *, workers: int | None = None,
                      precision: str = "f32", models_dir: str | os.PathLike | None = None,
                      gguf_path: str | os.PathLike | None = None, **options: Any) -> Any:
    """Open a Qwen3 text encoder (``nxhpc.qwen3.encoder.TextEncoder``): a llama.cpp-layout
    ``.gguf`` path, a directory holding one (its ``model.gguf``, else its only ``.gguf``), or
    a built-in id (``tiny-te``: generated on first use under ``models_dir`` /
    ``$NXHPC_MODELS``). ``gguf_path`` overrides the directory's file. ``workers``,
    ``precision`` and ``options`` (``spawn``, ``stage_timeout``, ``max_tokens``,
    ``check_values``) as for ``TextEncoder``. The id of a built-in of another kind (a DiT) is
    refused before anything is generated. Raises ``ModelNotFoundError`` /
    ``ModelFileError`` / ``MissingTensorError`` (all :class:`ModelError`)."""
    from nxhpc.qwen3.encoder import TextEncoder
    _refuse_other_kind(model, (TEXT_ENCODER_KIND,), "a text encoder",
                       "text encoders: " + ", ".join(builtin_ids(TEXT_ENCODER_KIND)))
    d, g = resolve_model(model, models_dir, gguf_path)
    if g is None:
        g = one_gguf(d, "a text encoder runs from a llama.cpp-layout Qwen3 GGUF")
    return TextEncoder(g, workers=workers, precision=precision, directory=d, **options)


def resolve_vae(model: str | os.PathLike, models_dir: str | os.PathLike | None = None) -> Path:
    """The path an autoencoder ``model`` names: a built-in id (``tiny-vae``: generated on first
    use under ``models_dir`` / ``$NXHPC_MODELS``) -> its ``ae.safetensors``; a directory holding
    an ``ae.safetensors`` -> that file; a name under the models directory -> that directory;
    anything else as given (``nxhpc.vae.files`` reads a file or a diffusers directory). The id
    of a built-in of another kind is refused before anything is generated."""
    s = os.fsdecode(model)                           # a bytes path as the OS would read it
    if not s.strip():
        raise ModelNotFoundError(f"autoencoder {s!r} is empty: give an ae.safetensors file, a "
                                 f"diffusers VAE directory or a built-in id "
                                 f"({', '.join(builtin_ids(VAE_KIND))})")
    root = _root_of(models_dir)
    # a bare name is an id, as resolve_model reads one: a built-in's (even if the working
    # directory holds an entry of that name: './tiny-vae' names that), else one under the root
    bare = os.sep not in s and not s.startswith(".")
    _refuse_other_kind(s, (VAE_KIND,), "an autoencoder",
                       "autoencoders: " + ", ".join(builtin_ids(VAE_KIND)))
    spec = builtin_spec(s) if bare else None
    path = Path(s)
    if spec is not None:
        path = ensure_builtin(s, root) / VAE_FILE
    elif bare and (root / s).is_dir():
        path = root / s
    if path.is_dir() and (path / VAE_FILE).is_file():
        path = path / VAE_FILE
    return path


def open_vae(model: str | os.PathLike, *, workers: int | None = None, precision: str = "f32",
             models_dir: str | os.PathLike | None = None,
             stage_timeout: float | None = None) -> Any:
    """Open the FLUX autoencoder's decoder (``nxhpc.vae.model.VaeDecoder``) of what
    :func:`resolve_vae` makes of ``model``: a BFL/ComfyUI ``ae.safetensors`` file, a diffusers
    VAE directory (or a pipeline directory holding ``vae/``), a directory holding an
    ``ae.safetensors``, or a built-in id (``tiny-vae``); ``stage_timeout`` as for
    ``VaeDecoder``. Raises ``ModelNotFoundError`` / ``ModelFileError`` /
    ``MissingTensorError`` (all :class:`ModelError`)."""
    from nxhpc.runtime.workers import check_timeout
    from nxhpc.vae.model import VaeDecoder
    stage_timeout = check_timeout(stage_timeout)         # before a built-in is generated
    return VaeDecoder(resolve_vae(model, models_dir), workers=workers, precision=precision,
                      stage_timeout=stage_timeout)
