"""The machine a benchmark ran on, with no framework: date, Python, CPU."""

from __future__ import annotations

import datetime as dt
import os
import platform
from typing import Any

__all__ = ["machine"]


def machine() -> dict[str, Any]:
    """Date (UTC), Python version, CPU model and count."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
    }
