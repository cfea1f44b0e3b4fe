"""`python -m mpipipe.testbed ...`: an alias of `python -m mpipipe testbed ...`, kept for one release.

The emulated cluster's command is a subcommand of `python -m mpipipe` now; the emulator
itself is :mod:`mpipipe.tools.emulator`.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from mpipipe.__main__ import main

    sys.exit(main(["testbed", *sys.argv[1:]]))
