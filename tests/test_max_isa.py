"""``NXHPC_MAX_ISA``: the default ISA capped at a named target, so that a CPU runs the kernels
of a lesser one end to end (an AMX Xeon as an AVX-512 BF16 CPU without tiles, the way an AMD
Zen 4 runs).

Oracles: the dispatch tables' own ranks (every kernel the capped process runs is at or below
the cap, and the cap is reached where the CPU supports it; unset is the negative control); the
precisions' contracts through a whole block: ``q8``'s and ``bf16``'s bits are the same on every
SIMD target below AMX, and AMX's differ (its own summation, and q8's bf16 attention on the
tiles), while equal for 1 and 2 workers; the classes ``nxhpc.runtime.ranks.kernel_bits`` names
(what MPI ranks must share) hold: one class, one set of bits. A bad value is a usage error
before any work.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nxhpc import _kernels as K

ISAS = K.supported_isas()
RANK = {name: info["rank"] for name, info in K.cpu_features()["isas"].items()}


def _env(cap):
    """This environment with SIMD on and the default ISA capped at ``cap`` (None: uncapped)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NXHPC_DISABLE_SIMD", "NXHPC_MAX_ISA")}
    if cap is not None:
        env["NXHPC_MAX_ISA"] = cap
    return env


def _py(code, cap):
    return subprocess.run([sys.executable, "-c", code], env=_env(cap), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("cap", [None, *ISAS])
def test_cap_bounds_every_kernel(cap):
    r = _py("import nxhpc, json; f = nxhpc.cpu_features(); "
            "print(json.dumps([f['best_isa'], f['max_isa'], nxhpc.kernel_variants()]))", cap)
    assert r.returncode == 0, r.stderr
    best, shown, variants = json.loads(r.stdout)
    top = max(ISAS, key=RANK.get)
    want = top if cap is None else cap
    assert best == want and shown == cap
    assert max(RANK[v] for v in variants.values()) <= RANK[want]
    if cap is not None and cap != "generic":     # the cap is used, not just allowed
        assert any(v == cap for v in variants.values())


def test_bad_cap_is_a_usage_error():
    r = _py("import nxhpc._kernels", "sse4")
    assert r.returncode != 0 and "NXHPC_MAX_ISA='sse4'" in r.stderr
    assert "SettingError" in r.stderr
    env = dict(os.environ, NXHPC_MAX_ISA="AMX")        # names are exact
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "NXHPC_MAX_ISA='AMX'" in r.stderr and "Traceback" not in r.stderr
    listed = r.stderr.split("must be one of ")[1].split(" (or unset)")[0].split(", ")
    assert listed == sorted(K.ISA_NAMES, key=RANK.get)   # every ISA name, in rank order
    # --precision auto resolves in argparse's type hook (it runs the kernels): the bad setting
    # must still be the error named, not "invalid value 'auto'"
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1", "--precision",
                        "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "NXHPC_MAX_ISA='AMX'" in r.stderr and "auto" not in r.stderr.splitlines()[-1]


@pytest.mark.parametrize("value", ["false", "off", "no", " 0", "00", "true"])
def test_bad_disable_simd_is_a_usage_error(value):
    """``NXHPC_DISABLE_SIMD=false`` ran the scalar path (the C takes any non-empty value but
    "0" as on; the numerics helper's find): 60x slower and other bits, silently. Only 1, 0 or
    unset are taken now. Controls: 1 runs the scalar kernels, 0 the SIMD ones."""
    env = dict(_env(None), NXHPC_DISABLE_SIMD=value)
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"NXHPC_DISABLE_SIMD={value!r}: must be 1" in r.stderr and "Traceback" not in r.stderr
    code = "import nxhpc; print(nxhpc.kernel_variants()['matmul'])"
    for on, want in (("1", "generic"), ("0", max(ISAS, key=RANK.get))):
        env = dict(_env(None), NXHPC_DISABLE_SIMD=on)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and RANK[r.stdout.strip()] <= RANK[want], r.stderr
        assert (r.stdout.strip() == "generic") == (on == "1" or want == "generic"), r.stdout


def _block(tmp_path, name, cap, precision, workers):
    out = tmp_path / f"{name}.npy"
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", str(workers),
                        "--precision", precision, "--save-output", str(out), "--json"],
                       env=_env(cap), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return np.load(out), json.loads(r.stdout)


SPEC_CAPS = [i for i in ("avx2", "avxvnni", "avx512", "avx512bf16") if i in ISAS]  # spec bits


@pytest.mark.skipif(len(SPEC_CAPS) < 2, reason="fewer than two SIMD targets without AMX here")
@pytest.mark.parametrize("precision", ["q8", "bf16"])
def test_capped_blocks_keep_their_contracts(tmp_path, precision):
    """Every target below AMX runs the spec's bits of q8 and bf16 (matmul and attention): the
    whole block is the same bits under each cap (AVX2's vpmaddubsw / FMA kernels, AVX-VNNI's
    ymm vpdpbusd, the AVX-512 VNNI / vdpbf16ps ones), and for 1 and 2 workers."""
    outs = {cap: _block(tmp_path, f"{precision}_{cap}", cap, precision, 2) for cap in SPEC_CAPS}
    first, (want, _) = SPEC_CAPS[0], outs[SPEC_CAPS[0]]
    for cap, (got, rep) in outs.items():
        assert rep["attention"].startswith("bf16:") and ":amx" not in rep["attention"]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (cap, first)
    one, _ = _block(tmp_path, f"{precision}_1w", SPEC_CAPS[-1], precision, 1)
    assert np.array_equal(one.view(np.uint32), want.view(np.uint32))
    if "amx" in ISAS:
        # negative control: uncapped, the AMX attention (and bf16 matmul) sum their own way
        top, rep = _block(tmp_path, f"{precision}_amx", None, precision, 2)
        assert rep["attention"] == "bf16:amx"
        assert not np.array_equal(top.view(np.uint32), want.view(np.uint32))


@pytest.mark.skipif("avx512bf16" not in ISAS, reason="no AVX-512 BF16 here")
def test_both_attention_dots_through_a_block():
    """The AVX-512 BF16 attention's two dots (K.attention_bf16_dot) give the same block, 2
    workers forked after the choice, and that block is the AVX2 one (the spec's bits)."""
    code = """
import json, sys, numpy as np
from nxhpc import _kernels as K
from nxhpc.models import open_model
res = {}
with open_model("tiny") as m:
    x, pe, t = m.blk_in(0), m.pe(), m.t_emb()
    for dot in ("fma", "vdpbf16ps"):
        K.attention_bf16_dot(dot)
        with m.block(0) as blk:
            out, _ = blk.forward(x, t, pe, workers=2, precision="bf16")
        res[dot] = out.view(np.uint32).tolist()
        res[dot + "_kept"] = K.attention_bf16_dot()
json.dump(res, sys.stdout)
"""
    r = _py(code, "avx512bf16")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["fma_kept"] == "fma" and res["vdpbf16ps_kept"] == "vdpbf16ps"
    assert res["fma"] == res["vdpbf16ps"]
    if "avx2" in ISAS:
        code2 = code.replace('("fma", "vdpbf16ps")', '("fma",)')
        r2 = _py(code2, "avx2")
        assert r2.returncode == 0, r2.stderr
        assert json.loads(r2.stdout)["fma"] == res["fma"]


_BITS = """
import hashlib, json, numpy as np
from nxhpc.models import open_model
from nxhpc.runtime.ranks import kernel_bits
res = {}
with open_model("tiny") as m:
    x, pe, t = m.blk_in(0), m.pe(), m.t_emb()
    for prec in ("f32", "bf16", "q8"):
        with m.block(0) as blk:
            out, _ = blk.forward(x, t, pe, workers=2, precision=prec)
        res[prec] = [kernel_bits(prec), hashlib.sha256(out.tobytes()).hexdigest()]
print(json.dumps(res))
"""


def test_kernel_bits_classes_are_the_bits():
    """``kernel_bits(precision)`` is what MPI ranks compare before splitting a call: under every
    cap this CPU runs, blocks of one class have one set of bits, and blocks of different classes
    differ (so the check refuses no pair it need not, on these inputs)."""
    seen: dict = {}
    for cap in ISAS:
        r = _py(_BITS, cap)
        assert r.returncode == 0, (cap, r.stderr)
        for prec, (cls, digest) in json.loads(r.stdout).items():
            seen.setdefault(prec, {}).setdefault(cls, set()).add(digest)
    for prec, classes in seen.items():
        for cls, digests in classes.items():
            assert len(digests) == 1, (prec, cls, "one class, several sets of bits")
        alls = [d for ds in classes.values() for d in ds]
        assert len(set(alls)) == len(alls), (prec, classes, "two classes gave the same bits")
    assert set(seen["f32"]) >= {"generic"} and "simd" not in seen["f32"]
