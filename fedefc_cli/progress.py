"""A progress line after each round of a run whose log reaches a terminal: the round, the
time a round takes and about how long the rest will take (README, "The first run"). A
log copied to a file or a pipe gets none: it is a record, not a
display (:func:`.flower.copy_lines`).

The estimate is the wall time per round seen here since the first round line (so a
resumed run measures its own rounds), times the rounds left; a run the phase-2 guard
ends early takes less.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from common.durations import duration_text

# the ServerApp's line for a recorded round, ``[round t/T] ...`` (fedefc_server/round_loop.py)
ROUND_LINE = re.compile(r"\[round (\d+)/(\d+)\]")


class RoundProgress:
    """Reads a run's log lines as they arrive; :meth:`after` gives the progress line
    for a line that records a new round."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.first: tuple[int, float] | None = None  # (round, when its line came)
        self.last = -1  # the last round seen (a round's other lines repeat its number)

    def after(self, line: str) -> str | None:
        """The progress line after ``line``, or None (not a new round's line)."""
        match = ROUND_LINE.search(line)
        if match is None or int(match.group(1)) <= self.last:
            return None
        done, total = int(match.group(1)), int(match.group(2))
        self.last, now = done, self.clock()
        if self.first is None:
            self.first = (done, now)
            return None
        per_round = (now - self.first[1]) / (done - self.first[0])
        left = (f", about {duration_text(per_round * (total - done))} left" if done < total
                else "")
        return f"fedefc: round {done} of {total} done, {duration_text(per_round)} a round{left}"
