"""/proc helpers shared by the process-lifecycle tests (workers, blockrun, ddp): Linux only."""
import os


def alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (zombies included)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def with_tests_on_path(env=None) -> dict:
    """A copy of ``env`` (default: os.environ) whose PYTHONPATH starts with this tests folder, so
    that a child script can import these helpers."""
    env = dict(os.environ if env is None else env)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def wait_until(pred, timeout: float, step: float = 0.02):
    """Poll ``pred()`` until it is truthy or ``timeout`` seconds pass; its last value."""
    import time
    deadline = time.monotonic() + timeout
    while not (v := pred()) and time.monotonic() < deadline:
        time.sleep(step)
    return v
