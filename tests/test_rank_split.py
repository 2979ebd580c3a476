"""The rank split without MPI: the DiT plan's gathered regions tile their buffers for every
rank count, a bad split is refused before anything is built, one rank imports no MPI, and the
model-file fingerprint tells files apart. (The runs under mpirun: tests/test_mpi_split.py.)

References: plain interval arithmetic (every index of a buffer's split axis covered by exactly
one rank), and copies of a file for the fingerprint.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from nxhpc.dit.config import BlockConfig
from nxhpc.dit.plan import BlockPlan
from nxhpc.nn.engine import Engine, Gather
from nxhpc.runtime.ranks import file_fingerprint, mpi_launched
from nxhpc.runtime.workers import bands

CFGS = [BlockConfig(dim=384, n_heads=6, n_kv_heads=6, head_dim=64, ffn_dim=1024, n_layers=2,
                    adaln_in=256, variant="zimage", adaln_silu=False),
        BlockConfig(dim=3840, n_heads=30, n_kv_heads=30, head_dim=128, ffn_dim=10240,
                    n_layers=30, adaln_in=256, variant="zimage", adaln_silu=False)]


@pytest.mark.parametrize("cfg", CFGS, ids=["tiny", "zimage"])
@pytest.mark.parametrize("R", [1, 2, 3, 4, 7, 64])
def test_gathered_regions_tile_their_buffers(cfg, R):
    T = 37
    plan = BlockPlan(cfg, "layers")
    scratch = plan.scratch(T)
    seen = 0
    for s in plan.stages:
        split = plan.split(s, T)
        if split is None:
            continue
        m = plan.extent(s, T)
        for g in split:
            assert np.prod(scratch[g.name]) == np.prod(g.shape)
            hit = np.zeros(g.shape[g.axis], dtype=int)
            for band in bands(m, R):
                a, b = g.bounds(band)
                hit[a:b] += 1
            assert (hit == 1).all(), (s.name, g.name, R)         # each index by one rank
            seen += 1
    assert seen == 5                  # qkv, attn, atto, f1 (after the gated w13), f2


def test_gather_bounds_clip_and_scale():
    g = Gather("k", (6, 10), 0, offset=-6)          # heads 6..11 of a 12-wide extent
    assert g.bounds((0, 6)) == (0, 0) and g.bounds((4, 9)) == (0, 3)
    assert g.bounds((9, 12)) == (3, 6)
    h = Gather("attn", (5, 6 * 64), 1, unit=64)
    assert h.bounds((2, 4)) == (128, 256)


class _TwoRanks:
    size, rank = 2, 0


class _BadPlan(BlockPlan):
    def split(self, stage, T):
        return (Gather("nope", (T, 4), 1),) if stage.name == "qkv" else None


def test_a_split_naming_no_buffer_is_refused_before_the_arena():
    plan = _BadPlan(CFGS[0], "layers")
    with pytest.raises(ValueError, match="gathers 'nope'"):
        Engine([(plan, 8)], {}, ranks=_TwoRanks())
    eng = Engine([(plan, 8)], {}, ranks=False)     # alone: the split is never consulted
    try:
        assert eng.ranks is None and eng.rank_bands(plan, 8) == {}
    finally:
        eng.close()


def test_one_rank_imports_no_mpi():
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS")}
    code = ("import sys\nfrom nxhpc.runtime import ranks\nimport nxhpc.nn.engine\n"
            "import nxhpc.denoise, nxhpc.sample, nxhpc.blockrun\n"
            "assert ranks.init_world() is None and ranks.world() is None\n"
            "assert 'mpi4py' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_mpi_launched_reads_the_launchers_size(monkeypatch):
    for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(k, raising=False)
    assert not mpi_launched()
    monkeypatch.setenv("PMI_SIZE", "1")
    assert not mpi_launched()                         # srun -n 1: one rank, no MPI
    monkeypatch.setenv("PMI_SIZE", "4")
    assert mpi_launched()


def test_fingerprint_tells_a_changed_byte_and_size_apart(tmp_path):
    rng = np.random.default_rng(0)
    a = tmp_path / "a.bin"
    a.write_bytes(rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    b = tmp_path / "b.bin"
    shutil.copyfile(a, b)
    assert file_fingerprint(a) == file_fingerprint(b)
    data = bytearray(b.read_bytes())
    data[-5] ^= 1                                      # in the last MiB
    b.write_bytes(bytes(data))
    assert file_fingerprint(a) != file_fingerprint(b)
    b.write_bytes(a.read_bytes() + b"\0")
    assert file_fingerprint(a)[0] != file_fingerprint(b)[0]
