"""Issue 20's speed goals on the machine at hand, in one command.

Runs the benchmarks that benchmarks/README.md ("Checking the speed goals on the machine at
hand") names, each in its own pytest process with ``--benchmark-json``, then reads the JSON and
prints one table: each goal, what was measured, the target, and whether it is met. The goals
are stated for a 2-core AMD Zen 4; on another CPU the table says how this one fares.

    python benchmarks/goals.py                 # all three goals (15-20 min on 2 cores, est.)
    python benchmarks/goals.py --only block256 --out DIR   # one goal at a time, cheapest first:
    python benchmarks/goals.py --only block2048 --out DIR  # a killed or timed-out run loses
    python benchmarks/goals.py --only step1024 --out DIR   # only its own goal's JSON
    python benchmarks/goals.py --from DIR      # judge every JSON an earlier run left in DIR

(The estimate is read off issue 20's per-layer figures, not measured: step1024 alone times
three diffusers float32 and three bfloat16 calls at 4096 tokens; a model not made yet adds its
making, ~2 min for ``zimage-dit-2l-q4km``.) nxhpc is imported from this checkout (no install
needed).

Goals (the "fastest passing precision" is the fastest nxhpc precision whose error is no worse
than torch bfloat16's in the same run -- for a block ``max_rel`` as blockrun measures it, and
within blockrun's tolerance, ``nxhpc.blockrun.PRECISION_TOL``; for the 1024x1024 step the
error against diffusers float32 --; times are the minimum over the rounds, for the step that
of the faster timed call):
- ``block256``: a Q4_K_M block (``zimage-1l-q4km``, T=256) >= 1.5x torch bfloat16;
- ``block2048``: a Q8_0 block (``zimage-1l``, T=2048) >= 2x torch bfloat16;
- ``step1024``: one main layer of a 1024x1024 call (``zimage-dit-2l-q4km``, 4096 image tokens)
  within 1.3x of the machine's limit (``x_machine_limit`` of ``bench_denoise.py``: the limit at
  the fastest units the kernels can run, measured by their peak loops; under ``NXHPC_MAX_ISA``
  the capped CPU's units, ``nxhpc.runtime.peak.reachable``); the table also gives ``x_limit``,
  the limit on the units the precision ran on;
- and each with an error no worse than torch bfloat16's in the same run.
The JSON files and the tables the benchmarks print stay in the output folder (``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:          # this checkout's nxhpc, installed or not
    sys.path.insert(0, str(ROOT))

#: (name, environment, pytest -k expression, benchmark file)
RUNS = {
    "block256": ({"NXHPC_BENCH_MODEL": "zimage-1l-q4km", "NXHPC_BENCH_ROUNDS": "8"},
                 "test_block_ and (pool-bf16 or pool-q8 or bfloat16)", "bench_block.py"),
    "block2048": ({"NXHPC_BENCH_MODEL": "zimage-1l", "NXHPC_BENCH_T": "2048",
                   "NXHPC_BENCH_ROUNDS": "3"},
                  "test_block_ and (pool-bf16 or pool-q8 or bfloat16)", "bench_block.py"),
    "step1024": ({"NXHPC_BENCH_DENOISER": "zimage-dit-2l-q4km", "NXHPC_BENCH_TOKENS": "4096",
                  "NXHPC_BENCH_PRECISIONS": "q8,bf16"}, "", "bench_denoise.py"),
}
#: the target of each goal: a ratio over torch bfloat16 (>=) or a multiple of the limit (<=)
TARGETS = {"block256": (">=", 1.5), "block2048": (">=", 2.0), "step1024": ("<=", 1.3)}
#: the model the README's command makes for block256 (not built in)
Q4KM_MAKE = ["make", "zimage-1l-q4km", "--variant", "zimage", "--dim", "3840", "--heads", "30",
             "--ffn", "10240", "--layers", "1", "--caption", "32", "--grid", "1x14x16",
             "--seed", "4", "--types", "q4_k_m"]


@dataclass
class Goal:
    """One goal's verdict: ``measured`` (the ratio or multiple), ``met`` (None: not measured),
    ``errors_ok`` (None: no error reference), and a line saying what was compared."""
    name: str
    measured: float | None
    met: bool | None
    errors_ok: bool | None
    detail: str


def _entries(doc: dict) -> dict[str, dict]:
    """pytest-benchmark JSON -> {test name with its parameters: benchmark entry}."""
    return {b["name"]: b for b in doc.get("benchmarks", [])}


def _rms(x: float | None) -> str:
    """``, rel_rms X`` where the run recorded its RMS error (runs before it was recorded: "")."""
    return "" if x is None else f", rel_rms {x:.2e}"


def block_goal(name: str, doc: dict, tol: dict[str, float]) -> Goal:
    """The block goals: the fastest nxhpc precision that *passes* -- its ``max_rel`` within
    ``tol`` and, where torch bfloat16's ``max_rel`` was measured in the same run, no worse than
    it (the step goal's rule, on the blocks' own measure) -- against torch bfloat16's minimum
    time. Without torch's error every precision within ``tol`` is taken and the errors are "-"."""
    op, target = TARGETS[name]
    e = _entries(doc)
    torch = e.get("test_block_torch_eager[bfloat16]")
    t_err = None if torch is None else torch["extra_info"].get("max_rel")
    runs, failed, rms = [], [], {"torch": None if torch is None else
                                 torch["extra_info"].get("rel_rms_err")}
    for key, b in e.items():
        if key.startswith("test_block_nxhpc[pool-"):
            p = b["extra_info"].get("precision")
            mr = b["extra_info"].get("max_rel")
            rms[p] = b["extra_info"].get("rel_rms_err")
            rr = _rms(rms[p])
            if p in tol and mr is not None and mr > tol[p]:
                failed.append(f"{p} ({mr:.2e}{rr}, beyond blockrun's {tol[p]:g})")
            elif p in tol and mr is not None:
                if t_err is not None and mr > t_err:
                    failed.append(f"{p} {b['stats']['min'] * 1e3:.1f} ms (max_rel {mr:.2e}{rr})")
                else:
                    runs.append((b["stats"]["min"], p, mr))
    if torch is None or not runs:
        if torch is not None and failed:
            return Goal(name, None, False, False if t_err is not None else None,
                        f"no passing precision (torch bfloat16's max_rel "
                        f"{'-' if t_err is None else format(t_err, '.2e')}): " + ", ".join(failed))
        return Goal(name, None, None, None, "not measured (no torch bfloat16 run or no nxhpc "
                                            "precision within its tolerance)")
    t_min, prec, mr = min(runs)
    ratio = torch["stats"]["min"] / t_min
    errors_ok = None if t_err is None else mr <= t_err
    detail = (f"nxhpc {prec} {t_min * 1e3:.1f} ms (max_rel {mr:.2e}{_rms(rms[prec])}) vs torch "
              f"bfloat16 {torch['stats']['min'] * 1e3:.1f} ms (max_rel "
              f"{'-' if t_err is None else format(t_err, '.2e')}{_rms(rms['torch'])})")
    if failed:
        detail += "; left out for their error: " + ", ".join(failed)
    return Goal(name, ratio, ratio >= target if op == ">=" else ratio <= target, errors_ok,
                detail)


def step_goal(doc: dict, summary: dict | None) -> Goal:
    """The 1024x1024 goal: the smallest ``x_machine_limit`` (a main layer's time over its limit
    at the machine's fastest units) among nxhpc's *passing* precisions -- those whose error
    against diffusers float32 (``summary``: the benchmark's own results file, which holds
    nxhpc's errors) is no worse than torch bfloat16's in the same run. Without that reference
    (no diffusers float32 or bfloat16 run, no results file) every precision is taken and the
    errors are "-"."""
    op, target = TARGETS["step1024"]
    e = _entries(doc)
    torch = next((b for k, b in e.items() if k.startswith("test_denoise_torch_bfloat16[")), None)
    t_err = None if torch is None else torch["extra_info"].get("rel_err_vs_diffusers_f32")
    errs = {}
    for k, v in (summary or {}).items():
        if k.startswith("nxhpc ") and "@" in k:
            errs[k[len("nxhpc "):k.index("@")]] = v.get("rel_err_vs_diffusers_f32")
    check = t_err is not None and summary is not None
    runs, failed = [], []
    for key, b in e.items():
        if key.startswith("test_denoise_nxhpc["):
            ei = b["extra_info"]
            x = ei.get("x_machine_limit")
            if x is None:
                continue
            run = (x, ei["precision"], ei["s_per_layer"], ei.get("x_limit"))
            mine = errs.get(ei["precision"])
            if check and (mine is None or mine > t_err):
                failed.append(f"{ei['precision']} ({'-' if mine is None else format(mine, '.2e')})")
            else:
                runs.append(run)
    if not runs:
        why = "not measured" if not failed else (
            f"no precision within torch bfloat16's error {t_err:.2e} vs diffusers f32: "
            + ", ".join(failed))
        return Goal("step1024", None, False if failed else None, False if failed else None, why)
    x, prec, s, own = min(runs)
    detail = f"nxhpc {prec} {s:.3f} s a layer"
    if own is not None:
        detail += f" ({own:.2f}x its limit on the units it ran on)"
    errors_ok = None
    if torch is not None:
        ti = torch["extra_info"]
        detail += (f", torch bfloat16 {ti['s_per_layer']:.3f} s a layer "
                   f"({ti['s_per_layer'] / s:.2f}x nxhpc's time)")
        mine = errs.get(prec)
        if mine is not None and t_err is not None:
            errors_ok = mine <= t_err
            detail += f"; rel. err vs diffusers f32 {mine:.2e} vs torch bfloat16 {t_err:.2e}"
    if failed:
        detail += "; left out for their error: " + ", ".join(failed)
    return Goal("step1024", x, x <= target if op == "<=" else x >= target, errors_ok, detail)


def _shown(x: float, op: str, met: bool | None) -> str:
    """``x`` to 2 decimals; for a goal not met, rounded away from its target (down for ``>=``,
    up for ``<=``), so that a miss never shows the target (1.49999 is "1.49", not "1.50")."""
    if met is False:
        c = math.floor(x * 100) if op == ">=" else math.ceil(x * 100)
        return f"{c / 100:.2f}"
    return f"{x:.2f}"


def table(goals: list[Goal]) -> str:
    """The goals as a Markdown table."""
    yes = {True: "yes", False: "**no**", None: "-"}
    lines = ["| goal | measured | target | met | error <= torch bf16's | what |",
             "|---|---|---|---|---|---|"]
    for g in goals:
        op, target = TARGETS[g.name]
        m = "-" if g.measured is None else f"{_shown(g.measured, op, g.met)}x"
        lines.append(f"| {g.name} | {m} | {op} {target}x | {yes[g.met]} | {yes[g.errors_ok]} "
                     f"| {g.detail} |")
    return "\n".join(lines)


def _run(name: str, out: Path) -> int:
    env_add, k, bench = RUNS[name]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=path, **env_add)
    cmd = [sys.executable, "-m", "pytest", str(HERE / bench), "--benchmark-only", "-q", "-s",
           "--benchmark-timer=time.perf_counter", f"--benchmark-json={out / (name + '.json')}"]
    if k:
        cmd += ["-k", k]
    line = " ".join([*(f"{a}={b}" for a, b in env_add.items()), "python", shlex.join(cmd[1:])])
    print(f"== {name}: {line}", flush=True)
    # cwd=out: bench_denoise writes its summary (.benchmarks/bench_denoise.json) there; an
    # earlier run's is removed first, so its errors are never read beside this run's times
    (out / ".benchmarks" / "bench_denoise.json").unlink(missing_ok=True)
    return subprocess.run(cmd, env=env, cwd=out).returncode


def _ensure_q4km() -> None:
    from nxhpc.models.registry import models_dir
    if not (models_dir() / "zimage-1l-q4km" / "model.gguf").exists():
        print("== making zimage-1l-q4km (benchmarks/README.md's command)", flush=True)
        subprocess.run([sys.executable, "-m", "nxhpc.models", *Q4KM_MAKE], check=True)


#: the CPU flags a figure of this issue depends on
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def machine_line() -> str:
    """The CPU's model name and which of ``FLAGS`` it has (from /proc/cpuinfo; Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "an unknown CPU"
    field = {}
    for line in info.splitlines():
        k, _, v = line.partition(":")
        field.setdefault(k.strip(), v.strip())
    have = set(field.get("flags", "").split())
    cap = os.environ.get("NXHPC_MAX_ISA")
    return (f"{field.get('model name', 'an unknown CPU')} "
            f"[{' '.join(f for f in FLAGS if f in have)}]"
            + (f", kernels capped at NXHPC_MAX_ISA={cap}" if cap else ""))


def _read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None if the file is absent, empty or not JSON (pytest-benchmark
    empties its output file at start, so a run that failed early or was killed leaves one)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def evaluate(out: Path, names: list[str]) -> list[Goal]:
    """Read the JSON of the runs ``names`` in ``out`` and judge each goal (a run that left no
    readable JSON is "not measured")."""
    from nxhpc.blockrun import PRECISION_TOL
    goals = []
    for name in names:
        doc = _read_json(out / f"{name}.json") or {}
        if name == "step1024":
            goals.append(step_goal(doc, _read_json(out / ".benchmarks" / "bench_denoise.json")))
        else:
            goals.append(block_goal(name, doc, dict(PRECISION_TOL)))
    return goals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=list(RUNS),
                    help="run only this goal's benchmark (repeatable; default: all)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the JSON files (default: a new temporary folder)")
    ap.add_argument("--from", dest="src", type=Path, default=None,
                    help="do not run: judge the JSON files an earlier run left in this folder")
    args = ap.parse_args(argv)
    names = args.only or list(RUNS)
    if args.src is not None:
        out = args.src
        if not out.is_dir():
            ap.error(f"--from {out}: no such folder (give the --out folder of an earlier run)")
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="nxhpc-goals-"))
        out.mkdir(parents=True, exist_ok=True)
        if "block256" in names:
            _ensure_q4km()
        for name in names:
            rc = _run(name, out)
            if rc != 0:
                print(f"== {name}: pytest exited {rc} (a precision out of its tolerance fails its "
                      f"test; the table judges what ran)", flush=True)
    print(f"\nIssue 20's goals on {machine_line()} (JSON in {out}):\n")
    print(table(evaluate(out, names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
