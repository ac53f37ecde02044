"""What a person is shown of a run's log while ``fedefc run`` or ``fedefc deploy
submit`` follows it (:func:`.flower.copy_lines`): the log, less what repeats. The whole
text stays where the log is kept (``flwr log RUN_ID CONNECTION``; ``fedefc run``'s
``run.log`` in the out-dir); :class:`LogView` folds, each into one line:

- a Python traceback (``Traceback (most recent call last):`` to the exception's line,
  chained ones included) into that exception's line, saying how many lines were
  folded and where they are; the same traceback again into a line saying so;
- Flower's exit block (``Exit Code: N``, its help text, a blank line and its help
  page's address) into the code and its text;
- a line repeated at once (Flower's ``Connection attempt failed, retrying in 2.37
  seconds`` through an outage, ``Manually terminating ClientAppActor`` from each
  actor) into the first, then one line counting the rest;
- Flower's header of its run history (``[SUMMARY]``) and blank log lines, shown not at
  all.

Flower's lines may carry their time (:mod:`common.flower_log`); a repeat is a repeat
whatever its time.
"""

from __future__ import annotations

import re

STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")  # common/flower_log.py
LEVEL = rf"(?:DEBUG|INFO|WARNING|ERROR)(?:\s+{STAMP.pattern})?\s*:"  # Flower's line prefix
BLANK = re.compile(rf"^\s*(?:{LEVEL})?\s*$")
TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception, another exception occurred:",
           "The above exception was the direct cause of the following exception:")
EXIT_CODE = re.compile(r"\bExit Code: \d+")
HELP_PAGE = "For more information, visit:"
HEADER = re.compile(rf"^\s*(?:{LEVEL})?\s*\[SUMMARY\]\s*$")
ACTOR = re.compile(r"^\(\w+ pid=\d+\)\s*")  # Ray's prefix of an actor's line
SECONDS = re.compile(r"\d+(?:\.\d+)?(?= ?(?:s|seconds)\b)")


def repeat_key(text: str) -> str:
    """A line as :class:`LogView` compares it with the one before: without Ray's actor
    prefix and Flower's time, its durations ``2.37 seconds`` made equal."""
    return SECONDS.sub("#", STAMP.sub("", ACTOR.sub("", text.strip())))


class LogView:
    """Feed it a log's lines in order (:meth:`feed`), then :meth:`close`; each returns
    what to show: ``None`` for the line fed, shown as it came, or a line of the view's
    own. ``where``: where the whole text is, named in a folded traceback's line."""

    def __init__(self, where: str):
        self.where = where
        self.traceback: list[str] | None = None  # the lines of the traceback being folded
        self.exit_block: list[str] | None = None  # Flower's exit block being folded
        self.exceptions: set[str] = set()  # the exceptions whose traceback was shown
        self.last = ""  # the key of the last line shown
        self.repeats = 0  # how many times it came again since

    def feed(self, text: str) -> list[str | None]:
        if self.traceback is not None:
            if text.startswith((" ", "\t")) or text.strip() in (*CHAINED, TRACEBACK, ""):
                self.traceback.append(text)
                return []
            return self._fold_traceback(text)
        if self.exit_block is not None:
            if HELP_PAGE in text:
                return self._fold_exit()
            if not EXIT_CODE.search(text) and (BLANK.match(text) or not re.match(
                    rf"^\s*(?:\(\w+ pid=\d+\)\s*)?{LEVEL}", text)):
                self.exit_block.append(text)
                return []
            return [*self._fold_exit(), *self.feed(text)]
        if text.strip() == TRACEBACK or text.strip().endswith(TRACEBACK):
            self.traceback = [text]
            return self._end_repeats()
        if EXIT_CODE.search(text):
            self.exit_block = [text]
            return self._end_repeats()
        if BLANK.match(text) or HEADER.match(text):
            return []
        key = repeat_key(text)
        if key == self.last:
            self.repeats += 1
            return []
        shown = self._end_repeats()
        self.last = key
        return [*shown, None]

    def close(self) -> list[str | None]:
        """What is still to show once the log has ended."""
        if self.traceback is not None:
            return self._fold_traceback(None)
        if self.exit_block is not None:
            return self._fold_exit()
        return self._end_repeats()

    def _end_repeats(self) -> list[str | None]:
        count, self.repeats, self.last = self.repeats, 0, ""
        return [f"  [the line above {count} more time{'s' * (count > 1)}]"] if count else []

    def _fold_traceback(self, last: str | None) -> list[str | None]:
        """The folded traceback's line; ``last``: the line that ended it (its
        exception's, shown within), None at the end of the log."""
        lines, self.traceback = self.traceback or [], None
        count = len(lines) + (last is not None)
        exception = (last or "").strip()
        if exception and exception in self.exceptions:
            return [f"  [the same traceback again, {count} lines: {exception}]"]
        self.exceptions.add(exception)
        head = f"  [a traceback of {count} lines, folded (the whole text: {self.where})]"
        return [f"{head} {exception}" if exception else head]

    def _fold_exit(self) -> list[str | None]:
        """Flower's exit block in one line: its code and text, without the blank line
        and the help page."""
        block, self.exit_block = self.exit_block or [], None
        words = [block[0].rstrip()] + [line.strip() for line in block[1:] if line.strip()]
        return [" ".join(words)]
