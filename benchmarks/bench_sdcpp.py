"""nxhpc ``generate`` against stable-diffusion.cpp's ``sd-cli`` on the same three files: prompt ->
features -> 8 Turbo steps -> PNG, seconds per stage, both on this machine's CPU cores.

stable-diffusion.cpp (leejet/stable-diffusion.cpp, on ggml) is what users of these GGUF files run
on a CPU without Python. It is not a Python package: build it yourself, outside this project, and
point ``NXHPC_SDCPP`` at its ``sd-cli``; without it every case here is skipped. How it was built
for the figures in benchmarks/README.md (CPU backend only, ``-march=native``, as a user compiling
it on their own machine gets):

    git clone --recursive https://github.com/leejet/stable-diffusion.cpp && cd stable-diffusion.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DSD_WEBP=OFF -DSD_WEBM=OFF \\
          -DSD_SERVER_BUILD_FRONTEND=OFF
    cmake --build build -j --target sd-cli
    NXHPC_SDCPP=$PWD/build/bin/sd-cli python -m pytest benchmarks/bench_sdcpp.py --benchmark-only -s

The files (random weights, generated once; real widths, fewer layers):
- denoiser ``NXHPC_BENCH_DENOISER`` (default ``zimage-dit-2l-q4km``: Z-Image dims, 2 main layers,
  2 + 2 refiners; main layers Q4_K with qkv Q5_K and w2 Q6_K, refiners and embedders BF16, as
  the ComfyUI Q4_K_M files), or ``sdcpp-q4_0`` (the same model in the layout of
  stable-diffusion.cpp's own Q4_0 files: every matrix of the layers and refiners Q4_0);
- text encoder: ``bench_text_encoder``'s 2-block Qwen3-4B slice with Qwen3-4B's whole vocabulary
  (151936 rows, $NXHPC_MODELS/bench-qwen3-4b-2l-v151936, 0.6 GB): sd-cli tokenizes with its own
  Qwen3 vocabulary, whose ids must fit the embedding;
- autoencoder: ``bench_vae``'s FLUX decoder at its real widths (BF16) plus a random encoder of
  the FLUX layout, which sd-cli's loader requires (nxhpc reads the decoder only).

Each tool runs once, in a child process, at 512x512 (``NXHPC_BENCH_SDCPP_PX``), 8 steps
(``NXHPC_BENCH_SDCPP_STEPS``, at least 2), no classifier-free guidance, 2 threads / workers.
nxhpc: ``python -m nxhpc.generate --json`` at each precision of
``NXHPC_BENCH_SDCPP_PRECISIONS`` (default ``auto``: the fastest on this CPU). sd-cli:
``--cfg-scale 1 --diffusion-fa -t 2 -v`` (the flash attention its Z-Image guide uses); its seconds
are read from its log: the progress bar's seconds per step, ``get_learned_condition``,
``sampling``, ``decode_first_stage`` and ``generate_image`` (its own total: model loading
before it is not counted; sd-cli loads the denoiser's tensors lazily inside the first step). Peak
RSS: each child's own (``os.wait4`` in a small launcher that forks it: ``_LAUNCHER``; started from
pytest itself, a child's figure would begin at pytest's peak). The steady step is the median of
steps 2.. (the first holds one-off work in both tools: nxhpc forks its pool, sd-cli reads the
weights).

What differs besides speed, and is reported rather than equalized: the caption. sd-cli tokenizes
the prompt with its built-in vocabulary, nxhpc with the file's (this slice's tiny vocabulary), so
their caption lengths differ; both are printed (``caption_tokens``) and the image's 1024 tokens
dominate either way. The noise generators differ too (the images are not compared; both PNGs are
checked to exist at the requested size). A table is printed and written to
``.benchmarks/bench_sdcpp.md``.
"""
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _bench_util import record, summary_fixture

SDCPP = os.environ.get("NXHPC_SDCPP", "")
PX = int(os.environ.get("NXHPC_BENCH_SDCPP_PX", "512"))
STEPS = max(2, int(os.environ.get("NXHPC_BENCH_SDCPP_STEPS", "8")))
WORKERS = 2
DENOISER = os.environ.get("NXHPC_BENCH_DENOISER", "zimage-dit-2l-q4km")
PRECISIONS = os.environ.get("NXHPC_BENCH_SDCPP_PRECISIONS", "auto").split(",")
PROMPT = "a red fox runs through the snowy forest at dawn"
VOCAB = 151936                      # Qwen3-4B's embedding rows
RESULTS: dict = {}
_TITLE = (f"bench_sdcpp: {PX}x{PX}, {STEPS} steps, no CFG, {WORKERS} threads / workers; "
          f"denoiser {DENOISER}, text encoder Qwen3-4B dims 2 blocks, FLUX decoder real widths")
_HEAD = ("| backend | caption tokens | encode s | step s: first, median of rest | decode s | "
         "total s | steady step vs sd-cli | peak RSS MB | load before / after |")
GROUP = f"generate {PX}x{PX} {STEPS} steps vs stable-diffusion.cpp ({DENOISER})"

pytestmark = pytest.mark.skipif(
    not (SDCPP and os.access(SDCPP, os.X_OK)),
    reason="set NXHPC_SDCPP to a built stable-diffusion.cpp sd-cli (this file's docstring)")


def _row(key, r) -> list:
    ref = RESULTS.get(("sd-cli", key[1]))
    vs = "" if ref is None or r is ref else f"{ref['steady_step_s'] / r['steady_step_s']:.1f}x"
    steps = r["step_s"]
    return [key[0], r["caption_tokens"], f"{r['encode_s']:.2f}",
            f"{steps[0]:.2f}, {r['steady_step_s']:.2f}", f"{r['decode_s']:.2f}",
            f"{r['total_s']:.1f}", vs, f"{r['peak_rss_mb']:.0f}",
            f"{r['load_before']:.1f} / {r['load_after']:.1f}"]


_summary = summary_fixture(RESULTS, "bench_sdcpp", _TITLE, _HEAD, _row)


# ----------------------------------------------------------------------------- the files

def _encoder_shapes(ch: tuple[int, ...], z: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the FLUX ``ae.safetensors`` encoder (BFL names) whose levels have ``ch``
    channels (the decoder's, read the other way) and ``z`` latent channels: conv_in, per level
    two resnet blocks (a 1x1 shortcut where the width changes) and a downsample but at the last,
    the mid block's two resnets and attention, norm_out, conv_out to 2 x ``z`` channels."""
    s: dict[str, tuple[int, ...]] = {}

    def conv(name, cout, cin, k):
        s[f"{name}.weight"], s[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        s[f"{name}.weight"], s[f"{name}.bias"] = (c,), (c,)

    def resnet(name, cin, cout):
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cout, cin, 3)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cout, cin, 1)

    conv("encoder.conv_in", ch[0], 3, 3)
    cin = ch[0]
    for i, c in enumerate(ch):
        for j in range(2):
            resnet(f"encoder.down.{i}.block.{j}", cin if j == 0 else c, c)
        cin = c
        if i < len(ch) - 1:
            conv(f"encoder.down.{i}.downsample.conv", c, c, 3)
    c = ch[-1]
    resnet("encoder.mid.block_1", c, c)
    norm("encoder.mid.attn_1.norm", c)
    for n in ("q", "k", "v", "proj_out"):
        conv(f"encoder.mid.attn_1.{n}", c, c, 1)
    resnet("encoder.mid.block_2", c, c)
    norm("encoder.norm_out", c)
    conv("encoder.conv_out", 2 * z, c, 3)
    return s


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(denoiser .gguf, text encoder .gguf, ae.safetensors); the autoencoder is written to a
    temporary folder and removed at the end."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from bench_text_encoder import _file as te_file
    from bench_vae import SPEC
    from nxhpc.models.registry import ensure_builtin, models_dir
    from nxhpc.models.synthetic import SyntheticSpec, make_synthetic
    from nxhpc.models.vae_files import draw_vae_tensor
    if DENOISER == "sdcpp-q4_0":
        d = models_dir() / "bench-zimage-dit-2l-sdcpp-q4_0"
        if not (d / "model.gguf").is_file():
            make_synthetic(d, SyntheticSpec.zimage_dit(2, layout="sdcpp-q4_0"), replace=True)
        dit = d / "model.gguf"
    else:
        dit = ensure_builtin(DENOISER, models_dir()) / "model.gguf"
    te = te_file(VOCAB)
    vae = tmp_path_factory.mktemp("bench-sdcpp") / "ae.safetensors"
    t = {n: torch.from_numpy(draw_vae_tensor(SPEC, i, n, s)).to(torch.bfloat16)
         for i, (n, s) in enumerate(SPEC.shapes().items())}
    rng = np.random.default_rng(7)
    for n, s in _encoder_shapes(tuple(SPEC.block_out_channels), SPEC.latent_channels).items():
        a = rng.standard_normal(s, dtype=np.float32) * np.float32(0.02 if len(s) > 1 else 0.1)
        if len(s) == 1 and ".norm" in n and n.endswith("weight"):
            a += 1
        t[n] = torch.from_numpy(a).to(torch.bfloat16)
    save_file({n: v.contiguous() for n, v in t.items()}, str(vae))
    yield dit, te, vae
    vae.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the runs

# A child that subprocess starts (vfork + exec) inherits this process's peak in its ru_maxrss:
# Linux keeps the replaced memory's high-water mark in the process's maxrss at exec, so pytest's
# hundreds of MB would stand for a small child's peak. The measured command is therefore forked
# by this launcher, a fresh interpreter without site packages (a few MB; a fork gets a zeroed
# maxrss and a copy of its parent's small memory). Run as ``python -I -S -c _LAUNCHER FD ARGV..``
# it runs ARGV in a fork of itself (same stdout, stderr and environment), waits for it and writes
# "wait status, ru_maxrss in KiB, seconds from fork to exit" to the file descriptor FD.
_LAUNCHER = """\
import os, sys, time
fd = int(sys.argv[1])
os.set_inheritable(fd, False)
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        os.write(2, f"launcher: cannot run {sys.argv[2]!r}: {e}\\n".encode())
    os._exit(127)
_, status, ru = os.wait4(pid, 0)
os.write(fd, f"{status} {ru.ru_maxrss} {time.perf_counter() - t0!r}".encode())
"""


def _launch(argv: list[str], env: dict | None = None,
            **popen) -> tuple[bytes | None, int, float, float]:
    """Run ``argv`` to completion through :data:`_LAUNCHER` (``popen``: Popen's stdout / stderr
    for it; a stdout pipe is read to its end before the wait): (that stdout, None when not a
    pipe; ``argv``'s exit code, -signal if killed; seconds from its fork to its exit; its own
    peak RSS in MB)."""
    rfd, wfd = os.pipe()
    with os.fdopen(rfd, "rb") as meas:
        try:
            p = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(wfd), *argv],
                                 env=env, pass_fds=(wfd,), **popen)
        finally:
            os.close(wfd)
        out = None
        if p.stdout is not None:
            out = p.stdout.read()
            p.stdout.close()
        launcher_rc = p.wait()
        fields = meas.read().split()
    assert launcher_rc == 0 and len(fields) == 3, (
        f"launcher of {argv[0]} failed ({launcher_rc}, {fields})")
    return (out, os.waitstatus_to_exitcode(int(fields[0])), float(fields[2]),
            int(fields[1]) * 1024 / 1e6)                       # KiB -> MB, as generate reports


def _run(argv: list[str], env: dict | None = None,
         merge: bool = True) -> tuple[str, float, float, float]:
    """Run ``argv`` to completion (:func:`_launch`): (its stdout, with stderr when ``merge``;
    wall s; the child's own peak RSS in MB; the 1-minute load average before). Without
    ``merge`` stderr goes to a temporary file, shown only if the child fails."""
    import tempfile
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile() as err:
        out, rc, wall, rss = _launch(argv, env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if merge else err)
        err.seek(0)
        tail = err.read()[-3000:].decode(errors="replace")
    text = out.decode(errors="replace")
    assert rc == 0, f"{argv[0]} failed ({rc}):\n{text[-3000:]}{tail}"
    return text, wall, rss, load


def _png_size(path: Path) -> tuple[int, int]:
    from PIL import Image
    with Image.open(path) as im:
        return im.size


_SEC = r"([0-9.]+)s"


def _sdcpp_seconds(log: str) -> dict:
    """sd-cli's stage seconds and per-step seconds from its log (``-v``)."""
    def one(pat):
        m = re.search(pat, log)
        assert m, f"sd-cli log has no {pat!r}"
        return float(m.group(1))
    steps = []
    for line in log.replace("\r", "\n").splitlines():   # progress bar: "| 3/8 - 1.23s/it"
        m = re.search(r"\|\s*(\d+)/(\d+) - ([0-9.]+)(s/it|it/s)", line)
        if m:
            v = float(m.group(3))
            steps.append((int(m.group(1)), v if m.group(4) == "s/it" else 1 / v))
    per = [s for _, s in sorted(dict(steps).items())]
    assert len(per) == STEPS, f"sd-cli printed {len(per)} step times, expected {STEPS}"
    prompt = re.search(r'split prompt "' + re.escape(PROMPT) + r'" to (\d+) tokens', log)
    return {"encode_s": one(r"get_learned_condition completed, taking " + _SEC),
            "sampling_s": one(r"sampling completed, taking " + _SEC),
            "decode_s": one(r"decode_first_stage completed, taking " + _SEC),
            "total_s": one(r"generate_image completed in " + _SEC),
            "step_s": per, "prompt_tokens": int(prompt.group(1)) if prompt else None}


def test_generate_sdcpp(benchmark, files, tmp_path):
    dit, te, vae = files
    out = tmp_path / "sdcpp.png"
    argv = [SDCPP, "--diffusion-model", str(dit), "--llm", str(te), "--vae", str(vae),
            "-p", PROMPT, "--cfg-scale", "1.0", "--steps", str(STEPS), "-H", str(PX), "-W",
            str(PX), "-t", str(WORKERS), "--diffusion-fa", "-v", "-o", str(out)]
    benchmark.group = GROUP
    res = {}

    def run():
        res["log"], res["wall"], res["rss"], res["load"] = _run(argv)
    benchmark.pedantic(run, rounds=1, iterations=1)
    log = res["log"]
    r = _sdcpp_seconds(log)
    assert _png_size(out) == (PX, PX)
    info = re.search(r"System Info:\s*(.*)", log)
    r.update(steady_step_s=statistics.median(r["step_s"][1:]), peak_rss_mb=res["rss"],
             wall_s=res["wall"], load_before=res["load"], load_after=os.getloadavg()[0],
             caption_tokens=(f"prompt {r['prompt_tokens']} + template"
                             if r["prompt_tokens"] is not None else "?"),
             argv=" ".join(argv[1:]), system_info=info.group(1).strip() if info else None)
    record(benchmark, RESULTS, ("sd-cli", PX), r)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_generate_nxhpc(benchmark, files, tmp_path, precision):
    from nxhpc.qwen3.encoder import TextEncoder
    dit, te, vae = files
    out = tmp_path / "nxhpc.png"
    argv = [sys.executable, "-m", "nxhpc.generate", "--prompt", PROMPT, "--model", str(dit),
            "--text-encoder", str(te), "--vae", str(vae), "--height", str(PX), "--width",
            str(PX), "--steps", str(STEPS), "--precision", precision, "--workers",
            str(WORKERS), "--out", str(out), "--json", "--no-progress"]
    benchmark.group = GROUP
    res = {}

    def run():
        res["log"], res["wall"], res["rss"], res["load"] = _run(
            argv, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), merge=False)
    benchmark.pedantic(run, rounds=1, iterations=1)
    j = json.loads(res["log"])
    assert _png_size(out) == (PX, PX)
    with TextEncoder(te, workers=1) as enc:
        n_cap = enc.templated_length(PROMPT)
    r = {k: j[k] for k in ("precision", "attention", "open_s", "encode_s", "denoise_s",
                           "decode_s", "total_s")}
    r["step_s"] = j["step_s"][0]                          # the one image's steps
    r.update(steady_step_s=statistics.median(r["step_s"][1:]), peak_rss_mb=res["rss"],
             worker_peak_rss_mb=j.get("worker_peak_rss_mb"), wall_s=res["wall"],
             load_before=res["load"], load_after=os.getloadavg()[0],
             caption_tokens=f"{n_cap} (templated)", requested_precision=precision)
    # keyed by the precision asked for: "auto" and the one it resolves to are two rows
    name = precision if precision == r["precision"] else f"{precision} ({r['precision']})"
    record(benchmark, RESULTS, (f"nxhpc {name}", PX), r)
