"""`python -m mpipipe.testbed`: the emulated cluster's command (up, run, exec, down, status,
mpirun-args). The testbed itself lives in :mod:`mpipipe.core.testbed`, under the launchers."""

from __future__ import annotations

import sys

from mpipipe.core.testbed import main

if __name__ == "__main__":
    sys.exit(main())
