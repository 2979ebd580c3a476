"""``mpirun -n R python -m nxhpc.generate`` on the built-in tiny components: one image (its
denoiser calls split across the ranks) and a batch (whole images per rank, gathered by rank 0)
give the PNG bytes of one process; mismatched ranks are refused; a failing rank ends the job
with one error and one exit code and leaves no shared memory.

References: the same command run as one process without mpirun, one worker (each PNG byte for
byte: the text chunks carry no timing). Negative controls: the split without its exchanges,
and a batch where one rank draws other noise, must both differ from the reference. Runs
``mpirun --oversubscribe`` on localhost (2 cores here); skipped only when mpirun or mpi4py is
absent (CI installs both).
"""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from mpiutil import MPI_MARKS, mpirun, run_cli_recording_rc, run_single

from sample_util import shm_entries

pytestmark = MPI_MARKS


# Randomized per session (printed in every failure message through the ids/asserts).
_RNG = np.random.default_rng()
SEED = int(_RNG.integers(0, 2**31))                          # the one-image run's seed
SEEDS = [int(s) for s in _RNG.choice(10**6, size=2, replace=False)]
STEPS = int(_RNG.integers(2, 4))
_WORDS = ["red", "cat", "on", "a", "hill", "under", "blue", "sky", "old", "lamp", "river"]
PROMPTS = [" ".join(_RNG.choice(_WORDS, size=int(n))) for n in _RNG.permutation([2, 4, 7])]
PARAMS = f"seed={SEED} seeds={SEEDS} steps={STEPS} prompts={PROMPTS}"


def _gen(*extra: str) -> list[str]:
    return ["-m", "nxhpc.generate", "--steps", str(STEPS), "--no-progress", "--json", *extra]


def _one(out, workers: int) -> list[str]:
    return _gen("--prompt", PROMPTS[0], "--seed", str(SEED), "--workers", str(workers),
                "--out", str(out))


def _batch(prompts_file, out_dir, workers: int) -> list[str]:
    return _gen("--prompts", str(prompts_file), "--seeds", ",".join(map(str, SEEDS)),
                "--workers", str(workers), "--out", str(out_dir))


def _report(r: subprocess.CompletedProcess) -> dict:
    reps = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(reps) == 1, r.stdout                         # rank 0's one report
    return reps[0]


def _pngs(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix == ".png"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def ref(models, tmp_path_factory):
    """One process, one worker, no mpirun (this also generates the built-ins): the one image's
    PNG bytes, and the batch's PNGs by name."""
    d = tmp_path_factory.mktemp("ref")
    r = run_single(_one(d / "one.png", 1), models)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = _report(r)
    assert "ranks" not in rep
    prompts = d / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    (d / "batch").mkdir()
    r = run_single(_batch(prompts, d / "batch", 1), models)
    assert r.returncode == 0, r.stdout + r.stderr
    batch = _pngs(d / "batch")
    assert len(batch) == 6 and len(set(batch.values())) == 6, PARAMS   # images all differ
    return {"one": (d / "one.png").read_bytes(), "batch": batch, "prompts": prompts}


@pytest.mark.parametrize("ranks,workers", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_one_image_split_across_ranks_same_bytes(ranks, workers, models, ref, tmp_path):
    out = tmp_path / "img.png"
    r = mpirun(ranks, _one(out, workers), models)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_bytes() == ref["one"], PARAMS
    rep = _report(r)
    assert rep["ranks"] == ranks and rep["split"] == "call" and rep["images"] == 1
    assert rep["exchange_bytes"] > 0                         # the calls really were split
    assert sorted(os.listdir(tmp_path)) == ["img.png"]      # rank 0 alone wrote, once


@pytest.mark.parametrize("ranks,workers", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_batch_whole_images_per_rank_same_bytes(ranks, workers, models, ref, tmp_path):
    r = mpirun(ranks, _batch(ref["prompts"], tmp_path, workers), models)
    assert r.returncode == 0, r.stdout + r.stderr
    got = _pngs(tmp_path)
    assert list(got) == list(ref["batch"]), PARAMS
    for name, data in ref["batch"].items():
        assert got[name] == data, (name, PARAMS)
    rep = _report(r)
    assert rep["ranks"] == ranks and rep["split"] == "images" and rep["images"] == 6
    assert rep["rank_of_image"] == [k % ranks for k in range(6)]
    assert rep["out"] == [str(tmp_path / n) for n in ref["batch"]]
    assert len(rep["step_s"]) == 6 and all(len(s) == STEPS for s in rep["step_s"])


def test_guidance_and_noise_across_ranks_same_bytes(models, ref, tmp_path):
    """Classifier-free guidance (two caption lengths per step, each split) on 3 ranks, and a
    batch from one --noise file (rank 0 reads it, every rank starts from it) on 2."""
    g = f"{float(_RNG.uniform(0.5, 4.0)):.3f}"
    noise = tmp_path / "noise.npy"
    np.save(noise, _RNG.standard_normal((16, 8, 8)).astype(np.float32))
    cfg = ("--guidance-scale", g, "--negative-prompt", " ".join(_RNG.choice(_WORDS, size=3)))
    one = _gen(*cfg, "--prompt", PROMPTS[1], "--seed", str(SEED), "--workers", "1")
    many = _gen(*cfg, "--prompts", str(ref["prompts"]), "--noise", str(noise), "--workers", "2")
    for name, args, ranks in (("one", one, 3), ("many", many, 2)):
        want, got = tmp_path / f"{name}-ref", tmp_path / f"{name}-mpi"
        want.mkdir()
        got.mkdir()
        r = run_single([*args, "--out", str(want)], models)
        assert r.returncode == 0, r.stdout + r.stderr
        r = mpirun(ranks, [*args, "--out", str(got)], models)
        assert r.returncode == 0, r.stdout + r.stderr
        assert _report(r)["split"] == ("call" if name == "one" else "images")
        expect = _pngs(want)
        assert len(expect) == (1 if name == "one" else 3)
        assert _pngs(got) == expect, (name, g, PARAMS)


_NO_GATHER = r"""
import sys
import nxhpc.dit.plan as plan
real = plan.BlockPlan.split
plan.BlockPlan.split = lambda self, s, T: None if real(self, s, T) is None else ()
import nxhpc.generate as cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_negative_control_split_without_the_exchange_differs(models, ref, tmp_path):
    """The same rank split without its gathers: each rank misses the others' bands."""
    out = tmp_path / "img.png"
    r = mpirun(2, ["-c", _NO_GATHER, *_one(out, 1)[2:]], models)
    assert r.returncode in (0, 1), r.stdout + r.stderr     # 1: garbage that went NaN
    assert out.is_file() == (r.returncode == 0), r.stdout + r.stderr
    if out.is_file():
        assert out.read_bytes() != ref["one"], PARAMS
        rep = _report(r)
        assert rep["ranks"] == 2 and rep["exchange_bytes"] == 0


_OTHER_NOISE = r"""
import sys
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 1:             # this rank draws its noise from seed + 1
    import nxhpc.dit.sampler as sampler
    real = sampler.initial_noise
    sampler.initial_noise = lambda seed, shape: real(seed + 1, shape)
import nxhpc.generate as cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_negative_control_a_rank_with_other_seeds_differs(models, ref, tmp_path):
    """Rank 1 of 2 samples its images (1, 3, 5) from other seeds: exactly those differ."""
    r = mpirun(2, ["-c", _OTHER_NOISE, *_batch(ref["prompts"], tmp_path, 1)[2:]], models)
    assert r.returncode == 0, r.stdout + r.stderr
    got = _pngs(tmp_path)
    same = [got[n] == ref["batch"][n] for n in ref["batch"]]
    assert same == [True, False, True, False, True, False], PARAMS


def test_mismatched_ranks_refused_before_compute(models, ref, tmp_path):
    from nxhpc.formats.gguf_io import GGUFFile
    src = models / "tiny-dit" / "model.gguf"
    other = tmp_path / "other.gguf"
    shutil.copyfile(src, other)
    g = GGUFFile(src)
    try:
        off = g.info(g.names()[-1]).offset          # lowest mantissa byte of a float32 value
    finally:
        g.close()
    with open(other, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ 1]))
    out = tmp_path / "img.png"
    base = _one(out, 1) + ["--text-encoder", "tiny-te", "--vae", "tiny-vae", "--height", "64",
                           "--width", "64"]
    batch = _batch(ref["prompts"], tmp_path, 1)
    other_seeds = _gen("--prompts", str(ref["prompts"]), "--seeds", f"{SEEDS[0]},{SEEDS[1] + 1}",
                       "--workers", "1", "--out", str(tmp_path))
    for apps, what in (([base + ["--model", "tiny-dit"], base + ["--model", str(other)]],
                        "the model files"),
                       ([batch, other_seeds], "the arguments")):
        r = mpirun(2, [], models, apps=apps)
        assert r.returncode == 4, r.stdout + r.stderr
        assert r.stderr.count("generate: error:") == 1, r.stderr
        assert f"the 2 MPI ranks disagree on {what}" in r.stderr
        if what == "the arguments":    # only the option that differs is named, with each value
            assert f"(--seeds: rank 0 {SEEDS!r}, rank 1 {[SEEDS[0], SEEDS[1] + 1]!r})" \
                in r.stderr, r.stderr
        assert not r.stdout.strip() and not list(tmp_path.glob("*.png"))


_FAULT = r"""
import os, sys
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
mode = sys.argv[1]
if mode == "raise" and rank == 1:              # a worker's task raises on this rank only
    import nxhpc.nn.stages as stages           # where the projection stages call matmul
    real = stages.matmul
    def broken(k, x, w, out, lo, hi, prec):
        if w is not None and x.shape[1] == 1024:        # the denoiser's w2 (ffn_dim 1024)
            raise RuntimeError("injected fault in w2")
        return real(k, x, w, out, lo, hi, prec)
    stages.matmul = broken
elif mode == "hang-start" and rank == 1:      # stuck before the first exchange (a stopped
    import time                                # process, a read that never returns)
    time.sleep(300)
elif mode.startswith("slow-") and rank == 0:  # rank 0's own work, past the stage timeout:
    import time                                # the setup (built-ins generated, a slow stdin),
    import nxhpc.generate as g                 # or the decode of one image
    from nxhpc.vae.model import VaeDecoder
    owner, name = {"slow-setup": (g, "_setup"), "slow-decode": (VaeDecoder, "decode")}[mode]
    def slow(*a, real=getattr(owner, name), **k):
        time.sleep(5)
        return real(*a, **k)
    setattr(owner, name, slow)
elif mode == "bf16-decoder" and rank == 1:   # rank 1's CPU decodes q8 runs in bf16 (a Zen 4
    import nxhpc.generate as g               # beside AVX2 nodes: the same "simd" kernel class)
    g.decoder_precision = lambda precision: "bf16"
elif mode == "other-decoder" and rank == 1:  # a CPU whose q8 bits are rank 0's class but
    import nxhpc.runtime.ranks as rk           # whose decoder's precision gives other bits
    rk.kernel_bits = lambda p, real=rk.kernel_bits: real(p) if p == "q8" else "other-" + real(p)
elif mode == "nan":                            # every rank: the split call's output is NaN
    import numpy as np
    from nxhpc.dit.denoiser import Denoiser
    real_forward = Denoiser.forward
    def forward(self, *a, **k):
        return np.full_like(real_forward(self, *a, **k), np.nan)
    Denoiser.forward = forward
""" + run_cli_recording_rc("nxhpc.generate", 2)


def _fault(mode: str, n: int, args: list[str], models, tmp_path):
    rc_dir = tmp_path / "rc"
    rc_dir.mkdir()
    before = shm_entries()
    r = mpirun(n, ["-c", _FAULT, mode, *args[2:]], models, extra_env={"RC_DIR": str(rc_dir)})
    codes = {int(p.name.split(".")[1]): int(p.read_text()) for p in rc_dir.iterdir()}
    assert shm_entries() <= before, "leaked /dev/shm segments"
    return r, codes


@pytest.mark.parametrize("batch", [False, True], ids=["one-image", "batch"])
def test_a_failing_rank_ends_the_job_with_one_error_and_its_code(batch, models, ref,
                                                                 tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    n = 2 if batch else 3
    args = _batch(ref["prompts"], out, 2) if batch else _one(out / "img.png", 2)
    r, codes = _fault("raise", n, args, models, tmp_path)
    assert r.returncode != 0
    assert codes == dict.fromkeys(range(n), 6), r.stderr
    assert r.stderr.count("generate: error:") == 1, r.stderr
    assert f"generate: error: MPI rank 1 of {n}: worker failure: stage 'w2'" in r.stderr
    assert "injected fault in w2" in r.stderr and '"ranks"' not in r.stdout
    assert not list(out.iterdir())                 # no PNG: the fault came before any write


def test_nan_of_a_split_call_one_error_code_1(models, ref, tmp_path):
    """Every rank holds the same NaN output of the split call: each stops at once with exit 1,
    and only rank 0 says so (no rank waits for another's notice)."""
    r, codes = _fault("nan", 3, _one(tmp_path / "img.png", 1), models, tmp_path)
    assert codes == {0: 1, 1: 1, 2: 1}, r.stderr
    assert r.stderr.count("generate: error:") == 1, r.stderr
    assert "generate: error: step 0 " in r.stderr and "MPI rank" not in r.stderr
    assert not (tmp_path / "img.png").exists()


def test_a_rank_stuck_before_the_first_exchange_is_caught_by_the_stage_timeout(models, ref,
                                                                             tmp_path):
    """Rank 1 never reaches the command-line check: rank 0 waited there forever (the startup
    exchanges had no timeout). Now ``--stage-timeout`` bounds the startup waits: rank 0 fails
    with exit 6 naming the wait, and no shared memory is left."""
    out = tmp_path / "img.png"
    r, codes = _fault("hang-start", 2, _one(out, 1) + ["--stage-timeout", "3"], models, tmp_path)
    assert codes.get(0) == 6, r.stdout + r.stderr
    assert "generate: error: MPI rank 0 of 2: the command-line check did not complete within " \
           "3 s (the stage timeout)" in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("mode", ["slow-setup", "slow-decode"])
def test_the_stage_timeout_does_not_bound_rank_0s_own_work(models, ref, tmp_path, mode):
    """Rank 0 alone resolves the models (a built-in generated on first use: minutes at real
    size) and reads the prompts (a slow stdin) before it broadcasts the run's setup, and alone
    decodes one image while its peers wait for the exit code. Those waits span work, not a
    stage: a stage timeout below them (each stage well within it) failed the run with "another
    rank is hung" (the reviewer's find, for the setup). Same bytes as one process."""
    out = tmp_path / "img.png"
    r, codes = _fault(mode, 2, _one(out, 1) + ["--stage-timeout", "2"], models, tmp_path)
    assert codes == {0: 0, 1: 0}, r.stdout + r.stderr
    assert out.read_bytes() == ref["one"], PARAMS


def test_ranks_that_would_decode_at_other_precisions_are_refused(models, ref, tmp_path):
    """Whole images per rank under q8: a rank whose CPU decodes in bf16 beside ranks that decode
    in f32 made some PNGs with other pixels than one process, while rank 0 wrote its own
    ``vae_precision`` into every one (the reviewer's find). Refused before any work, exit 4,
    naming each rank's. Control: one image split across the ranks (rank 0 alone decodes) runs
    and gives one process's bytes."""
    out = tmp_path / "out"
    out.mkdir()
    r, codes = _fault("bf16-decoder", 2, _batch(ref["prompts"], out, 1), models, tmp_path)
    assert codes == {0: 4, 1: 4}, r.stderr
    assert "disagree on the decoder precision" in r.stderr and "rank 1: bf16" in r.stderr
    assert not list(out.iterdir())
    (tmp_path / "rc").rename(tmp_path / "rc-1")
    r, codes = _fault("bf16-decoder", 2, _one(out / "one.png", 1), models, tmp_path)
    assert codes == {0: 0, 1: 0}, r.stderr
    assert (out / "one.png").read_bytes() == ref["one"], PARAMS


def test_ranks_whose_decoders_give_other_bits_are_refused(models, ref, tmp_path):
    """Whole images per rank under q8 on AVX2 and AVX-512 CPUs without a bf16 unit: the q8
    denoiser's bits are one class there, but each rank decodes its images in f32, whose
    attention gives other bits on AVX-512 (the numerics helper's find, from the code): some
    PNGs would differ from one process's. Refused before any work, exit 4, naming the
    decoder's precision (f32 here on AVX2 or AVX-512 without a bf16 unit, bf16 on AMX or AMD
    Zen 4: rank 1 is made to report another class of it than rank 0's, whatever this CPU is;
    it faked "avx512" and so tested nothing on an AVX-512 CPU). Control: one image split
    across the ranks (rank 0 alone decodes) runs and gives one process's bytes."""
    from nxhpc.nn.conv import decoder_precision
    out = tmp_path / "out"
    out.mkdir()
    r, codes = _fault("other-decoder", 2, _batch(ref["prompts"], out, 1) + ["--precision", "q8"],
                      models, tmp_path)
    assert codes == {0: 4, 1: 4}, r.stderr
    assert f"run decoders that give different {decoder_precision('q8')} bits" in r.stderr, \
        r.stderr
    assert "other-" in r.stderr and "the images each rank decodes" in r.stderr
    assert not list(out.iterdir())
    (tmp_path / "rc").rename(tmp_path / "rc-1")
    q8 = ["--precision", "q8"]
    r, codes = _fault("other-decoder", 2, _one(out / "one.png", 1) + q8, models, tmp_path)
    assert codes == {0: 0, 1: 0}, r.stderr
    r = mpirun(1, _one(tmp_path / "alone.png", 1) + q8, models)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "one.png").read_bytes() == (tmp_path / "alone.png").read_bytes(), PARAMS


def test_one_process_commands_refuse_mpi_ranks(tmp_path):
    """``encode`` and ``decode`` are not split across ranks: under ``mpirun -n 2`` each rank ran
    the whole job and both wrote the one ``--out`` (the QA helper saw three writers). Refused
    now, exit 2, nothing written, one line for the job (each rank printed it: the MPI
    helper's find). Control: the same command as one rank (-n 1) runs."""
    out = tmp_path / "f.npy"
    r = mpirun(3, ["-m", "nxhpc.encode", "tiny-te", "--prompt", "a fox", "--out", str(out)],
               tmp_path / "models")
    assert r.returncode == 2 and "runs in one process, not split across MPI ranks" in r.stderr, \
        r.stderr[-2000:]
    assert r.stderr.count("runs in one process") == 1, r.stderr[-2000:]
    assert not out.exists()
    r = mpirun(1, ["-m", "nxhpc.encode", "tiny-te", "--prompt", "a fox", "--out", str(out)],
               tmp_path / "models")
    assert r.returncode == 0 and out.exists(), r.stderr[-2000:]
    lat = tmp_path / "z.npy"
    np.save(lat, np.zeros((16, 4, 4), np.float32))
    r = mpirun(2, ["-m", "nxhpc.decode", "tiny-vae", "--latents", str(lat), "--out",
                   str(tmp_path / "x.png")], tmp_path / "models")
    assert r.returncode == 2 and "runs in one process" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "x.png").exists()
