"""Running ``async def`` tests without a pytest plugin."""

from __future__ import annotations

import asyncio
import functools


def run_async(test, hang_guard_s: float = 60.0):
    """Runs the test on a fresh event loop; ``hang_guard_s`` bounds it (no speed is assumed)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(test(*args, **kwargs), hang_guard_s))
    return wrapper
