"""``python -m nxhpc.encode`` (``nxhpc-encode``, ``nxhpc encode``): a prompt -> Z-Image's
caption features, from a llama.cpp-layout Qwen3 GGUF.

Owns the CLI only: parse -> ``TextEncoder.tokenize`` / ``encode_ids``
(``nxhpc.qwen3.encoder``, opened by ``nxhpc.models.registry.open_text_encoder``) -> an atomic
``.npy`` (float32 ``[L, dim]``: what ``python -m nxhpc.sample --cap-feats`` takes) -> report.
Exit codes, the signal frame, the argparse types and the report writer are :mod:`nxhpc.cli`'s.
Must not: compute anything of the model, define an exit code of its own, or import another CLI.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.cli.codes import Exit, InputError, OutputError, UsageError
from nxhpc.cli.frame import run_cli
from nxhpc.cli.report import fmt_compact, flush_stdout, print_json, print_kv, save_npy
from nxhpc.runtime.outfile import OutputPathError, check_cli_output_path

__all__ = ["main", "build_parser", "EXIT_CODES"]

PROG = "encode"
#: Blocks of Qwen3-4B that ``hidden_states[-2]`` runs: the extrapolation of small files.
QWEN3_4B_LAYERS_RUN = 35

#: The codes encode returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "the features were written to --out",
    Exit.FAIL: "the features have NaN/inf values (weights that overflow float32); nothing "
               "was written",
    Exit.USAGE: "usage error: bad arguments (n_workers 'abc' or 0, neither or both of "
                "--prompt/--prompt-file, a missing --prompt-file, a prompt that is not text: "
                "a NUL character, a lone surrogate, bytes that are not UTF-8; an --out path "
                "that cannot be written or is an input or a file of the model); nothing was "
                "written",
    Exit.NOT_FOUND: "text encoder not found (id, directory, or .gguf path), or a built-in id "
                    "of another kind (a DiT)",
    Exit.BAD_INPUT: "bad input: a malformed, truncated or unsupported GGUF (not a qwen3 "
                    "file, shapes that disagree, an IQ type, no chat tokens in the vocab, NaN "
                    "weights), or ids beyond the model's context; nothing was written",
    Exit.MISSING: "a tensor is missing from the GGUF",
    Exit.WORKER: "a worker process failed (raised, crashed, was killed, or exceeded "
                 "--stage-timeout)",
    Exit.SHM: None,
    Exit.OUTPUT: "--out could not be written (e.g. disk full); an existing file at that path "
                 "is unchanged",
    Exit.MODELS_DIR: None,
    Exit.INTERNAL: None,
    Exit.SIGHUP: None,
    Exit.SIGINT: None,
    Exit.SIGTERM: None,
}

_HELP = """\
what it computes:
  The ids ZImagePipeline feeds Qwen3: the prompt inside the chat template
  '<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n', encoded by the file's own
  byte-level BPE (the qwen2 pre-tokenizer, NFC, the special tokens matched whole -- also when
  typed), the first 512 kept; then hidden_states[-2] of those ids (every block but the last,
  no final norm) on nxhpc's kernels. --out: float32 [n_tokens, dim] (Qwen3-4B: dim 2560), the
  caption features python -m nxhpc.sample and nxhpc.denoise take.

report (key=value, or one object with --json): model, config, n_tokens, templated_tokens
  (before truncation), truncated, dim, precision, workers, timings in microseconds
  (us_tokenize, us_embed, us_layers, us_total), s_per_layer and the extrapolated s_35_layers
  (= everything but the blocks + 35 x one block, Qwen3-4B's count), memory (weights_mb,
  arena_mb, peak_rss_mb), out; ids with --json or --print-ids.

"""


def build_parser() -> argparse.ArgumentParser:
    p = types.cli_parser(
        "encode",
        usage="python -m nxhpc.encode TEXT_ENCODER (--prompt TEXT | --prompt-file P.txt) "
              "--out FEATS.npy [--json] [--precision f32|bf16|q8|auto] "
              "[--q8-float-weights int8|bf16] [n_workers]",
        description="Z-Image's caption features of a prompt: the Qwen3 text encoder "
                    "(tokenizer and weights from one llama.cpp-layout GGUF: F32/F16/BF16/"
                    "Q8_0, Q4_0..Q5_1, Q2_K..Q6_K) on nxhpc's C kernels in forked workers "
                    "sharing one shared-memory arena.",
        epilog=_HELP, exit_codes=EXIT_CODES)
    p.add_argument("text_encoder", metavar="TEXT_ENCODER",
                   help="a llama.cpp-layout Qwen3 .gguf (e.g. Qwen3-4B-Q8_0.gguf), a directory "
                        "holding one, a directory under --models-dir / $NXHPC_MODELS, or the "
                        "built-in id tiny-te (generated on first use)")
    types.add_workers(p)
    p.add_argument("--prompt", metavar="TEXT", help="the prompt (may be empty: '')")
    p.add_argument("--prompt-file", metavar="P.txt",
                   help="read the prompt from this UTF-8 file instead (- reads standard "
                        "input; one trailing newline is dropped, a leading byte-order mark too)")
    p.add_argument("--out", required=True, metavar="FEATS.npy",
                   help="write the features (float32 [n_tokens, dim]) here, atomically")
    types.add_precision(p, "matmul precision of the projections: f32 (default: the exactly "
                           "decoded weights, float32 activations), bf16, q8 (int8 dots on the "
                           "quantized types; F32/F16/BF16 matrices by --q8-float-weights); the "
                           "attention follows it (bf16 under bf16 and q8); the gather, norms "
                           "and RoPE stay float32")
    types.add_q8_float_weights(p)
    p.add_argument("--print-ids", action="store_true",
                   help="also print the token ids (always in the --json object)")
    types.add_models_dir(p)
    types.add_stage_timeout(p)
    types.add_json(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``). n_workers may follow the options."""
    return run_cli(PROG, build_parser(), argv, _run, intermixed=True)


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt text: --prompt as given, or --prompt-file decoded as strict UTF-8."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise UsageError("give exactly one of --prompt TEXT and --prompt-file P.txt")
    if args.prompt is not None:
        return args.prompt
    text = types.read_text_file(args.prompt_file, "--prompt-file", "a text file")
    return text[:-1] if text.endswith("\n") else text      # \r\n was read as \n


def _run(args: argparse.Namespace) -> int:
    from nxhpc.models.registry import open_text_encoder, opened_model_files
    types.refuse_mpi_ranks(PROG)
    prompt = _read_prompt(args)
    what = "--prompt" if args.prompt is not None else f"--prompt-file {args.prompt_file}"
    prompt = types.check_prompt(prompt, what)
    inputs = [x for x in (args.prompt_file,) if x and x != "-"]
    if os.path.isfile(args.text_encoder):
        inputs.append(args.text_encoder)
    check_cli_output_path(args.out, what="--out", inputs=inputs)
    t0 = time.perf_counter()
    with open_text_encoder(args.text_encoder, workers=args.n_workers,
                           precision=args.precision, models_dir=args.models_dir,
                           stage_timeout=args.stage_timeout,
                           q8_float_weights=args.q8_float_weights) as te:
        open_s = time.perf_counter() - t0
        try:                              # never overwrite a file of the model it opened
            check_cli_output_path(args.out, what="--out", model_files=opened_model_files(
                te.path, te.directory))
        except OutputPathError as e:
            raise UsageError(str(e)) from None
        return _encode(args, te, prompt, open_s)


def _encode(args: argparse.Namespace, te, prompt: str, open_s: float) -> int:
    from nxhpc.qwen3.model import TextEncoderInputError
    t0 = time.perf_counter_ns()
    ids, templated = te.tokenize_counted(prompt)
    us_tok = (time.perf_counter_ns() - t0) // 1000
    try:
        feats = te.encode_ids(ids)
    except TextEncoderInputError as e:
        raise InputError(f"{args.text_encoder}: {e}") from None
    tm = dict(te.last_timings)
    tm["us_tokenize"] = int(us_tok)
    tm["us_total"] = tm["us_tokenize"] + tm["us_embed"] + tm["us_layers"]
    cfg = te.config
    per_layer = tm["us_layers"] / cfg.layers_needed / 1e6
    report: dict = {
        "model": str(te.directory or te.path), "gguf": str(te.path), "config": cfg.summary(),
        "n_tokens": len(ids), "templated_tokens": templated, "truncated": templated > len(ids),
        "dim": cfg.dim, "layers_run": cfg.layers_needed, "precision": te.precision,
        "workers": te.workers, "open_s": round(open_s, 6),
        "us_tokenize": tm["us_tokenize"], "us_embed": tm["us_embed"],
        "us_layers": tm["us_layers"], "us_total": tm["us_total"],
        "s_per_layer": round(per_layer, 6),
        "s_35_layers": round((tm["us_total"] - tm["us_layers"]) / 1e6
                             + QWEN3_4B_LAYERS_RUN * per_layer, 6)}
    report.update(te.memory())
    if not np.isfinite(feats).all():
        bad = int(np.count_nonzero(~np.isfinite(feats)))
        print(f"{PROG}: error: the features have {bad} NaN/inf values (weights that overflow "
              f"float32); nothing was written to {args.out}", file=sys.stderr, flush=True)
        return Exit.FAIL
    error = save_npy(args.out, feats, "--out", "the features")
    if error:
        raise OutputError(error)
    report["out"] = str(args.out)
    report["shape"] = list(feats.shape)
    if args.json:
        print_json({**report, "ids": [int(i) for i in ids]})
    else:
        print_kv(report, fmt_compact)
        if args.print_ids:
            print("ids=" + ",".join(str(int(i)) for i in ids))
    flush_stdout()
    return Exit.PASS


if __name__ == "__main__":
    sys.exit(main())
