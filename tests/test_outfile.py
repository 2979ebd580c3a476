"""nxhpc.runtime.outfile: result files checked up front and written atomically (issue 12, item 5).

The invariants are checked on the file system directly: the old content (bytes), the directory
listing (no temporary left), the inode of a device that must be written in place, not replaced.
"""
import os

import pytest

from nxhpc.runtime.outfile import OutputPathError, check_output_path, write_atomic


def test_failed_write_leaves_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "r.npy"
    target.write_bytes(b"old")
    for exc in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        def fail(f, exc=exc):
            f.write(b"partial new content")
            raise exc
        with pytest.raises(type(exc)):
            write_atomic(target, fail)
        assert target.read_bytes() == b"old"
        assert sorted(os.listdir(tmp_path)) == ["r.npy"]
    write_atomic(target, lambda f: f.write(b"new"))      # control: success replaces
    assert target.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["r.npy"]


def test_symlink_target_is_followed_not_replaced(tmp_path):
    real = tmp_path / "real.npy"
    real.write_bytes(b"old")
    link = tmp_path / "link.npy"
    link.symlink_to(real)
    write_atomic(link, lambda f: f.write(b"new"))
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_device_is_written_in_place():
    """``--save-output /dev/null`` must not replace the device node with a regular file."""
    before = os.stat("/dev/null")
    assert str(check_output_path("/dev/null", what="out")) == "/dev/null"
    write_atomic("/dev/null", lambda f: f.write(b"discarded"))
    after = os.stat("/dev/null")
    assert (after.st_ino, after.st_rdev, after.st_mode) == (before.st_ino, before.st_rdev,
                                                            before.st_mode)


def test_check_output_path_reasons(tmp_path):
    with pytest.raises(OutputPathError, match="is a directory"):
        check_output_path(tmp_path, what="--x")
    with pytest.raises(OutputPathError, match="does not exist"):
        check_output_path(tmp_path / "nope" / "a.npy", what="--x")
    src = tmp_path / "model.gguf"
    src.write_bytes(b"weights")
    hard = tmp_path / "hard.npy"
    os.link(src, hard)
    soft = tmp_path / "soft.npy"
    soft.symlink_to(src)
    for p in (src, hard, soft):
        with pytest.raises(OutputPathError, match="input of this run"):
            check_output_path(p, what="--x", inputs=[src])
    assert check_output_path(tmp_path / "new.npy", what="--x", inputs=[src]) == \
        tmp_path / "new.npy"                               # control: a fresh path is fine
    assert sorted(os.listdir(tmp_path)) == ["hard.npy", "model.gguf", "soft.npy"]   # no probe


def test_check_output_path_unwritable_directory(tmp_path):
    """A directory the process cannot write: mode 555, or for root (who ignores modes, as CI
    runs) a read-only tmpfs mounted over it in a private mount namespace."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        import sys
        from pathlib import Path

        from nsutil import run_with_tmpfs
        code = ("import sys\n"
                "from nxhpc.runtime.outfile import OutputPathError, check_output_path\n"
                "try:\n"
                "    check_output_path(sys.argv[1], what='--x')\n"
                "except OutputPathError as e:\n"
                "    print('refused:', e)\n")
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        args = [sys.executable, "-c", code, str(d / "a.npy")]
        r = run_with_tmpfs(args, str(d), "size=64k,ro", env=env, timeout=120)
        assert r.returncode == 0 and "refused: " in r.stdout, (r.stdout, r.stderr)
        assert "cannot create a file" in r.stdout
        # control: the same check on a writable tmpfs passes
        r = run_with_tmpfs(args, str(d), "size=64k", env=env, timeout=120)
        assert r.returncode == 0 and r.stdout == "", (r.stdout, r.stderr)
        return
    d.chmod(0o555)
    try:
        with pytest.raises(OutputPathError, match="cannot create a file"):
            check_output_path(d / "a.npy", what="--x")
    finally:
        d.chmod(0o755)


def test_dev_stderr_is_written_through_and_stdout_refused(tmp_path):
    """``--json /dev/stderr`` (a link to fd 2: here a pipe) writes into the pipe. A CLI's
    own stdout -- ``/dev/stdout`` or the file it is redirected to -- is refused: the report is
    printed there (``--out /dev/stdout > img.png`` gave a PNG whose start the report
    overwrote, with exit 0: 2026-12-07). The library's check (``write_png``'s) takes it: no
    report. Control: another file is taken."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from nxhpc.runtime.outfile import (OutputPathError, check_cli_output_path,\n"
            "                                   check_output_path, write_atomic)\n"
            "check_output_path('/dev/stderr', what='--json')\n"
            "write_atomic('/dev/stderr', lambda f: f.write(b'{\"ok\": 1}'))\n"
            "for p in sys.argv[1:]:\n"
            "    check_output_path(p, what='PNG output')  # the library's: no report to mix\n"
            "    try:\n"
            "        check_cli_output_path(p, what='--json')\n"
            "        print('taken', p)\n"
            "    except OutputPathError as e:\n"
            "        print('refused', e)\n")
    r = subprocess.run([sys.executable, "-c", code, "/dev/stdout", "/proc/self/fd/1"],
                       capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stderr == b'{"ok": 1}', r.stderr
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 2 and all(ln.startswith("refused") and "standard output" in ln
                                   for ln in lines), lines
    out = tmp_path / "report.txt"
    with open(out, "w") as f:        # stdout redirected to a file: that file is refused too
        r = subprocess.run([sys.executable, "-c", code, str(out), str(tmp_path / "x.json")],
                           stdout=f, stderr=subprocess.PIPE, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("refused") and lines[1] == f"taken {tmp_path / 'x.json'}", lines
    # the null device as both: nothing mixes (--out /dev/null > /dev/null stays allowed)
    null_code = ("import sys\nfrom nxhpc.runtime.outfile import check_cli_output_path\n"
                 "for p in ('/dev/null', '/dev/stdout'):\n"
                 "    check_cli_output_path(p, what='--out')\n"
                 "sys.stderr.write('ok')\n")
    r = subprocess.run([sys.executable, "-c", null_code], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=60)
    assert r.returncode == 0 and r.stderr == b"ok", r.stderr


def test_a_trailing_slash_names_a_directory(tmp_path):
    """``--out feats/`` where no such directory exists wrote a file named ``feats``, and
    ``--out e.png/`` overwrote the file e.png (Path() drops the slash): both refused now, as
    ``cp`` refuses them. Control: the same names without the slash are taken."""
    (tmp_path / "e.png").write_bytes(b"old")
    for given in (f"{tmp_path}/feats/", f"{tmp_path}/e.png/"):
        with pytest.raises(OutputPathError, match="ends with '/'"):
            check_output_path(given, what="--out")
        assert check_output_path(given[:-1], what="--out") is not None
    assert (tmp_path / "e.png").read_bytes() == b"old" and not (tmp_path / "feats").exists()
    with pytest.raises(OutputPathError, match="is a directory"):   # an existing one: as before
        check_output_path(f"{tmp_path}/", what="--out")


def test_a_dead_writers_temporary_is_swept_by_the_next_write(tmp_path):
    """A writer killed mid-write (SIGKILL, a crash) leaves ``.NAME.tmp-PID-*`` beside the
    output, which stayed for good (the QA helper's find): the next write of that name removes
    it when its pid runs no more and it is older than STALE_TMP_S. Controls: a live writer's
    (this process's pid), a recent one, another name's and a non-numeric one stay."""
    import itertools
    import time

    from nxhpc.runtime import outfile
    dead = next(p for p in itertools.count(4_000_000) if not os.path.exists(f"/proc/{p}"))
    out = tmp_path / "img.png"
    old = time.time() - outfile.STALE_TMP_S - 5
    names = {"stale": f".img.png.tmp-{dead}-0a1b2c3d", "live": f".img.png.tmp-{os.getpid()}-1",
             "recent": f".img.png.tmp-{dead}-2", "other": f".other.png.tmp-{dead}-3",
             "odd": ".img.png.tmp-x-4",
             # the user's own file of that prefix (not write_atomic's shape: 8 hex digits),
             # and another output's temporary whose name holds this one's prefix
             "users": f".img.png.tmp-{dead}-backup-before-edit",
             "nested": f".img.png.tmp-{dead}-y.tmp-{os.getpid()}-cafebabe"}
    for key, n in names.items():
        (tmp_path / n).write_bytes(b"partial")
        if key != "recent":
            os.utime(tmp_path / n, (old, old))
    write_atomic(out, lambda f: f.write(b"new"))
    assert out.read_bytes() == b"new"
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"img.png"} | {n for k, n in names.items() if k != "stale"}, left


def test_writes_outside_a_cli_are_not_recorded(tmp_path):
    """The record of completed writes (what an interrupted CLI names as written) is kept only
    inside a CLI frame: a library loop of writes grew it forever (the reviewer's find)."""
    from nxhpc.runtime import outfile
    for k in range(50):
        write_atomic(tmp_path / f"f{k}", lambda f: f.write(b"x"))
    assert outfile._written() == []
    mark = outfile.written_mark()                         # control: inside a frame, recorded
    write_atomic(tmp_path / "g", lambda f: f.write(b"y"))
    assert outfile.written_since(mark) == [str(tmp_path / "g")]
    outfile.written_end(mark)
    write_atomic(tmp_path / "h", lambda f: f.write(b"z"))
    assert outfile._written() == []


def test_the_file_stderr_writes_to_is_refused_as_a_cli_output(tmp_path):
    """``--out /dev/stderr 2> img.png`` (or ``--out F 2> F``) wrote a PNG with the progress bar
    inside it, exit 0 (the environment helper's find): a CLI's output is refused where its
    stderr goes, as where its stdout goes. The library's check takes it (no bar of its own);
    a terminal or the null device as stderr mixes nothing. Control: another file is taken."""
    import subprocess
    import sys
    err = tmp_path / "err.txt"
    code = ("import sys\n"
            "from nxhpc.runtime.outfile import (OutputPathError, check_cli_output_path,\n"
            "                                   check_output_path)\n"
            "for p in sys.argv[1:]:\n"
            "    check_output_path(p, what='PNG output')\n"
            "    try:\n"
            "        check_cli_output_path(p, what='--out')\n"
            "        print('taken', p)\n"
            "    except OutputPathError as e:\n"
            "        print('refused', e)\n")
    with open(err, "w") as f:
        r = subprocess.run([sys.executable, "-c", code, "/dev/stderr", str(err),
                            str(tmp_path / "x.png")], stdout=subprocess.PIPE, stderr=f,
                           text=True, timeout=60)
    assert r.returncode == 0, err.read_text()
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["refused", "refused", "taken"], lines
    assert "standard error" in lines[0] and "standard error" in lines[1]
    r = subprocess.run([sys.executable, "-c", code, "/dev/stderr"], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True, timeout=60)
    assert r.stdout.split()[0] == "taken", r.stdout
    # a pipe as stderr: taken where no bar is printed there (ddp --json /dev/stderr | jq),
    # refused where one is (generate / sample without --no-progress)
    bar = code.replace("what='--out')", "what='--out', progress_on_stderr=True)")
    for src, want in ((code, "taken"), (bar, "refused")):
        r = subprocess.run([sys.executable, "-c", src, "/dev/stderr"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        assert r.stdout.split()[0] == want, (r.stdout, r.stderr)


def test_a_relative_path_under_a_removed_working_directory(tmp_path):
    """The working directory removed under a relative output path: ``os.path.realpath`` raised
    FileNotFoundError, which ``ddp --json r.json`` turned into a traceback, exit 1 (the
    environment helper's find). It is an OutputPathError naming the cause now (exit 2 in
    every CLI). Control: an absolute path is checked as usual."""
    import subprocess
    import sys
    gone = tmp_path / "gone"
    code = (f"import os\nos.makedirs({str(gone)!r}); os.chdir({str(gone)!r}); "
            f"os.rmdir({str(gone)!r})\n"
            "from nxhpc.runtime.outfile import OutputPathError, check_output_path\n"
            f"check_output_path({str(tmp_path / 'abs.json')!r}, what='--json')\n"
            "try:\n"
            "    check_output_path('r.json', what='--json')\n"
            "except OutputPathError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--json r.json: the current directory no longer exists" in r.stdout, r.stdout
    r = subprocess.run(["sh", "-c", f'mkdir "{gone}" && cd "{gone}" && rmdir "{gone}" && '
                        f'exec "{sys.executable}" -m nxhpc ddp --workers 2 --steps 2 --json r.json'],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "current directory no longer exists" in r.stderr


def test_an_exclusive_write_never_replaces(tmp_path):
    """``write_atomic(exclusive=True)``: the complete file is put in place only where the name
    is still free; another writer's file is left as it is (FileExistsError) and no temporary
    is left. Control: a free name is written."""
    p = tmp_path / "img.png"
    p.write_bytes(b"theirs")
    with pytest.raises(FileExistsError):
        write_atomic(p, lambda f: f.write(b"mine"), exclusive=True)
    assert p.read_bytes() == b"theirs" and os.listdir(tmp_path) == ["img.png"]
    q = tmp_path / "free.png"
    write_atomic(q, lambda f: f.write(b"mine"), exclusive=True)
    assert q.read_bytes() == b"mine" and sorted(os.listdir(tmp_path)) == ["free.png", "img.png"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_an_exclusive_write_under_dev_shm_never_replaces():
    """``generate --out /dev/shm/imgs`` (a tmpfs scratch folder): paths under /dev are written
    in place, which truncated another run's image although ``exclusive`` was asked."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        p = os.path.join(d, "000-seed1.png")
        with open(p, "wb") as f:
            f.write(b"theirs")
        with pytest.raises(FileExistsError):
            write_atomic(p, lambda f: f.write(b"mine"), exclusive=True)
        with open(p, "rb") as f:
            assert f.read() == b"theirs"
    finally:
        shutil.rmtree(d)


def test_a_name_too_long_or_a_symlink_loop_is_refused_up_front(tmp_path, models_root):
    """A name over 255 bytes (or a path over 4095) gave exit 70 and a traceback in every CLI
    (``OSError: File name too long`` out of the output check or the model lookup; ``ddp
    --json`` exit 1), and a loop of symlinks as ``--out`` was replaced by a regular file,
    exit 0 (the CLI helper's finds). Both are refused now: the output check names the cause
    (exit 2), and a too-long path anywhere else is a usage error naming it (exit 2), each one
    line. Controls: a 200-byte name is taken; the loop's link is still a link."""
    import subprocess
    import sys

    from procutil import run_cli
    long_name = "a" * 300
    for bad, why in ((tmp_path / f"{long_name}.npy", "File name too long"),
                     (tmp_path / ("x/" * 2100 + "o.npy"), "File name too long")):
        with pytest.raises(OutputPathError, match=why):
            check_output_path(bad, what="--out")
    (tmp_path / "lA").symlink_to(tmp_path / "lB")
    (tmp_path / "lB").symlink_to(tmp_path / "lA")
    with pytest.raises(OutputPathError, match="Too many levels of symbolic links"):
        check_output_path(tmp_path / "lA", what="--out")
    assert check_output_path(tmp_path / ("b" * 200 + ".npy"), what="--out")   # control
    for mod, args in (("nxhpc.encode", ["tiny-te", "--prompt", "x", "--out",
                                        tmp_path / f"{long_name}.npy"]),
                      ("nxhpc.encode", ["tiny-te", "--prompt", "x", "--out", tmp_path / "lA"]),
                      ("nxhpc.models", ["show", long_name]),
                      ("nxhpc.models", ["--models-dir", tmp_path / long_name, "list"])):
        r = run_cli(mod, args, models_root)
        assert r.returncode == 2, (mod, args[-1], r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "File name too long" in r.stderr or "symbolic links" in r.stderr, r.stderr
    assert (tmp_path / "lA").is_symlink() and (tmp_path / "lB").is_symlink()
    r = subprocess.run([sys.executable, "-m", "nxhpc", "ddp", "--workers", "2", "--steps", "2",
                        "--json", str(tmp_path / f"{long_name}.json")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "File name too long" in r.stderr


@pytest.mark.parametrize("cli", ["encode", "blockrun"])
def test_an_npy_output_into_a_pipe_is_written_whole(cli, tmp_path, models_root):
    """``--out >(cat > f.npy)`` (a FIFO, a pipe) got the 128-byte ``.npy`` header, then the run
    failed after all its work with exit 8 "obtaining file position failed": ``np.save`` asks
    its file for a position (the CLI helper's find: encode, sample, denoise, blockrun). The
    bytes are made in memory and written whole now. The reader's array equals the one the
    same run writes to a regular file (control)."""
    import io
    import stat
    import threading

    import numpy as np

    from procutil import run_cli
    args = (["tiny-te", "--prompt", "a fox", "--out"] if cli == "encode"
            else ["tiny", "1", "--save-output"])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = {}

    def read() -> None:
        with open(fifo, "rb") as f:
            got["bytes"] = f.read()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    r = run_cli(f"nxhpc.{cli}", [*args, fifo], models_root)
    reader.join(60)
    assert r.returncode == 0, r.stderr[-2000:]
    a = np.load(io.BytesIO(got["bytes"]))
    r = run_cli(f"nxhpc.{cli}", [*args, tmp_path / "f.npy"], models_root)      # control
    assert r.returncode == 0, r.stderr[-2000:]
    b = np.load(tmp_path / "f.npy")
    assert a.dtype == np.float32 and a.shape == b.shape and np.array_equal(a, b)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)                # written in place
