"""The one-line usage error every check ends with: `error: <what is wrong and what is allowed>` on stderr, exit code 2
(as tyro's own parse errors), before anything loads."""

from __future__ import annotations

import sys
from typing import NoReturn


def usage_error(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (as for tyro's own parse errors)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def need(ok: bool, message: str) -> None:
    if not ok:
        usage_error(message)
