"""The emulated testbed as a rank sees it: which nodes are up, and where each node's processes are listed.

Why apart from the emulator (:mod:`mpipipe.tools.emulator`, which brings a testbed up and
down): a rank under a node fault (``node-kill``, ``partition``: :mod:`mpipipe.core.mpi.faults`)
only reads what the emulator wrote in its state directory, and no rank imports the tools.
The emulator names its nodes, and writes its state, with the constants declared here.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PREFIX", "STATE", "node_hosts", "node_procs"]

PREFIX = "mpt-"  # every name the emulator makes starts with it: a node's hostname is PREFIX + name
STATE = Path("/run") / (PREFIX + "testbed")  # the state directory of the testbed that is up


def node_hosts() -> frozenset[str]:
    """The hostnames (``mpt-NAME``) of the nodes of the testbed that is up; empty when none is."""
    try:
        nodes = json.loads((STATE / "testbed.json").read_text())["nodes"]
        return frozenset(PREFIX + n["name"] for n in nodes)
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()


def node_procs(node: str) -> Path:
    """The ``cgroup.procs`` file of testbed node ``node`` (no ``mpt-`` prefix), as the state names it."""
    return Path((STATE / "nodes" / (PREFIX + node)).read_text().split()[0])
