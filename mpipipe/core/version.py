"""The package's version, in the core so that both systems' commands can print it.

Why here and not only in ``mpipipe/__init__.py``: Stannis may import ``mpipipe.core`` only
(tests/test_layers.py), and its ``--version`` prints the same number as mpipipe's.
"""

from __future__ import annotations

__all__ = ["__version__", "package_version"]

__version__ = "0.1.0"  # the one version number (mpipipe.__version__ and pyproject.toml read it)


def package_version() -> str:
    """The version ``--version`` prints: the installed distribution's (importlib.metadata),
    or ``__version__`` when the code runs from a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mpipipe")
    except PackageNotFoundError:
        return __version__
