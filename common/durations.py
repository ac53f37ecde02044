"""A duration in words for a person: ``2.5 s``, ``48 s``, ``5 min 00 s``, ``1 h 02 min``.

Every duration the project prints (a timeout, a run's wall time, the time left) goes
through :func:`duration_text`, so no log shows a float's last digits
(``299.99999873800016 s``, the rest of a 300 s wait measured by the clock).
"""

from __future__ import annotations

import math


def duration_text(seconds: float | None) -> str:
    """``seconds`` rounded to what a reader needs: tenths below 10 s, whole seconds below
    two minutes, then minutes and seconds, then hours and minutes; ``no limit`` for None
    or infinity (a wait without a timeout)."""
    if seconds is None or math.isinf(seconds):
        return "no limit"
    if seconds < 9.95:
        return f"{max(seconds, 0.0):.1f} s"
    whole = round(seconds)
    if whole < 120:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"
