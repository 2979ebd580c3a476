"""The shared lifetime helpers: the ``with`` mixin (``formats.closing``) and the peak-RSS
report (``runtime.memory``) every model family's ``memory()`` returns."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nxhpc.formats.closing import Closing, MapHolder
from nxhpc.runtime.memory import memory_report, peak_rss_mb


class _Counted(Closing):
    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_with_returns_the_object_and_closes_it():
    obj = _Counted()
    with obj as got:
        assert got is obj and obj.closes == 0
    assert obj.closes == 1


def test_with_closes_and_propagates_an_exception():
    obj = _Counted()
    with pytest.raises(KeyError, match="boom"):
        with obj:
            raise KeyError("boom")
    assert obj.closes == 1


def test_a_class_without_close_says_so():
    class NoClose(Closing):
        pass
    with pytest.raises(NotImplementedError, match="NoClose must define close"):
        with NoClose():
            pass


@pytest.mark.parametrize("cls", [
    "nxhpc.formats.gguf_io:GGUFFile", "nxhpc.formats.safetensors_io:SafetensorsFile",
    "nxhpc.vae.files:VaeFile", "nxhpc.vae.model:VaeDecoder", "nxhpc.models.model:Model",
    "nxhpc.dit.denoiser:Denoiser", "nxhpc.qwen3.model:TextEncoderModel",
    "nxhpc.qwen3.encoder:TextEncoder"])
def test_the_closable_classes_use_the_mixin_and_define_close(cls):
    import importlib
    mod, name = cls.split(":")
    c = getattr(importlib.import_module(mod), name)
    assert issubclass(c, Closing)
    assert c.close is not Closing.close        # each defines its own


def test_map_holder_drops_its_map_once():
    class Holder(MapHolder):
        def __init__(self, m):
            self.gguf = m

        def close(self):
            self._drop_map()
    m = _Counted()
    h = Holder(m)
    assert not h.closed
    with h:
        pass
    assert h.closed and h.gguf is None and m.closes == 1
    h.close()                                  # idempotent: the map is not closed twice
    assert m.closes == 1
    for cls in ("nxhpc.dit.denoiser:Denoiser", "nxhpc.qwen3.model:TextEncoderModel"):
        import importlib
        mod, name = cls.split(":")
        assert issubclass(getattr(importlib.import_module(mod), name), MapHolder)


def _vm_hwm_kib(pid) -> int:
    """The reference: the VmHWM line of /proc/PID/status, parsed by hand (kB)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split(":")[1].strip().split(" ")[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc only")
def test_peak_rss_of_this_process_and_of_a_child():
    assert peak_rss_mb() == _vm_hwm_kib("self") * 1024 / 1e6
    # The child says when it has started and then blocks; its peak is only read after that,
    # so it no longer grows while it is read (read mid-exec it raced: 0.10 MB against 0.21).
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = _vm_hwm_kib(child.pid) * 1024 / 1e6
        got = peak_rss_mb(child.pid)
        after = _vm_hwm_kib(child.pid) * 1024 / 1e6
        assert before > 1 and before <= got <= after       # a started Python holds > 1 MB
    finally:
        child.stdin.close()
        child.wait()
    # negative control: a pid that is gone reads as None, not as 0 or an error
    assert peak_rss_mb(child.pid) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc only")
def test_memory_report_keys_and_values():
    r = memory_report(3_000_000, None)
    assert list(r) == ["weights_mb", "arena_mb", "peak_rss_mb"]
    assert r["weights_mb"] == 3.0 and r["arena_mb"] is None and r["peak_rss_mb"] > 0
    r = memory_report(0, 5_000_000, [os.getpid(), 2 ** 22 + 7])    # the second pid: no such
    assert list(r) == ["weights_mb", "arena_mb", "peak_rss_mb", "worker_peak_rss_mb"]
    assert r["arena_mb"] == 5.0 and r["worker_peak_rss_mb"] == pytest.approx(r["peak_rss_mb"],
                                                                             rel=0.5)
    assert memory_report(0, 0, [])["worker_peak_rss_mb"] is None


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc only")
def test_a_cli_started_by_a_large_process_reports_its_own_peak():
    """The CLIs' report (``cli.report.peak_rss_mb``: decode, generate) of a process that a
    larger one started: Linux keeps the starter's peak in the child's ``ru_maxrss`` across
    exec, so a benchmark or notebook holding gigabytes made every run report its own size."""
    held = np.ones(300_000_000 // 8)           # 300 MB touched by this (the starting) process
    code = ("import json, resource; from nxhpc.cli.report import peak_rss_mb; "
            "print(json.dumps([peak_rss_mb()['peak_rss_mb'], "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6, "
            "open('/proc/self/status').read()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    got, ru_maxrss, status = json.loads(out)
    hwm = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")) * 1024 / 1e6
    assert held.nbytes >= 3e8 and got <= hwm + 0.1 and got < 150
    # control: the trap is there on this kernel (the child's ru_maxrss holds the 300 MB), so
    # a report taken from ru_maxrss fails the bound above
    assert ru_maxrss >= 300
