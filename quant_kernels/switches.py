"""Launch-path switches of the environment (``QSERVE_...=1`` / ``0``): a new kernel or launch path waits
behind one until ``pytest -m gpu`` has passed with it on the device, then it becomes the default.

Knows: how a switch's value is read and refused. Must not know: what any switch turns on. In the
numeric core (it imports nothing of the repo) so that the kernel dispatchers and the engine read their
switches one way.
"""

from __future__ import annotations

import os


def env_switch(name: str, *, default: bool) -> bool:
    """ "1" on, "0" off, unset ``default`` (off while the path waits for its GPU run, on after it); any
    other value is refused, naming the variable (a "true" would otherwise silently mean off)."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 (on), 0 (off) or unset (default: {int(default)})")
    return default if value == "" else value == "1"
