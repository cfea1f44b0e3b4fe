"""The cluster tests make real testbeds (namespaces, links, cgroups): root only.

Without root they are skipped with the reason, unless MPIPIPE_REQUIRE_CLUSTER=1 (set by
``make test-cluster``, which CI runs as root), where a skip would hide that nothing ran:
then they fail. Every test module starts and ends with ``down``, so a failed or killed
earlier run cannot spoil a test, and none leaves anything behind.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpipipe.tools import emulator
from mpipipe.tools.emulator import Testbed

THREE_NODES = """\
subnet = "10.213.0.0/24"
[nodes.a]
cpu = 0.5
link_mbit = 1000
[nodes.b]
cpu = 0.5
link_mbit = 1000
[nodes.c]
cpu = 0.5
link_mbit = 100
"""


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the testbed needs root"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces"
    missing = [t for t in emulator.TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2 util-linux)"
    return None


@pytest.fixture(scope="module", autouse=True)
def clean_machine() -> Iterator[None]:
    """Skip (or fail under make test-cluster) where a testbed cannot be made; down before and after."""
    why = _why_not()
    if why is not None:
        if os.environ.get("MPIPIPE_REQUIRE_CLUSTER") == "1":
            pytest.fail(f"cluster tests cannot run: {why}")
        pytest.skip(f"cluster tests: {why}")
    emulator.down()
    try:
        yield
    finally:
        emulator.down()


@pytest.fixture(scope="session")
def three_nodes_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A testbed file: nodes a and b at 1000 Mbit/s, c at 100 Mbit/s, half a core each."""
    path = tmp_path_factory.mktemp("testbed") / "three.toml"
    path.write_text(THREE_NODES)
    return path


@pytest.fixture(scope="module")
def bed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """The testbed of the module's ``NODES`` text (else the three nodes), up for the module."""
    path = tmp_path_factory.mktemp("testbed") / "bed.toml"
    path.write_text(getattr(request.module, "NODES", THREE_NODES))
    tb = emulator.load(path)
    emulator.up(tb)
    try:
        yield tb
    finally:
        emulator.down()
