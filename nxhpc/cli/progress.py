"""The progress bar of the long CLIs (``generate``, ``sample``): one tqdm bar on stderr.

Owns :class:`Progress`: a bar of ``total`` units whose description names the stage it is in,
with a note (e.g. seconds per step) after it, cleared from its line when the run fails so that
the error message does not follow a stale bar; plain lines on stderr where tqdm cannot be
imported.
Must not: write to stdout (the report goes there), or let the bar fail a run.
"""
from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """``Progress(total, enabled, name, unit)``: ``stage(s)`` shows ``"name: s"``, ``step(note,
    line=)`` counts one unit (``note`` after the bar; ``line`` is printed instead where tqdm is
    missing), ``close(failed=)`` ends it (``failed=True``: the bar's line is cleared). Does
    nothing when not ``enabled`` (e.g. ``--no-progress``, or an MPI rank other than 0). A bar
    that cannot write (stderr closed or full) is dropped, never an error of the run."""

    def __init__(self, total: int, enabled: bool, name: str, unit: str,
                 stage: str | None = None) -> None:
        self.name, self.enabled, self.bar = name, enabled and sys.stderr is not None, None
        if self.enabled:                    # (print(file=None) would write to stdout)
            try:
                from tqdm import tqdm
            except Exception:       # missing, or a bad TQDM_* setting met on import
                return
            desc = name if stage is None else f"{name}: {stage}"
            try:
                self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                                dynamic_ncols=True, leave=True)
            except Exception:       # stderr unwritable, or a bad TQDM_* setting met on the
                self.enabled = False    # first draw (TQDM_BAR_FORMAT='{x}': KeyError)

    def stage(self, stage: str) -> None:
        if self.bar is not None:
            self._safe(lambda: self.bar.set_description_str(f"{self.name}: {stage}",
                                                            refresh=True))

    def step(self, note: str | None = None, line: str | None = None) -> None:
        if self.bar is not None:
            def bump() -> None:
                if note:
                    self.bar.set_postfix_str(note, refresh=False)
                self.bar.update(1)
            self._safe(bump)
        elif self.enabled and line and sys.stderr is not None:
            self._safe(lambda: print(line, file=sys.stderr, flush=True))

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            if failed:
                bar.leave = False
            try:
                bar.close()
            except Exception:
                pass

    def _safe(self, show) -> None:
        """``show()``; on a stderr that cannot be written the bar is dropped, quietly."""
        try:
            show()
        except Exception:                     # OSError of stderr, or a bad TQDM_* format
            bar, self.bar, self.enabled = self.bar, None, False
            if bar is not None:
                bar.disable = True            # its own close() then writes nothing
