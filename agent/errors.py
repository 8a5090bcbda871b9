"""The base of errors whose message already says what went wrong and what to do.

The command line prints such an error as its one line, whichever layer raised it, without importing that layer.
"""

from __future__ import annotations


class ExplainedError(Exception):
    """An error whose message names the problem and the way out; shown to the user as it is."""
