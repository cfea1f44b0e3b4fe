"""Progress display on rank 0: a bar on a terminal, periodic plain lines in a log file."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Shows steps, loss and samples/s while training, then one summary line.

    On a terminal the bar redraws in place; otherwise (Slurm output files,
    CI logs) a line is printed every ``every`` steps so the file stays short.
    ``MPIPIPE_PROGRESS`` (``auto``, ``bar`` or ``lines``) overrides the choice.
    """

    def __init__(self, total: int, *, enabled: bool = True, every: int = 10, prog: str = "train",
                 stream: TextIO | None = None, quiet: bool = False) -> None:
        self.total = max(int(total), 1)
        self.enabled = enabled  # False on every rank but 0: nothing is printed
        self.quiet = quiet  # --quiet: only the summary line is printed
        self.every = max(int(every), 1)
        self.prog = prog
        self.stream = stream or sys.stdout
        # Open MPI hands rank 0 a pseudo-terminal even when mpirun's own output
        # goes to a file (a Slurm job's output): MPIPIPE_PROGRESS=lines forces
        # plain lines there (the job scripts set it), =bar forces the bar.
        mode = os.environ.get("MPIPIPE_PROGRESS", "auto")
        self.tty = enabled and not quiet and (mode == "bar" or (mode != "lines" and self.stream.isatty()))
        self._t0 = time.perf_counter()

    def update(self, step: int, *, loss: float = math.nan, samples_per_s: float = math.nan,
               note: str = "") -> None:
        """Report that ``step`` (1-based count of completed steps) is done."""
        if not self.enabled or self.quiet:
            return
        extra = f"  {note}" if note else ""
        if self.tty:
            width = 30
            filled = int(width * min(step, self.total) / self.total)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(
                f"\r{self.prog} [{bar}] {step}/{self.total}  loss {loss:.4f}  "
                f"{samples_per_s:,.0f} samples/s{extra}\033[K"
            )
            self.stream.flush()
        elif step % self.every == 0 or step == self.total or note:
            elapsed = time.perf_counter() - self._t0
            print(f"{self.prog}: step {step}/{self.total}  loss {loss:.4f}  "
                  f"{samples_per_s:,.0f} samples/s  {elapsed:.1f}s{extra}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """Print a line between bar redraws (an event, an evaluation)."""
        if not self.enabled or self.quiet:
            return
        if self.tty:
            self.stream.write("\r\033[K")
        print(f"{self.prog}: {text}", file=self.stream, flush=True)

    def summary(self, **figures: object) -> None:
        """The final line: steps, samples/s, final loss, test accuracy, log path."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\n")
        parts = []
        for key, value in figures.items():
            if isinstance(value, float):
                value = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
            parts.append(f"{key.replace('_', ' ')} {value}")
        print(f"{self.prog}: done: " + ", ".join(parts), file=self.stream, flush=True)
