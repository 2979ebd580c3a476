"""Private mount namespaces for tests: run a command with a small tmpfs mounted over a path
(``/dev/shm``, a directory), without touching the host's mounts. Root and ``unshare(1)`` only;
callers are skipped where that cannot be set up."""
import os
import shutil
import subprocess

import pytest


def require_private_mounts() -> None:
    """Skip the calling test unless a private mount namespace with a tmpfs can be made here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k nx /mnt"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private namespace here: {probe.stderr.decode()[:200]}")


def run_with_tmpfs(args: list[str], mountpoint: str, options: str,
                   **kw) -> subprocess.CompletedProcess:
    """Run ``args`` in a private mount namespace where ``mountpoint`` is a fresh tmpfs mounted
    with ``options`` (e.g. ``size=256k`` or ``size=64k,ro``)."""
    require_private_mounts()
    script = f'mount -t tmpfs -o {options} nxtest "$0" && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, mountpoint, *args],
                          capture_output=True, text=True, **kw)


def run_script(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    """Run the shell ``script`` (``$1``.. = ``args``) in a private mount namespace, where it may
    mount what it needs."""
    require_private_mounts()
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, **kw)
