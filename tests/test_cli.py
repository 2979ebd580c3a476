"""The one CLI layer (``nxhpc.cli``): one exit-code table shared by every CLI, console commands,
each ``--help`` naming only its own options and codes, the ``nxhpc <command>`` entry point, the
shadowed-package repair, and the boundary checks (``nxhpc.runtime.checks``) with their negative
cases; and exit codes in hard cases (a Ctrl-C that C code turned into another error during
generation: 130; a worker stopped mid-run: 6). The CLIs' behaviour per command is tested in
test_blockrun.py, test_denoiser.py, test_sample_cli.py, test_models.py and test_ddp.py."""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from nxhpc.cli import args as types
from nxhpc.cli.codes import DEFAULT_TEXT, Exit, code_for, codes_epilog
from nxhpc.cli.main import COMMANDS
from nxhpc.runtime import checks
from procutil import linux_only, models_env

ROOT = Path(__file__).resolve().parents[1]
CLI_MODULES = [mod for mod, _ in COMMANDS.values()]

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


# ------------------------------------------------------------------ one exit-code table

def test_exit_numbers_are_the_documented_ones():
    """The table the README documents; a number never changes meaning."""
    assert {c.name: int(c) for c in Exit} == {
        "PASS": 0, "FAIL": 1, "USAGE": 2, "NOT_FOUND": 3, "BAD_INPUT": 4, "MISSING": 5,
        "WORKER": 6, "SHM": 7, "OUTPUT": 8, "MODELS_DIR": 9, "INTERNAL": 70, "SIGHUP": 129,
        "SIGINT": 130, "SIGTERM": 143}
    assert set(DEFAULT_TEXT) == set(Exit)


@pytest.mark.parametrize("mod", CLI_MODULES)
def test_every_cli_uses_the_shared_codes_only(mod):
    m = importlib.import_module(mod)
    assert m.EXIT_CODES and all(isinstance(k, Exit) for k in m.EXIT_CODES), m.EXIT_CODES
    for always in (Exit.PASS, Exit.USAGE, Exit.INTERNAL, Exit.SIGHUP, Exit.SIGINT,
                   Exit.SIGTERM):
        assert always in m.EXIT_CODES, (mod, always)
    # no CLI keeps a private number: no EXIT_* integer constants of its own
    own = {k for k, v in vars(m).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert not own, (mod, own)


def test_the_same_condition_has_the_same_code_everywhere():
    """The models directory that cannot take the model was 9 in blockrun/denoise/sample but 3
    in ``models``; a model not found was 3 in blockrun but 1 in ``models``."""
    from nxhpc.formats.gguf_io import MissingTensorError, ModelFileError, ModelNotFoundError
    from nxhpc.models.modeldir import ModelsDirError
    from nxhpc.runtime.outfile import OutputPathError
    from nxhpc.runtime.shm import ShmSpaceError
    from nxhpc.runtime.workers import WorkerError
    from nxhpc.train.ddp import DDPTimeoutError, DDPWorkerError
    from nxhpc.train.q16 import Q16OverflowError
    import nxhpc.dit.sampler as sampler
    cases = [(ModelsDirError, Exit.MODELS_DIR), (ModelNotFoundError, Exit.NOT_FOUND),
             (MissingTensorError, Exit.MISSING), (ModelFileError, Exit.BAD_INPUT),
             (WorkerError, Exit.WORKER), (DDPWorkerError, Exit.WORKER),
             (DDPTimeoutError, Exit.WORKER), (ShmSpaceError, Exit.SHM),
             (OutputPathError, Exit.USAGE), (Q16OverflowError, Exit.FAIL),
             (sampler.NonFiniteOutputError, Exit.FAIL),
             (sampler.SampleInputError, Exit.BAD_INPUT),
             (checks.InputFileMissing, Exit.USAGE), (checks.CheckError, Exit.BAD_INPUT)]
    cases = [(cls.__new__(cls), code) for cls, code in cases]   # no constructor arguments needed
    for e, code in cases:
        assert code_for(e) == code, (type(e).__name__, code_for(e), code)
    assert code_for(TypeError("a bug")) is None and code_for(KeyError("a bug")) is None


def _help(mod: str, *extra: str) -> str:
    r = subprocess.run([sys.executable, "-m", mod, *extra, "--help"], capture_output=True,
                       text=True, cwd=ROOT, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _env(**kw) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(kw)
    return env


def _listed_codes(help_text: str) -> list[int]:
    block = help_text.split("exit codes:\n", 1)[1]
    return [int(m.group(1)) for m in re.finditer(r"^\s{1,4}(\d+)\s{2}", block, re.M)]


def _own_options(p: argparse.ArgumentParser) -> set[str]:
    own = set()
    for a in p._actions:
        own.update(a.option_strings)
        if isinstance(getattr(a, "choices", None), dict):     # subcommands
            for sub in a.choices.values():
                own |= _own_options(sub)
    return own


@pytest.mark.parametrize("mod", CLI_MODULES)
def test_help_lists_its_own_codes_and_options_only(mod):
    """``denoise --help`` named ``--save-output`` and ``--layers`` (blockrun's codes' text),
    which denoise rejects. Now every option a --help names is one of that CLI's (Docker's
    ``--shm-size`` aside), and its code list is exactly its EXIT_CODES, in order."""
    m = importlib.import_module(mod)
    text = _help(mod if mod != "nxhpc.models.cli" else "nxhpc.models")
    assert _listed_codes(text) == sorted(int(c) for c in m.EXIT_CODES)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    foreign = named - _own_options(m.build_parser()) - {"--shm-size"}
    assert not foreign, (mod, foreign)


def test_denoise_help_does_not_name_blockrun_options():
    text = _help("nxhpc.denoise")
    assert "--save-output" not in text and "--layers" not in text
    assert "--out" in text                                       # positive control


def test_codes_epilog_wraps_and_defaults():
    text = codes_epilog({Exit.PASS: None, Exit.MODELS_DIR: "x " * 80})
    lines = text.splitlines()
    assert lines[0] == "exit codes:" and lines[1] == "    0  ok"
    assert lines[2].startswith("    9  x x") and all(len(l) <= 92 for l in lines)
    assert lines[3].startswith("       x")


# ------------------------------------------------------------------ console commands

def _scripts() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        return tomllib.loads(text)["project"]["scripts"]
    block = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', block, re.M))


def test_every_cli_is_a_console_command():
    scripts = _scripts()
    assert scripts["nxhpc"] == "nxhpc.cli.main:main"
    for name, (mod, _) in COMMANDS.items():
        assert scripts[f"nxhpc-{name}"] == f"{mod}:main", name
    for target in scripts.values():
        mod, func = target.split(":")
        assert callable(getattr(importlib.import_module(mod), func)), target


def test_packages_list_holds_every_package():
    """setuptools' explicit package list must name nxhpc.cli (or the commands do not install)."""
    text = (ROOT / "pyproject.toml").read_text()
    pkgs = set(re.findall(r'"(nxhpc(?:\.\w+)*)"', text.split("packages = [", 1)[1].split("]")[0]))
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "nxhpc").rglob("__init__.py")}
    assert on_disk <= pkgs, on_disk - pkgs


def test_test_extra_brings_what_the_tests_import():
    """The README's `pip install -e '.[test]'` must bring every package a test imports or
    skips on, so that no test skips for a missing package (transformers was missing)."""
    text = (ROOT / "pyproject.toml").read_text()
    extra = text.split("test = [", 1)[1].split("]", 1)[0]
    listed = {re.split(r"[<>=!~\[]", s)[0].lower()
              for s in re.findall(r'"([^"]+)"', extra)}
    needed = set()
    for f in (ROOT / "tests").glob("*.py"):
        src = f.read_text()
        needed |= set(re.findall(r'importorskip\("([\w-]+)', src))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                needed |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                needed.add(node.module.split(".")[0])
    third_party = {n for n in needed if n not in sys.stdlib_module_names
                   and not (ROOT / "tests" / f"{n}.py").exists() and n != "nxhpc"}
    aliases = {"sklearn": "scikit-learn"}
    # brought by a listed package or the build: Pillow by diffusers, tokenizers by
    # transformers, setuptools by [build-system] (and pip)
    brought = {"numpy", "gguf", "safetensors", "PIL", "tokenizers", "setuptools"}
    missing = {aliases.get(n, n) for n in third_party - brought} - listed
    assert not missing, missing
    assert "transformers" in listed and "diffusers" in listed


def test_nxhpc_entry_point_dispatches(tmp_path):
    from nxhpc.cli.main import main
    assert main(["no-such-command"]) == Exit.USAGE
    r = subprocess.run([sys.executable, "-m", "nxhpc", "--help"], capture_output=True,
                       text=True, cwd=ROOT, env=_env(), timeout=120)
    assert r.returncode == 0 and all(c in r.stdout for c in COMMANDS), r.stderr
    assert _listed_codes(r.stdout) == sorted(int(c) for c in Exit)
    import nxhpc
    for env, isa in (({}, nxhpc.supported_isas()[-1]), ({"NXHPC_DISABLE_SIMD": "1"}, "generic"),
                     ({"NXHPC_MAX_ISA": "bad"}, "not loaded: NXHPC_MAX_ISA='bad'")):
        r = subprocess.run([sys.executable, "-m", "nxhpc", "--version"], capture_output=True,
                           text=True, cwd=ROOT, env=_env(**env), timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(
            f"nxhpc {nxhpc.__version__} (kernels: {isa}"), (env, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "nxhpc", "models", "list"], capture_output=True,
                       text=True, cwd=ROOT, env=_env(NXHPC_MODELS=str(tmp_path)), timeout=120)
    assert r.returncode == 0 and "tiny" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "nxhpc", "blockrun", "tiny", "0"],
                       capture_output=True, text=True, cwd=ROOT,
                       env=_env(NXHPC_MODELS=str(tmp_path)), timeout=120)
    assert r.returncode == Exit.USAGE and "n_workers" in r.stderr


def test_ctrl_c_while_a_command_loads_is_exit_130(monkeypatch, capsys):
    """Ctrl-C while ``nxhpc <command>`` imports the command (a second or more of torch-free
    imports, before the command's frame handles signals) is exit 130 without a traceback (it
    was Python's KeyboardInterrupt traceback). Control: the same command loads and runs."""
    cli_main = importlib.import_module("nxhpc.cli.main")
    real = importlib.import_module

    def interrupted(name, *a, **k):
        if name == "nxhpc.encode":
            raise KeyboardInterrupt
        return real(name, *a, **k)
    monkeypatch.setattr(cli_main.importlib, "import_module", interrupted)
    try:
        code = cli_main.main(["encode", "--help"])
    except KeyboardInterrupt:          # (escaping, it would stop the whole pytest session)
        pytest.fail("the KeyboardInterrupt escaped nxhpc's main()")
    assert code == Exit.SIGINT
    monkeypatch.setattr(cli_main.importlib, "import_module", real)
    assert cli_main.main(["encode", "--help"]) == 0
    assert "usage:" in capsys.readouterr().out


def test_no_cli_imports_a_private_name_of_another():
    clis = {m for m in CLI_MODULES}
    for mod in CLI_MODULES:
        path = ROOT / (mod.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in clis - {mod}:
                raise AssertionError(f"{mod} imports from the CLI {node.module}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nxhpc"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (mod, node.module, private)


# ------------------------------------------------------------------ the shadowed package

_SHADOW = r"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path             # drop the env's own nxhpc finder
                    if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path[:] = [p for p in sys.path                        # drop the checkout (not a sibling
              if p not in ("", ".") and p != {root!r}       # such as a venv at <root>env, nor
              and not (p.startswith({root!r} + "/")         # a venv's packages inside it)
                       and "site-packages" not in p.split("/"))]
sys.path.insert(0, "")                                    # python -m: the current directory
import finder                                             # setuptools' editable finder
finder.install()
import runpy
sys.argv = ["nxhpc.blockrun", *sys.argv[1:]]
runpy.run_module("nxhpc.blockrun", run_name="__main__", alter_sys=True)
"""


def _editable_finder(tmp_path: Path) -> Path:
    """setuptools' own editable finder module, mapping ``nxhpc`` to this checkout."""
    ew = pytest.importorskip("setuptools.command.editable_wheel")
    src = ew._finder_template("__editable___nxhpc_test_finder", {"nxhpc": str(ROOT / "nxhpc")},
                              {})
    d = tmp_path / "site"
    d.mkdir()
    (d / "finder.py").write_text(src)
    return d


def test_run_from_the_directory_holding_the_clone(tmp_path, models_dir_env):
    """``git clone ... nxhpc; pip install -e nxhpc; python -m nxhpc.blockrun tiny`` from the
    directory holding the clone: the clone folder (no __init__.py) is found on sys.path before
    setuptools' editable finder and becomes a namespace package ``nxhpc``; nxhpc/__init__.py
    never ran, and blockrun died with exit 70 ``module 'nxhpc' has no attribute 'kernels'``.
    Reproduced with setuptools' real finder; the CLI layer now loads the real package."""
    site = _editable_finder(tmp_path)
    work = tmp_path / "work"
    (work / "nxhpc").mkdir(parents=True)          # the clone folder: a checkout, no __init__
    (work / "nxhpc" / "pyproject.toml").write_text("")
    env = dict(os.environ, PYTHONPATH=str(site), NXHPC_MODELS=models_dir_env)
    code = _SHADOW.format(root=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code, "tiny", "1"], capture_output=True,
                       text=True, cwd=work, env=env, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "PASS" in r.stdout and "Traceback" not in r.stderr

    # the state itself, checked: the namespace package is what the finder order gives
    probe = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not getattr(f, "__module__", "").startswith("__editable__")]
        sys.path[:] = [p for p in sys.path if p not in ("", ".") and p != {str(ROOT)!r}
                       and not (p.startswith({str(ROOT) + "/"!r})
                                and "site-packages" not in p.split("/"))]
        sys.path.insert(0, "")
        import finder; finder.install()
        import nxhpc
        before = getattr(nxhpc, "__file__", None)
        import nxhpc.cli
        after = sys.modules["nxhpc"]
        print(before, after.__file__, hasattr(after, "kernels"))
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=work,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after, has_kernels = r.stdout.split()
    assert before == "None"                                   # the namespace package
    assert after == str(ROOT / "nxhpc" / "__init__.py") and has_kernels == "True"


@pytest.fixture
def models_dir_env(tmp_path_factory):
    return os.environ.get("NXHPC_MODELS") or str(tmp_path_factory.mktemp("models"))


# ------------------------------------------------------------------ boundary checks

@pytest.mark.parametrize("v", [1, 3, np.int64(2), np.int32(5)])
def test_check_workers_accepts(v):
    assert checks.check_workers(v) == int(v) and type(checks.check_workers(v)) is int


def test_check_workers_default_and_cap():
    from nxhpc.runtime.workers import max_workers, usable_cpus
    assert checks.check_workers(None) == usable_cpus()
    assert checks.check_workers(max_workers()) == max_workers()
    with pytest.raises(checks.CheckError, match="at most"):
        checks.check_workers(max_workers() + 1)


@pytest.mark.parametrize("v", [0, -1, True, False, 2.0, 2.5, "2", [2], float("nan")])
def test_check_workers_refuses(v):
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        checks.check_workers(v)


def test_one_worker_rule_at_every_entry():
    """Worker counts were checked four times with three rules (WorkerPool capped, Block not,
    Denoiser capped with another text). Now every entry says the same about the same value."""
    from nxhpc.dit import block
    from nxhpc.dit.config import BlockConfig
    from nxhpc.runtime.workers import WorkerPool, max_workers
    too_many = max_workers() + 1
    cfg = BlockConfig(dim=64, n_heads=2, n_kv_heads=2, head_dim=32, ffn_dim=128, n_layers=1,
                      adaln_in=64, variant="zimage", adaln_silu=False)
    for bad in (0, True, 2.5, too_many):
        msgs = []
        for call in (lambda: WorkerPool(bad, {}),
                     lambda: block.BlockRunner(cfg, {}, 4, workers=bad),   # Block's own check
                     lambda: checks.check_workers(bad, "workers")):
            with pytest.raises(ValueError) as e:
                call()
            msgs.append(str(e.value).split("workers ", 1)[1])
        assert len(set(msgs)) == 1, msgs
    src = (ROOT / "nxhpc" / "dit" / "denoiser.py").read_text()
    assert "check_workers(workers" in src


@pytest.mark.parametrize("v, ok", [(None, None), (1, 1.0), (0.5, 0.5), (np.float32(2), 2.0)])
def test_check_seconds_accepts(v, ok):
    assert checks.check_seconds(v) == ok


@pytest.mark.parametrize("v", [0, -1, math.inf, math.nan, True, "5", [1]])
def test_check_seconds_refuses(v):
    with pytest.raises(ValueError, match="positive number of seconds"):
        checks.check_seconds(v, "stage_timeout")


def test_workers_check_timeout_is_the_checks_rule():
    from nxhpc.runtime.workers import check_timeout
    assert check_timeout(None) is None and check_timeout(3) == 3.0
    with pytest.raises(ValueError, match="stage_timeout must be None or a positive number"):
        check_timeout(0)


def test_check_count_and_choice():
    assert checks.check_count(3, "n") == 3 and checks.check_count(0, "n", minimum=0) == 0
    for bad in (0, -2, 1.0, True, "1"):
        with pytest.raises(checks.CheckError, match="n must be an integer >= 1"):
            checks.check_count(bad, "n")
    with pytest.raises(checks.CheckError, match="<= 4"):
        checks.check_count(5, "n", maximum=4)
    assert checks.check_choice("pool", ("pool", "stage"), "spawn") == "pool"
    for bad in ("threads", None, ["pool"]):
        with pytest.raises(checks.CheckError, match=r"spawn must be one of \('pool', 'stage'\)"):
            checks.check_choice(bad, ("pool", "stage"), "spawn")
    assert checks.check_positive(2, "tol") == 2.0
    for bad in (0, -1e-3, math.inf, math.nan, True):
        with pytest.raises(checks.CheckError, match="tol must be a positive finite number"):
            checks.check_positive(bad, "tol")


def test_check_float_array():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)[:, ::-1]      # not contiguous, float64
    out = checks.check_float_array(a, "x", shape=(2, None))
    assert out.dtype == np.float32 and out.flags.c_contiguous and np.array_equal(out, a)
    with pytest.raises(checks.CheckError, match=r"x: shape \[2, 3\], expected 3x\*"):
        checks.check_float_array(a, "x", shape=(3, None))
    with pytest.raises(checks.CheckError, match="expected 1-d"):
        checks.check_float_array(a, "x", ndim=1)
    with pytest.raises(checks.CheckError, match="dtype int64, expected a floating-point"):
        checks.check_float_array(np.zeros(3, np.int64), "x")
    b = np.ones(4, np.float32)
    b[2] = np.nan
    with pytest.raises(checks.CheckError, match="1 of 4 values are NaN or inf"):
        checks.check_float_array(b, "x")

    class Mine(ValueError):
        pass
    with pytest.raises(Mine):
        checks.check_float_array(b, "x", error=Mine)


def test_load_npy(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3, np.float32))
    assert checks.load_npy(tmp_path / "a.npy", "--x").tolist() == [1, 1, 1]
    with pytest.raises(checks.InputFileMissing, match="--x .*: no such file"):
        checks.load_npy(tmp_path / "none.npy", "--x")
    with pytest.raises(checks.InputFileMissing, match="is a directory"):
        checks.load_npy(tmp_path, "--x")
    (tmp_path / "bad.npy").write_bytes(b"junk")
    with pytest.raises(checks.CheckError, match="cannot read a .npy array") as e:
        checks.load_npy(tmp_path / "bad.npy", "--x")
    assert not isinstance(e.value, checks.InputFileMissing)
    pickled = tmp_path / "obj.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(checks.CheckError):                        # never unpickles
        checks.load_npy(pickled, "--x")


@pytest.mark.parametrize("fn, good, bad", [
    (types.positive_int, [("1", 1), ("64", 64)], ["0", "-1", "1.5", "x", ""]),
    (types.positive_float, [("0.5", 0.5), ("3", 3.0)], ["0", "-1", "inf", "nan", "x"]),
    (types.seed, [("0", 0), ("7", 7)], ["-1", "x"]),
    (types.pixels, [("16", 16), ("1024", 1024)], ["0", "8", "100", "x"]),
    (types.unit_interval, [("0", 0.0), ("1", 1.0), ("0.25", 0.25)], ["-0.1", "1.5", "nan"]),
    (types.layers, [("all", "all"), ("3", 3)], ["0", "some"]),
    (types.int_list, [("1,2", [1, 2])], ["1,,2", "0", "a"]),
    (types.grid, [("1x4x8", (1, 4, 8))], ["1x4", "0x1x1", "banana"]),
    (types.workers, [("1", 1), ("2", 2)], ["0", "abc", "100000"]),
])
def test_argparse_types(fn, good, bad):
    for s, v in good:
        assert fn(s) == v
    for s in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(s)


# ----------------------------------------------------------------------------- exit codes in hard cases

_SWALLOW = textwrap.dedent(r"""
    import os, signal, sys
    import nxhpc.models.synthetic as gen                # the generator's GGUF writer
    real, mode = gen.write_gguf, sys.argv[1]

    def write_gguf(*a, **k):
        # what numpy's tofile does with a KeyboardInterrupt raised inside it: it catches it
        # and raises its own TypeError ("expected str, bytes or os.PathLike object, not
        # BufferedWriter"; measured: 1 in ~300 interrupts of a tofile loop)
        try:
            if mode != "no-signal":
                os.kill(os.getpid(), signal.SIGINT)
            real(*a, **k)
        except KeyboardInterrupt:
            pass
        raise TypeError("expected str, bytes or os.PathLike object, not BufferedWriter")
    gen.write_gguf = write_gguf
    if sys.argv[2] == "blockrun":
        from nxhpc.blockrun import main
        sys.exit(main(["tiny", "1"]))
    from nxhpc.models.cli import main
    sys.exit(main(["make", "tiny"]))
""")


@pytest.mark.parametrize("cli", ["blockrun", "models"])
def test_ctrl_c_replaced_by_c_code_during_generation_exits_130(tmp_path, cli):
    """A Ctrl-C during generation whose KeyboardInterrupt numpy's tofile swallowed (raising a
    TypeError instead) exits 130 like any Ctrl-C, leaving no temporary. Before: exit 70 (an
    'internal error' traceback; the models CLI: a traceback). Negative control: the same
    TypeError with no signal is still reported as the bug it is."""
    root = tmp_path / "models"
    r = subprocess.run([sys.executable, "-c", _SWALLOW, "signal", cli], capture_output=True,
                       text=True, env=models_env(root), cwd=ROOT, timeout=300)
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "interrupted" in r.stderr, r.stderr[-2000:]
    assert not [q for q in root.iterdir() if ".tmp-" in q.name]
    r = subprocess.run([sys.executable, "-c", _SWALLOW, "no-signal", cli], capture_output=True,
                       text=True, env=models_env(root), cwd=ROOT, timeout=300)
    assert r.returncode in (70, 1) and "TypeError" in r.stderr, (r.returncode, r.stderr[-2000:])


@linux_only
def test_stopped_worker_fails_a_block_run_with_exit_6(models_root, tiny):
    """The same through ``blockrun`` (no --stage-timeout): exit 6 naming the worker."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import nxhpc._kernels as K
        real = K.norm_residual                # the residual tails' kernel
        def stopping(*a, r0=0, **k):
            if r0 > 0:
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(*a, r0=r0, **k)
        K.norm_residual = stopping
        from nxhpc.blockrun import main
        sys.exit(main(["tiny", "2", "--models-dir", {str(models_root)!r}]))
    """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 6, (r.returncode, r.stderr[-2000:])
    assert "stage 'attn_tail': worker 1 of 2" in r.stderr and "SIGSTOP" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------ hardening round 3 (issue 19)
# Every CLI, through its main() in this process (the checks come before any run) or as a
# subprocess where a limit or a hang is the point. The model directories are private copies
# so that a failing check cannot damage the shared built-ins.

def _digest(d: Path) -> dict:
    import hashlib
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def h3_root(tmp_path_factory):
    """A models root holding the built-ins ``tiny`` (block model) and ``tiny-dit`` (denoiser),
    and a tiny-dit's caption features / latents as .npy inputs."""
    from nxhpc.formats.fixtures import FixtureStore
    from nxhpc.models.registry import ensure_builtin
    root = tmp_path_factory.mktemp("h3models")
    for mid in ("tiny", "tiny-dit"):
        ensure_builtin(mid, root)
    fx = FixtureStore(root / "tiny-dit" / "fixtures.safetensors")
    np.save(root / "cap.npy", fx.load("cap_feats"))
    np.save(root / "lat.npy", fx.load("latents"))
    return root


def _main(mod: str, argv: list, capsys) -> tuple[int, str, str]:
    code = importlib.import_module(mod).main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_outputs_never_overwrite_a_file_of_the_opened_model(h3_root, tmp_path, capsys):
    """Issue 19, item 2: ``sample tiny-dit --out <models>/tiny-dit/model.gguf`` replaced the
    GGUF with a .npy (exit 0); only a .gguf MODEL argument was protected, not an id or a
    directory; ``denoise <dir>/model.gguf --out <dir>/fixtures...`` replaced the fixtures. Every
    CLI refuses (exit 2, before any work) every file of the model it opened -- by id, directory
    or GGUF path; symbolic and hard links resolved -- and leaves the files as they were."""
    for mid in ("tiny", "tiny-dit"):
        import shutil
        shutil.copytree(h3_root / mid, tmp_path / mid)
    dit, blk = tmp_path / "tiny-dit", tmp_path / "tiny"
    before = {d: _digest(d) for d in (dit, blk)}
    (tmp_path / "link.npy").symlink_to(dit / "model.gguf")
    os.link(dit / "fixtures.safetensors", tmp_path / "hard.npy")
    cap, lat = h3_root / "cap.npy", h3_root / "lat.npy"
    px = ["--height", "32", "--width", "32", "--steps", "1", "--no-progress"]
    dn = ["--latents", lat, "--timestep", "0.5", "--cap-feats", cap]
    root = ["--models-dir", tmp_path]
    runs = {
        "sample id -> gguf": ("nxhpc.sample", ["tiny-dit", "1", "--cap-feats", cap, *px,
                                               "--out", dit / "model.gguf", *root]),
        "sample id -> fixtures": ("nxhpc.sample", ["tiny-dit", "1", "--cap-feats", cap, *px,
                                                   "--out", dit / "fixtures.safetensors",
                                                   *root]),
        "sample dir -> spec": ("nxhpc.sample", [dit, "1", "--cap-feats", cap, *px, "--out",
                                                dit / "synthetic.json"]),
        "sample gguf -> sibling": ("nxhpc.sample", [dit / "model.gguf", "1", "--cap-feats", cap,
                                                    *px, "--out", dit / "fixtures.safetensors"]),
        "sample id -> symlink": ("nxhpc.sample", ["tiny-dit", "1", "--cap-feats", cap, *px,
                                                  "--out", tmp_path / "link.npy", *root]),
        "denoise id -> gguf": ("nxhpc.denoise", ["tiny-dit", "1", "--out", dit / "model.gguf",
                                                 *root]),
        "denoise gguf -> sibling": ("nxhpc.denoise", [dit / "model.gguf", "1", *dn, "--out",
                                                      dit / "fixtures.safetensors"]),
        "denoise gguf -> hardlink": ("nxhpc.denoise", [dit / "model.gguf", "1", *dn, "--out",
                                                       tmp_path / "hard.npy"]),
        "denoise --gguf -> it": ("nxhpc.denoise", ["tiny-dit", "1", "--gguf", dit / "model.gguf",
                                                   "--out", tmp_path / "link.npy", *root]),
        "blockrun id -> gguf": ("nxhpc.blockrun", ["tiny", "1", "--save-output",
                                                   blk / "model.gguf", *root]),
        "blockrun dir -> fixtures": ("nxhpc.blockrun", [blk, "1", "--save-output",
                                                        blk / "fixtures.safetensors"]),
    }
    for name, (mod, argv) in runs.items():
        code, out, err = _main(mod, argv, capsys)
        assert code == 2, (name, code, err[-800:])
        assert "input of this run" in err, (name, err)
        assert "Traceback" not in err and "PASS" not in out, name
        assert {d: _digest(d) for d in (dit, blk)} == before, name
    # control: the same commands with a free output path run and write it
    code, _, err = _main("nxhpc.sample", ["tiny-dit", "1", "--cap-feats", cap, *px, "--out",
                                          tmp_path / "free.npy", *root], capsys)
    assert code == 0 and (tmp_path / "free.npy").is_file(), err
    code, _, err = _main("nxhpc.denoise", [dit / "model.gguf", "1", *dn, "--out",
                                           tmp_path / "free2.npy"], capsys)
    assert code == 0 and (tmp_path / "free2.npy").is_file(), err


def test_outputs_beside_a_model_named_by_its_path_every_cli(h3_root, tmp_path, capsys):
    """A model named by its path (directory or GGUF): a run's own earlier output beside it is
    written again by every CLI (sample, denoise, blockrun and encode refused the second run,
    "is an input of this run", protecting every file of the folder), while the model's own
    files there are refused (as above; here the GGUF and, for blockrun, the fixtures)."""
    import shutil

    from nxhpc.models.registry import ensure_builtin
    for mid in ("tiny", "tiny-dit"):
        shutil.copytree(h3_root / mid, tmp_path / mid)
    shutil.copytree(ensure_builtin("tiny-te", tmp_path / "b"), tmp_path / "te")
    dit, blk, te = tmp_path / "tiny-dit", tmp_path / "tiny", tmp_path / "te"
    cap, lat = h3_root / "cap.npy", h3_root / "lat.npy"
    px = ["--height", "32", "--width", "32", "--steps", "1", "--no-progress"]
    runs = {
        "sample dir": ("nxhpc.sample", [dit, "1", "--cap-feats", cap, *px, "--out"], dit),
        "sample gguf": ("nxhpc.sample", [dit / "model.gguf", "1", "--cap-feats", cap, *px,
                                         "--out"], dit),
        "denoise gguf": ("nxhpc.denoise", [dit / "model.gguf", "1", "--latents", lat,
                                           "--timestep", "0.5", "--cap-feats", cap, "--out"],
                         dit),
        "blockrun dir": ("nxhpc.blockrun", [blk, "1", "--save-output"], blk),
        "encode dir": ("nxhpc.encode", [te, "1", "--prompt", "a fox", "--out"], te),
        "encode gguf": ("nxhpc.encode", [te / "model.gguf", "1", "--prompt", "a fox", "--out"],
                        te),
    }
    for name, (mod, argv, d) in runs.items():
        before = _digest(d)
        for k in range(2):
            code, _, err = _main(mod, [*argv, d / "out.npy"], capsys)
            assert code == 0 and (d / "out.npy").is_file(), (name, k, err[-800:])
        (d / "out.npy").unlink()
        code, _, err = _main(mod, [*argv, d / "model.gguf"], capsys)     # control
        assert code == 2 and "input of this run" in err, (name, code, err[-800:])
        assert _digest(d) == before, name
    # a built-in named by its id: the same rule (its directory's other files are the user's,
    # and a regeneration passes them on); its manifest is refused
    d = h3_root / "tiny-dit"
    argv = ["tiny-dit", "1", "--cap-feats", cap, *px, "--models-dir", h3_root, "--out"]
    try:
        for k in range(2):
            code, _, err = _main("nxhpc.sample", [*argv, d / "out.npy"], capsys)
            assert code == 0, (k, err[-800:])
    finally:
        (d / "out.npy").unlink(missing_ok=True)
    code, _, err = _main("nxhpc.sample", [*argv, d / ".nxhpc-files.json"], capsys)
    assert code == 2 and "input of this run" in err, err


def test_non_finite_outputs_are_counted_and_fail_graded_or_not(h3_root, tmp_path, capsys):
    """Issue 19, item 3: finite latents that overflow inside the model (3e38) made ``denoise``
    write 2240 NaN of 2240 and print UNGRADED, exit 0. Every report counts the non-finite
    outputs (``non_finite=``); any of them fails the run -- exit 1, nothing written -- whether
    or not it is graded; an existing file at --out is unchanged."""
    lat = np.load(h3_root / "lat.npy")
    big = tmp_path / "big.npy"
    np.save(big, np.full_like(lat, 3e38))
    ref = tmp_path / "ref.npy"
    np.save(ref, np.ones_like(lat))
    out = tmp_path / "o.npy"
    out.write_bytes(b"previous")
    base = ["tiny-dit", "1", "--models-dir", h3_root, "--timestep", "0.5", "--cap-feats",
            h3_root / "cap.npy", "--out", out]
    for extra in ([], ["--reference", ref]):
        code, so, se = _main("nxhpc.denoise", [*base, "--latents", big, *extra], capsys)
        assert code == 1, (extra, code, se[-800:])
        assert f"non_finite={lat.size}" in so and so.splitlines()[-1].startswith("FAIL"), so
        assert "saved_output=" not in so and out.read_bytes() == b"previous"
        assert "Traceback" not in se
    code, so, se = _main("nxhpc.denoise", [*base, "--latents", big, "--json"], capsys)
    obj = json.loads(so)
    assert code == 1 and obj["non_finite"] == lat.size and obj["verdict"] == "FAIL"
    assert obj["saved_output"] is None and out.read_bytes() == b"previous"
    # control: the stored inputs run finite, report non_finite=0 and write --out
    code, so, se = _main("nxhpc.denoise", [*base, "--latents", h3_root / "lat.npy"], capsys)
    assert code == 0 and "non_finite=0" in so and np.load(out).shape == lat.shape, se
    # sample: the report counts them too (0 here); NaN from the denoiser exits 1
    s_out = tmp_path / "s.npy"
    px = ["--height", "32", "--width", "32", "--steps", "1", "--no-progress"]
    code, so, se = _main("nxhpc.sample", ["tiny-dit", "1", "--models-dir", h3_root,
                                          "--cap-feats", h3_root / "cap.npy", *px, "--out",
                                          s_out], capsys)
    assert code == 0 and "non_finite=0" in so, se
    noise = tmp_path / "noise.npy"
    np.save(noise, np.full((16, 4, 4), 3e38, np.float32))
    code, so, se = _main("nxhpc.sample", ["tiny-dit", "1", "--models-dir", h3_root,
                                          "--cap-feats", h3_root / "cap.npy", "--noise", noise,
                                          "--steps", "1", "--no-progress", "--out",
                                          tmp_path / "s2.npy"], capsys)
    assert code == 1 and "NaN/inf" in se and not (tmp_path / "s2.npy").exists(), se


def test_blockrun_non_finite_output_writes_nothing(h3_root, tmp_path, capsys, monkeypatch):
    """blockrun grades every run and fails NaN outputs; --save-output is not written then (the
    block itself stays finite even at 3e38 inputs, so the run's output is poisoned after it)."""
    import dataclasses
    import nxhpc.dit.stackrun as stackrun
    from nxhpc.dit.grade import grade
    real = stackrun.run_stack

    def poisoned(model, **kw):
        r = real(model, **kw)
        out = r.output.copy()
        out[0, :5] = np.nan
        ref = model.fixtures.load(r.grade.reference)
        return dataclasses.replace(r, output=out, grade=grade(out, ref, tol=r.grade.tol,
                                                              reference=r.grade.reference))
    monkeypatch.setattr(stackrun, "run_stack", poisoned)
    out = tmp_path / "b.npy"
    out.write_bytes(b"previous")
    code, so, se = _main("nxhpc.blockrun", ["tiny", "1", "--models-dir", h3_root,
                                            "--save-output", out], capsys)
    assert code == 1 and "non_finite=5" in so and so.splitlines()[-1].startswith("FAIL"), se
    assert out.read_bytes() == b"previous" and "saved_output=" not in so
    monkeypatch.setattr(stackrun, "run_stack", real)                  # control
    code, so, se = _main("nxhpc.blockrun", ["tiny", "1", "--models-dir", h3_root,
                                            "--save-output", out], capsys)
    assert code == 0 and "non_finite=0" in so and np.load(out).shape == (45, 384), se


def _bad_npy_files(d: Path) -> dict:
    """Files named .npy that np.load cannot turn into one array (issue 19, item 8)."""
    import struct
    np.savez(d / "arrays.npz", a=np.zeros(3, np.float32))
    data = (d / "arrays.npz").read_bytes()
    (d / "zip.npy").write_bytes(data)                          # a valid zip: not one array
    (d / "broken-zip.npy").write_bytes(data[:len(data) // 2])  # a zip cut in half
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (16, 1048576, 1048576), }"
    hdr = hdr + " " * (117 - len(hdr)) + "\n"
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode()
    (d / "huge.npy").write_bytes(raw + b"\0" * (242 - len(raw)))   # claims 64 TiB in 242 bytes
    return {"zip": (d / "zip.npy", "not a .npy"), "broken": (d / "broken-zip.npy", "not a .npy"),
            "huge": (d / "huge.npy", "64.0 TiB")}


def test_unreadable_inputs_exit_4_not_70(h3_root, tmp_path, capsys):
    """Issue 19, item 8: a broken zip (or any zip) as --latents / --cap-feats / --reference /
    --noise / a blockrun reference, and a 242-byte .npy whose header claims 64 TiB, ended in a
    traceback and exit 70. They are bad inputs: exit 4, one line naming the file."""
    bad = _bad_npy_files(tmp_path)
    lat, cap = h3_root / "lat.npy", h3_root / "cap.npy"
    root = ["--models-dir", h3_root]
    for kind, (f, needle) in bad.items():
        runs = {
            "--latents": ("nxhpc.denoise", ["tiny-dit", "1", *root, "--latents", f,
                                            "--timestep", "0.5", "--cap-feats", cap]),
            "--cap-feats": ("nxhpc.denoise", ["tiny-dit", "1", *root, "--latents", lat,
                                              "--timestep", "0.5", "--cap-feats", f]),
            "--reference": ("nxhpc.denoise", ["tiny-dit", "1", *root, "--reference", f]),
            "sample --cap-feats": ("nxhpc.sample", ["tiny-dit", "1", *root, "--cap-feats", f,
                                                    "--height", "32", "--width", "32", "--out",
                                                    tmp_path / "o.npy"]),
            "sample --noise": ("nxhpc.sample", ["tiny-dit", "1", *root, "--cap-feats", cap,
                                                "--noise", f, "--out", tmp_path / "o.npy"]),
            "blockrun reference": ("nxhpc.blockrun", ["tiny", "1", str(f), *root]),
        }
        for name, (mod, argv) in runs.items():
            code, _, err = _main(mod, argv, capsys)
            assert code == 4, (kind, name, code, err[-1500:])
            assert needle in err and str(f) in err and "Traceback" not in err, (kind, name, err)
    assert not (tmp_path / "o.npy").exists()


def test_sample_numbers_beyond_what_can_run_exit_2(h3_root, tmp_path, capsys):
    """Issue 19, item 8: ``sample --shift 1e-300`` / ``1e300`` (no strictly falling schedule),
    ``--steps 1e12`` and ``--height 1.6e16`` (memory for the schedule / the noise) exited 70."""
    base = ["tiny-dit", "1", "--models-dir", h3_root, "--cap-feats", h3_root / "cap.npy",
            "--out", tmp_path / "o.npy", "--no-progress"]
    px = ["--height", "32", "--width", "32"]
    for extra, needle in [(["--shift", "1e-300", *px], "--shift"),
                          (["--shift", "1e300", *px], "--shift"),
                          (["--steps", str(10 ** 12), *px], "--steps"),
                          (["--height", "16000000000000000", "--width", "32"], "--height")]:
        code, _, err = _main("nxhpc.sample", [*base, *extra], capsys)
        assert code == 2, (extra, code, err[-1500:])
        assert needle in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "o.npy").exists()
    code, _, err = _main("nxhpc.sample", [*base, "--shift", "50", "--steps", "2", *px], capsys)
    assert code == 0, err                                            # control: still a schedule


def test_too_many_open_files_is_a_clear_error(h3_root, tmp_path):
    """Issue 19, item 8: a run that hits the open-files limit (``ulimit -n``) ended in a
    traceback and exit 70; now exit 2 with one line naming the limit, no shared memory left."""
    import resource
    before = _nxhpc_segments()

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (12, 12))
    env = dict(os.environ, PYTHONPATH=str(ROOT), NXHPC_MODELS=str(h3_root))
    r = subprocess.run([sys.executable, "-m", "nxhpc.denoise", "tiny-dit", "2"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "too many open files" in r.stderr and "ulimit -n" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert _nxhpc_segments() == before


def _nxhpc_segments() -> list[str]:
    """nxhpc's own /dev/shm entries (other jobs on a shared machine -- Open MPI's, a parallel
    test run's -- come and go)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("nxhpc_"))


def test_wording_of_odd_input_paths_and_values(h3_root, tmp_path, capsys):
    """Issue 19, item 10: a FIFO as --latents hung (or was "no such file"), /dev/null and a
    FIFO as --gguf were "no such file"; a finite 1e300 float64 input was "NaN/inf"; ``models
    make --eps 1e-50`` wrote a model every run refuses. Each now says what it is."""
    fifo = tmp_path / "fifo.npy"
    os.mkfifo(fifo)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NXHPC_MODELS=str(h3_root))
    lat, cap = h3_root / "lat.npy", h3_root / "cap.npy"
    r = subprocess.run([sys.executable, "-m", "nxhpc.denoise", "tiny-dit", "1", "--latents",
                        str(fifo), "--timestep", "0.5", "--cap-feats", str(cap)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "FIFO" in r.stderr and "regular file" in r.stderr, r.stderr
    root = ["--models-dir", h3_root]
    for path, kind in (("/dev/null", "character device"), (str(fifo), "FIFO")):
        code, _, err = _main("nxhpc.denoise", ["tiny-dit", "1", *root, "--latents", path,
                                               "--timestep", "0.5", "--cap-feats", cap], capsys)
        assert code == 2 and kind in err and "no such file" not in err, err
        code, _, err = _main("nxhpc.denoise", ["tiny-dit", "1", *root, "--gguf", path], capsys)
        assert code == 2 and kind in err and "no such file" not in err, err
        code, _, err = _main("nxhpc.blockrun", ["tiny", "1", "layers.1.blk_in", path, *root],
                             capsys)
        assert code == 2 and kind in err and "no such file" not in err, err
    big = tmp_path / "big64.npy"
    c = np.load(cap).astype(np.float64)
    c[0, 0] = 1e300
    np.save(big, c)
    code, _, err = _main("nxhpc.sample", ["tiny-dit", "1", *root, "--cap-feats", big,
                                          "--height", "32", "--width", "32", "--out",
                                          tmp_path / "o.npy"], capsys)
    assert code == 4 and "beyond float32's range" in err and "NaN" not in err, err
    code, _, err = _main("nxhpc.denoise", ["tiny-dit", "1", *root, "--latents", lat,
                                           "--timestep", "0.5", "--cap-feats", big], capsys)
    assert code == 4 and "beyond float32's range" in err and "NaN" not in err, err
    mroot = tmp_path / "made"
    code, _, err = _main("nxhpc.models", ["--models-dir", mroot, "make", "epsm", "--dim", "64",
                                          "--heads", "2", "--ffn", "192", "--layers", "1",
                                          "--grid", "1x2x2", "--eps", "1e-50"], capsys)
    assert code == 2 and "--eps" in err and "float32" in err, err
    assert not (mroot / "epsm").exists()


def test_wording_of_wrong_kinds_and_odd_options(h3_root, tmp_path, capsys):
    """Review findings (2026-12-06): a bare .gguf given to blockrun was "None: missing fixture";
    a block model given to denoise was "refiner counts disagree: 0 ... 0"; a directory as a PNG
    --out suggested "out.npy"; ``models make --seed -1`` said "expected non-negative integer"
    naming no option; ``ddp --json ""`` was silently ignored; huge finite latents printed a
    numpy RuntimeWarning before decode's one-line error (now exit 1, the decoder's
    NonFiniteOutputError, as denoise's NaN output)."""
    root = ["--models-dir", h3_root]
    gguf = h3_root / "tiny" / "model.gguf"
    code, _, err = _main("nxhpc.blockrun", [gguf, "1", *root], capsys)
    assert code == Exit.MISSING and "no fixtures.safetensors" in err and "None" not in err, err
    lat, cap = h3_root / "lat.npy", h3_root / "cap.npy"
    code, _, err = _main("nxhpc.denoise", ["tiny", "1", *root, "--latents", lat, "--timestep",
                                           "0.5", "--cap-feats", cap], capsys)
    # refused by its id before anything is generated (load_denoiser("mid") wrote 27 MB first)
    assert code == Exit.NOT_FOUND and "'tiny' is a built-in block model, not a denoiser" in err \
        and "nxhpc.blockrun runs it" in err, err
    code, _, err = _main("nxhpc.denoise", [h3_root / "tiny", "1", "--latents", lat,
                                           "--timestep", "0.5", "--cap-feats", cap], capsys)
    assert code == Exit.BAD_INPUT and "not a whole denoiser" in err and "blockrun" in err, err
    code, _, err = _main("nxhpc.models", ["--models-dir", tmp_path, "make", "s", "--seed", "-1"],
                         capsys)
    assert code == Exit.USAGE and "--seed" in err and ">= 0" in err, err
    code, _, err = _main("nxhpc.ddp", ["--json", "", "--steps", "1"], capsys)
    assert code == Exit.USAGE and "--json: empty path" in err, err
    env = dict(os.environ, PYTHONPATH=str(ROOT), NXHPC_MODELS=str(h3_root))
    big = tmp_path / "big.npy"
    np.save(big, np.full((16, 2, 2), 3e38, np.float32))
    r = subprocess.run([sys.executable, "-m", "nxhpc.decode", "tiny-vae", "--latents", str(big),
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == Exit.USAGE and f"(e.g. {tmp_path / 'out.png'})" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "nxhpc.decode", "tiny-vae", "--latents", str(big),
                        "--out", str(tmp_path / "b.png")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    # an overflow inside the decoder from finite latents: exit 1, as denoise's NaN output
    assert r.returncode == Exit.FAIL and "values are NaN/inf (finite latents" in r.stderr, r.stderr
    assert "Warning" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "b.png").exists()


_PRINT_THEN_FAIL = """
import argparse, sys
from nxhpc.cli.codes import UsageError
from nxhpc.cli.frame import run_cli
def call(args):
    print("a line of the report")
    raise UsageError("something was wrong after all")
sys.exit(run_cli("demo", argparse.ArgumentParser(prog="demo"), [], call))
"""


@pytest.mark.parametrize("cli", ["denoise", "blockrun"])
def test_a_result_file_is_written_when_stdout_cannot_be(cli, h3_root, tmp_path):
    """``denoise --out`` / ``blockrun --save-output`` with stdout on /dev/full: exit 8 and the
    result file never written in key=value mode (the environment helper's find: the report's
    flush failed before the save), where ``--json`` mode, generate, encode and sample write
    theirs. The file is written now, then the stdout error stands (exit 8). Control: the
    file equals the one the same run writes with stdout captured."""
    from nxhpc.models.registry import ensure_builtin
    model = "tiny-dit" if cli == "denoise" else "tiny"
    ensure_builtin(model, h3_root)
    opt = "--out" if cli == "denoise" else "--save-output"
    env = dict(os.environ, PYTHONPATH=str(ROOT), NXHPC_MODELS=str(h3_root))
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [sys.executable, "-m", f"nxhpc.{cli}", model, "1", opt]
    with open("/dev/full", "w") as full:
        r = subprocess.run([*cmd, str(tmp_path / "a.npy")], stdout=full, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == Exit.OUTPUT and "standard output could not be written" in r.stderr, \
        r.stderr
    r2 = subprocess.run([*cmd, str(tmp_path / "b.npy")], capture_output=True, text=True,
                        cwd=ROOT, env=env, timeout=120)                       # control
    assert r2.returncode == 0, r2.stderr
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()


@pytest.mark.parametrize("target", ["closed pipe", "/dev/full"])
def test_buffered_output_lost_after_an_error_keeps_the_errors_code(h3_root, target):
    """A call that prints, then fails: its exit code (2 here) and one error line, not the
    interpreter's exit-time flush failure (exit 120, "Exception ignored ...") -- with Python's
    default buffered stdout, where the print has not reached the dead stdout yet; and
    ``--help`` into a closed pipe exits 0 quietly (it was 120)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NXHPC_MODELS=str(h3_root))
    env.pop("PYTHONUNBUFFERED", None)
    runs = [([sys.executable, "-c", _PRINT_THEN_FAIL], Exit.USAGE,
             "demo: error: something was wrong after all\n"),
            ([sys.executable, "-m", "nxhpc.blockrun", "--help"], Exit.PASS, "")]
    for cmd, code, err in runs:
        if target == "/dev/full":
            with open("/dev/full", "w") as full:
                r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                   env=env, timeout=120)
        else:
            rd, wr = os.pipe()
            os.close(rd)
            try:
                r = subprocess.run(cmd, stdout=wr, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                   env=env, timeout=120)
            finally:
                os.close(wr)
        assert r.returncode == code and r.stderr == err, (cmd[-1][:40], r.returncode, r.stderr)


def _dead_stream_run(cmd, target, which, env):
    """``cmd`` with its ``which`` stream ("stdout" / "stderr") into a dead ``target`` (a pipe
    whose reader is gone, or /dev/full), the other one captured."""
    other = "stderr" if which == "stdout" else "stdout"
    if target == "/dev/full":
        with open("/dev/full", "w") as full:
            return subprocess.run(cmd, **{which: full, other: subprocess.PIPE}, text=True,
                                  cwd=ROOT, env=env, timeout=120)
    rd, wr = os.pipe()
    os.close(rd)
    try:
        return subprocess.run(cmd, **{which: wr, other: subprocess.PIPE}, text=True, cwd=ROOT,
                              env=env, timeout=120)
    finally:
        os.close(wr)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("target", ["closed pipe", "/dev/full"])
def test_nxhpc_command_table_into_a_dead_stream(target, buffered):
    """The ``nxhpc`` command's own text (its table, printed outside run_cli): ``nxhpc --help``
    into a dead stdout exits 0 quietly, ``nxhpc`` alone and an unknown command into a dead
    stderr keep their usage code 2 -- not 120 ("Exception ignored ...", buffered) or 1 with a
    BrokenPipeError traceback (unbuffered), as before 2026-12-07."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    for argv, which, code in [(["--help"], "stdout", Exit.PASS), ([], "stderr", Exit.USAGE),
                              (["no-such-command"], "stderr", Exit.USAGE)]:
        r = _dead_stream_run([sys.executable, "-m", "nxhpc", *argv], target, which, env)
        captured = r.stderr if which == "stdout" else r.stdout
        assert r.returncode == code and captured == "", (argv, r.returncode, captured)
    # control: into a live stream the text arrives whole
    r = subprocess.run([sys.executable, "-m", "nxhpc"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=120)
    assert r.returncode == Exit.USAGE and r.stdout == "" and "commands:" in r.stderr
    assert r.stderr.rstrip().endswith("return)"), r.stderr[-200:]


def test_in_process_call_with_a_write_only_stream(h3_root, monkeypatch):
    """An embedding application's sys.stdout / sys.stderr that has write() but no flush(): the
    call still returns its code (the end-of-call flush must not raise or replace it)."""
    from nxhpc.models import cli as models_cli

    class WriteOnly:
        def __init__(self):
            self.parts = []

        def write(self, s):
            self.parts.append(s)
            return len(s)

    for name in ("stdout", "stderr"):
        stream = WriteOnly()
        monkeypatch.setattr(sys, name, stream)
        assert models_cli.main(["--models-dir", str(h3_root), "list"]) == Exit.PASS
        monkeypatch.undo()
        if name == "stdout":
            assert "".join(stream.parts).strip(), "the report went to the caller's stream"


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [["nxhpc.models", "list"], ["nxhpc.models", "show", "tiny"],
                                  ["nxhpc.blockrun", "tiny", "1"]])
def test_stdout_closed_by_its_reader_is_quiet(h3_root, argv, buffered):
    """``... | head -1``: the reader closes the pipe; the CLI stops with 8 (its report could
    not be written) and says nothing (it printed a BrokenPipeError traceback and 70). Both with
    Python's default block-buffered stdout, where the error came only from the interpreter's
    flush at exit ("Exception ignored ...", exit 120: 2026-12-06), and with PYTHONUNBUFFERED."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NXHPC_MODELS=str(h3_root))
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    rd, wr = os.pipe()
    os.close(rd)                        # the reader is gone before the first line is written
    try:
        r = subprocess.run([sys.executable, "-m", *argv], stdout=wr, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT, env=env, timeout=120)
    finally:
        os.close(wr)
    assert r.returncode == Exit.OUTPUT and r.stderr == "", (argv, r.returncode, r.stderr)
    # control: a stdout that works is not taken for a closed one (another pipe broke)
    from nxhpc.cli.frame import _stdout_closed
    assert _stdout_closed() is False


# ------------------------------------------------------------------------------ progress bar
def test_progress_bar_stages_steps_and_clearing(capsys, monkeypatch):
    """nxhpc.cli.progress.Progress (generate's and sample's bar): the stage in the description,
    the note after it, a normal close keeps the last frame on its own line, a failed close
    clears the line (carriage return, blanks, carriage return); disabled it writes nothing;
    without tqdm it prints the plain lines it is given."""
    from nxhpc.cli.progress import Progress
    p = Progress(3, True, "tool", "op", stage="open")
    p.stage("work")
    p.step("1.50 s/step")
    p.close()
    err = capsys.readouterr().err
    assert "tool: open" in err and "tool: work" in err and "1.50 s/step" in err
    assert "1/3" in err and err.endswith("\n"), repr(err)
    p = Progress(3, True, "tool", "op")
    p.step()
    p.close(failed=True)
    err = capsys.readouterr().err
    assert err.endswith("\r") and err[:-1].rsplit("\r", 1)[-1].strip() == "", repr(err)
    p = Progress(3, False, "tool", "op")
    p.stage("work")
    p.step("x", line="tool: step 1/3")
    p.close(failed=True)
    assert capsys.readouterr().err == ""
    monkeypatch.setitem(sys.modules, "tqdm", None)            # import tqdm -> ImportError
    p = Progress(2, True, "tool", "op")
    p.step("x", line="tool: step 1/2")
    p.close()
    assert capsys.readouterr().err == "tool: step 1/2\n"


_SIGBUS_SCRIPT = r"""
import argparse, os, sys
import numpy as np
from nxhpc.cli.frame import run_cli
path, mode = sys.argv[1], sys.argv[2]
with open(path, "wb") as f:
    f.write(b"\1" * (1 << 16))
m = np.memmap(path, dtype=np.uint8, mode="r")
os.truncate(path, 0)                         # another program rewrites the file in place

def call(args):
    if mode == "child":                      # a forked worker dies by the signal, as before
        pid = os.fork()
        if pid == 0:
            int(m[40000])
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child signal", os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
        return 0
    if mode == "self":
        print("read", int(m[40000]))           # never printed: SIGBUS
    return 0

code = run_cli("demo", argparse.ArgumentParser(prog="demo"), [], call)
if mode == "after":                          # the frame restored the action it replaced
    print("read", int(m[40000]))
sys.exit(code)
"""


@linux_only
@pytest.mark.parametrize("mode", ["self", "child", "after"])
def test_sigbus_in_the_cli_is_one_line_and_exit_4(tmp_path, mode):
    """A read of a mapped file past its end (the model file truncated or rewritten in place
    during a run) killed a CLI silently with SIGBUS (exit 135 in a shell). In the frame it is
    one line and exit 4; a forked worker still dies by SIGBUS (its pool reports it, with a
    hint); after the frame the action it replaced is back (the controls: the same read kills
    the process by SIGBUS there)."""
    import signal
    script = tmp_path / "bus.py"
    script.write_text(_SIGBUS_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "data.bin"), mode],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if mode == "self":
        assert r.returncode == Exit.BAD_INPUT, (r.returncode, r.stderr)
        assert r.stderr.strip() == ("demo: error: a memory-mapped file lost its pages while the "
                                    "run read it (SIGBUS): a model file was truncated or replaced "
                                    "in place during the run; nothing was written"), r.stderr
        assert "read" not in r.stdout
    elif mode == "child":
        assert r.returncode == 0 and f"child signal {int(signal.SIGBUS)}" in r.stdout, r
    else:
        assert r.returncode == -signal.SIGBUS, (r.returncode, r.stderr)


def test_a_worker_killed_by_sigbus_is_named_with_the_likely_cause():
    from nxhpc.runtime.proc import describe_exit
    import signal
    assert "crashed by SIGBUS (signal 7; a mapped file lost its pages: a model file truncated" \
        in describe_exit(exitcode=-signal.SIGBUS)
    assert describe_exit(exitcode=-signal.SIGSEGV) == "crashed by SIGSEGV (signal 11)"


def test_out_of_memory_is_exit_7_with_the_limit(tmp_path):
    """An allocation refused (a MemoryError from numpy, ENOMEM from a mapping) is the
    environment's limit, not a bug: exit 7 naming the address-space limit, one line, nothing
    written or left in /dev/shm; it was exit 70 "internal error" with a traceback (a batch job
    under ``ulimit -v``). Control: the same decode under a generous limit writes its PNG."""
    import errno
    import resource

    from nxhpc.cli.codes import OutOfMemory, code_for
    from nxhpc.cli.frame import _environment_error
    from nxhpc.models.registry import ensure_builtin
    for e in (MemoryError("Unable to allocate 4.00 GiB"),
              OSError(errno.ENOMEM, "Cannot allocate memory")):
        mapped = _environment_error(e)
        assert isinstance(mapped, OutOfMemory) and code_for(mapped) == Exit.SHM, mapped
        assert "out of memory" in str(mapped) and "ulimit -v" in str(mapped)
    assert _environment_error(OSError(errno.EIO, "I/O")).errno == errno.EIO     # control
    # a compiled module the loader could not map under the limit (PIL's, tokenizers'): it was
    # exit 70 with a traceback (the QA helper's find); a module that is absent stays itself
    from nxhpc.cli import frame
    enomem = ImportError("libXau.so.6: failed to map segment from shared object: Cannot "
                         "allocate memory")
    bare = ImportError("tokenizers.abi3.so: failed to map segment from shared object")
    noexec = ImportError("x.so: failed to map segment from shared object: Operation not "
                         "permitted")
    missing = ImportError("No module named 'PIL'")
    limits = {"RLIMIT_AS": "unlimited", "RLIMIT_DATA": "unlimited"}
    real_limit = frame.soft_limit
    frame.soft_limit = lambda name: limits.get(name) or real_limit(name)
    try:
        assert isinstance(_environment_error(enomem), OutOfMemory)
        for e in (bare, noexec, missing):            # no limit set: not the memory's doing
            assert _environment_error(e) is e, e
        limits["RLIMIT_AS"] = "166000 KiB"           # ulimit -v: the bare text is memory
        assert isinstance(_environment_error(bare), OutOfMemory)
        for e in (noexec, missing):                  # a noexec mount, an absent module: never
            assert _environment_error(e) is e, e
    finally:
        frame.soft_limit = real_limit
    # a fixture that cannot be loaded for want of memory is not a damaged model file (exit 4)
    import safetensors

    from nxhpc.formats import fixtures
    store = fixtures.FixtureStore(ensure_builtin("tiny", tmp_path) / "fixtures.safetensors")
    name = store.names()[0]
    real = safetensors.safe_open

    def no_memory(*a, **k):
        raise MemoryError("Cannot allocate memory (os error 12)")
    safetensors.safe_open = no_memory
    try:
        for call in (lambda: store.load(name), store.metadata):
            with pytest.raises(MemoryError):
                call()
        safetensors.safe_open = lambda *a, **k: 1 / 0             # control: a damaged file
        with pytest.raises(fixtures.ModelFileError, match="cannot load fixture"):
            store.load(name)
    finally:
        safetensors.safe_open = real
    ensure_builtin("tiny-vae", tmp_path)
    lat = tmp_path / "lat.npy"
    np.save(lat, np.random.default_rng(0).standard_normal((16, 128, 128)).astype(np.float32))
    before = set(_nxhpc_segments())
    # the limit above what the child maps once imported (one BLAS thread: each maps tens of
    # MB, so the import alone depends on the core count), so that the decode's arena and
    # arrays (~0.5 GB at 1024x1024) do not fit whatever the machine
    env = _env(NXHPC_MODELS=str(tmp_path), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", "import numpy, nxhpc.decode, nxhpc.vae.model\n"
                        "print(next(int(ln.split()[1]) for ln in open('/proc/self/status') "
                        "if ln.startswith('VmSize:')))"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    baseline = int(r.stdout) << 10                              # kB -> bytes
    for limit, code in ((baseline + (192 << 20), Exit.SHM), (None, Exit.PASS)):
        out = tmp_path / "o.png"
        def cap(limit=limit):
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        r = subprocess.run([sys.executable, "-m", "nxhpc.decode", "tiny-vae", "1", "--latents",
                            str(lat), "--out", str(out)], capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=300, preexec_fn=cap)
        assert r.returncode == code, (limit, r.returncode, r.stderr[-2000:])
        if code == Exit.SHM:
            assert "out of memory" in r.stderr, r.stderr
            assert f"ulimit -v) is {limit / 2 ** 30:.2f} GiB" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
            assert not out.exists()
        else:
            assert out.stat().st_size > 0
        assert set(_nxhpc_segments()) <= before


def test_report_values_with_a_line_break_stay_on_their_line(tmp_path):
    """An ``--out`` path holding a newline printed ``out=/dir/a`` and then a forged line of its
    own (``note=x/o.png``); such a value is printed quoted now. Control: other values (spaces,
    non-ASCII) print as they are."""
    from nxhpc.cli.report import kv_lines
    from nxhpc.models.registry import ensure_builtin
    assert kv_lines({"out": "/d/a\nnote=x.png", "n": 3}) == ["out='/d/a\\nnote=x.png'", "n=3"]
    assert kv_lines({"out": "/d/\u00fc b.png"}) == ["out=/d/\u00fc b.png"]
    ensure_builtin("tiny-vae", tmp_path)
    lat = tmp_path / "lat.npy"
    np.save(lat, np.random.default_rng(0).standard_normal((16, 4, 4)).astype(np.float32))
    d = tmp_path / "a\nnote=x"
    d.mkdir()
    r = subprocess.run([sys.executable, "-m", "nxhpc.decode", "tiny-vae", "1", "--latents",
                        str(lat), "--out", str(d / "o.png")], capture_output=True, text=True,
                       cwd=ROOT, env=_env(NXHPC_MODELS=str(tmp_path)), timeout=120)
    assert r.returncode == 0 and (d / "o.png").exists(), r.stderr
    keys = [ln.split("=", 1)[0] for ln in r.stdout.splitlines()]
    assert "note" not in keys and keys.count("out") == 1, r.stdout
    assert f"out={str(d / 'o.png')!r}" in r.stdout.splitlines(), r.stdout


def test_graded_reports_and_the_models_list_keep_a_line_break_on_its_line(tmp_path):
    """The graded commands' ``saved_output=`` line and verdict line, and ``models list``'s
    rows, printed a path's line break as it is (the CLI helper's find: ``saved_output=/d/a``
    then ``note=x/o.npy`` on a line of its own, the verdict split, a directory listed as two
    rows). They quote it now, as every other report value. Control: the same runs with a
    plain path print it as it is."""
    from nxhpc.models.registry import ensure_builtin
    ensure_builtin("tiny", tmp_path)
    d = tmp_path / "a\nnote=x"
    d.mkdir()
    ref = d / "r.npy"
    for out, reference in ((d / "o.npy", None), (tmp_path / "o.npy", None),
                           (tmp_path / "p.npy", ref)):
        if reference is not None:
            np.save(reference, np.load(tmp_path / "o.npy"))
        args = ["tiny", "1", *([str(reference)] if reference is not None else []),
                "--save-output", str(out)]
        r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", *args], capture_output=True,
                           text=True, cwd=ROOT, env=_env(NXHPC_MODELS=str(tmp_path)),
                           timeout=120)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all("=" in ln for ln in lines[:-1]) and lines[-1].startswith("PASS: "), lines
        assert "note" not in [ln.split("=", 1)[0] for ln in lines], lines
        shown = repr(str(out)) if "\n" in str(out) else str(out)
        assert f"saved_output={shown}" in lines, lines
        if reference is not None:
            assert lines[-1].endswith(f"vs {str(reference)!r} ({lines[-1].split('(')[-1]}"), \
                lines[-1]
    r = subprocess.run([sys.executable, "-m", "nxhpc.models", "--models-dir", str(tmp_path),
                        "list"], capture_output=True, text=True, cwd=ROOT, env=_env(),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"{repr(d.name):<11} (directory)" in r.stdout.splitlines(), r.stdout
    assert not any(ln.startswith("note=x") for ln in r.stdout.splitlines()), r.stdout


@pytest.mark.parametrize("encoding", ["ascii", "utf-8"])
def test_a_path_the_reports_stream_cannot_encode_is_escaped(tmp_path, encoding):
    """A report naming an ``--out`` its stdout's encoding cannot hold (a non-ASCII name under
    ``PYTHONIOENCODING=ascii``; a non-UTF-8 byte of a file name, which Python holds as a lone
    surrogate, under ``utf-8``, as Docker images set it) was a UnicodeEncodeError: exit 70
    with a traceback after the PNG was written (the environment helper's find, 12 commands).
    The value is printed with backslash escapes now, exit 0."""
    from nxhpc.models.registry import ensure_builtin
    ensure_builtin("tiny-vae", tmp_path)
    lat = tmp_path / "lat.npy"
    np.save(lat, np.random.default_rng(0).standard_normal((16, 4, 4)).astype(np.float32))
    name = "\u00f6.png" if encoding == "ascii" else os.fsdecode(b"\xff.png")
    out = os.path.join(os.fsencode(tmp_path), os.fsencode(name))
    r = subprocess.run([sys.executable, "-m", "nxhpc.decode", "tiny-vae", "1", "--latents",
                        str(lat), "--out", os.fsdecode(out)], capture_output=True, cwd=ROOT,
                       env=_env(NXHPC_MODELS=str(tmp_path), PYTHONIOENCODING=encoding),
                       timeout=120)
    assert r.returncode == 0 and os.path.exists(out), r.stderr.decode(errors="replace")
    want = b"\\xf6.png" if encoding == "ascii" else b"\\udcff.png"
    assert any(ln.startswith(b"out=") and ln.endswith(want) for ln in r.stdout.splitlines()), \
        r.stdout


def test_an_option_value_of_double_dash_is_kept(h3_root, tmp_path, capsys):
    """``--prompt=--`` is the prompt "--": Python 3.11's argparse dropped the ``--`` and gave
    ``[]`` (encode: exit 70 with a traceback; generate --negative-prompt=--: the empty negative
    prompt, silently). Every CLI parses with ``args.Parser``, which keeps it (through the
    option's type and choices: ``--precision=--`` is an invalid choice, exit 2). The ids are
    the library's for "--"; control: another prompt gives other ids."""
    from nxhpc.cli.args import Parser
    from nxhpc.models.registry import open_text_encoder
    for mod in CLI_MODULES:
        assert isinstance(importlib.import_module(mod).build_parser(), Parser), mod
    root = ["--models-dir", h3_root]
    code, out, err = _main("nxhpc.encode", ["tiny-te", "--prompt=--", "--out", tmp_path / "f.npy",
                                            "--json", *root], capsys)
    assert code == 0, err
    with open_text_encoder("tiny-te", models_dir=h3_root, workers=1) as te:
        want = te.tokenize("--")
        assert te.tokenize("-") != want
    assert json.loads(out)["ids"] == list(want)
    code, _, err = _main("nxhpc.generate", ["--prompt", "x", "--guidance-scale", "2",
                                            "--negative-prompt=--", "--out", tmp_path / "g.png",
                                            "--no-progress", "--workers", "1", *root], capsys)
    assert code == 0, err
    from PIL import Image
    with Image.open(tmp_path / "g.png") as im:
        assert im.text["negative_prompt"] == "--"
    code, _, err = _main("nxhpc.blockrun", ["tiny", "--precision=--", *root], capsys)
    assert code == Exit.USAGE and "invalid choice: '--'" in err, err


# ------------------------------------------------------------------ signals around the output
_SIGNAL_AT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from nxhpc.runtime import outfile
    sig, when = getattr(signal, sys.argv[1]), sys.argv[2]
    # a terminal's dispositions, whatever this test runs under (nohup ignores SIGHUP, and a
    # background job of a script SIGINT: the run keeps an ignored signal ignored)
    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    real_fsync, real_write = outfile.os.fsync, outfile.write_atomic
    class Os:                                   # outfile's os, with a signal at the fsync
        def __getattr__(self, name):
            return getattr(os, name)
        @staticmethod
        def fsync(fd):
            real_fsync(fd)
            if when == "mid-write":
                signal.raise_signal(sig)
    outfile.os = Os()
    def write_then_signal(*a, **k):
        real_write(*a, **k)
        if when == "after-write":
            signal.raise_signal(sig)
    import nxhpc.vae.image as image
    image.write_atomic = write_then_signal
    from nxhpc import decode
    sys.exit(decode.main(sys.argv[3:]))
""")


@linux_only
@pytest.mark.parametrize("sig, code, words", [("SIGHUP", 129, "hung up (SIGHUP"),
                                              ("SIGINT", 130, "interrupted (SIGINT)"),
                                              ("SIGTERM", 143, "terminated (SIGTERM)")])
def test_a_signal_mid_write_keeps_the_old_file_and_after_it_names_the_new(models_root, tmp_path,
                                                                          sig, code, words):
    """SIGHUP (a closed terminal or ssh session) killed a run with its default action: no
    message, a half-written ``.NAME.tmp-PID-*`` left beside the output for good (the QA
    helper's find); it is handled as SIGTERM is now (exit 129). And a signal that came after
    the output was replaced said only "interrupted": the file is new and whole, and the message
    now says so. Controls: SIGINT and SIGTERM alike; the old file stays on a mid-write signal."""
    lat = tmp_path / "z.npy"
    np.save(lat, np.random.default_rng(1).standard_normal((16, 4, 4)).astype(np.float32))
    out = tmp_path / "img.png"
    argv = ["tiny-vae", "1", "--latents", str(lat), "--out", str(out)]
    for when in ("mid-write", "after-write"):
        out.write_bytes(b"OLD")
        r = subprocess.run([sys.executable, "-c", _SIGNAL_AT, sig, when, *argv],
                           capture_output=True, text=True, env=models_env(models_root),
                           timeout=300, cwd=ROOT)
        assert r.returncode == code, (when, r.returncode, r.stderr[-2000:])
        assert f"decode: error: {words}" in r.stderr, r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["img.png", "z.npy"]  # no .tmp-
        if when == "mid-write":
            assert out.read_bytes() == b"OLD" and "written before it" not in r.stderr
        else:
            assert out.read_bytes()[:4] == b"\x89PNG", r.stderr
            assert f"written before it (complete): {out}" in r.stderr, r.stderr
