"""What makes a file a run log: the format's name and version in the root attributes,
and the error for a file that is not one.

Their own module because the writer (which stamps them), the take-over (which will not
write into a file without them) and the reader (which checks them) all need them, and
none of those should import another for two constants.
"""

from __future__ import annotations

__all__ = ["FORMAT", "FORMAT_VERSION", "LogError"]

FORMAT = "mpipipe-runlog"
FORMAT_VERSION = 1


class LogError(ValueError):
    """A file is not a readable run log; the message names what is missing."""
