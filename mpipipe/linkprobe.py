"""`python -m mpipipe.linkprobe ...`: an alias of `python -m mpipipe linkprobe ...`, kept for one release.

The link probe is a subcommand of `python -m mpipipe` now (:mod:`mpipipe.linkprobe_command`).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from mpipipe.__main__ import main

    sys.exit(main(["linkprobe", *sys.argv[1:]]))
