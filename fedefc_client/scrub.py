"""Error text scrubbed before it leaves a node (docs/PRIVACY.md, "Data at rest and in
the clear").

Flower sends the text of a ClientApp's exception to the server (``<class ...>:<'...'>``),
and exception texts name files: the node's ``data-path``, its cache, a label file
that failed to decode, the user's home. :func:`scrub` replaces every string value of
the node config (the operator's private settings) by ``<node-config:KEY>``, every
absolute, home-relative or Windows path and ``file:`` URL by ``<path>``, and cuts the
text at :data:`MAX_CHARS` (an exception's text can quote data). The full exception
stays in the node's own log.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

MAX_CHARS = 500
PATH = "<path>"

_PATTERNS = (
    re.compile(r"file:/{0,3}[^\s'\"<>]+"),
    re.compile(r"(?<![\w/.~-])~[\w.-]*(?:/[^\s'\"<>|,;:()\[\]{}]*)+"),
    re.compile(r"(?<![\w/.-])/[^\s/'\"<>|,;:()\[\]{}=]+(?:/[^\s/'\"<>|,;:()\[\]{}=]*)*"),
    re.compile(r"(?<![\w])[A-Za-z]:\\[^\s'\"<>|]*"),
    re.compile(r"\\\\[^\s'\"<>|]+"),
)


def private_strings(node_config: Mapping) -> dict[str, str]:
    """{value: label} of the strings to hide: the node config's string values and the
    user's home folder (longest first, so that a path inside another is found whole)."""
    found: dict[str, str] = {}
    for key, value in node_config.items():
        if isinstance(value, str) and len(value) > 1:
            found[value] = f"<node-config:{key}>"
            found.setdefault(os.path.realpath(value) if os.path.isabs(value) else value,
                             f"<node-config:{key}>")
    home = os.path.expanduser("~")
    if home not in ("~", "/"):
        found.setdefault(home, PATH)
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def scrub(text: str, private: Mapping[str, str]) -> str:
    """``text`` without the ``private`` strings (each replaced by its label) and paths,
    at most :data:`MAX_CHARS` long."""
    for value, label in private.items():
        text = text.replace(value, label)
    for pattern in _PATTERNS:
        text = pattern.sub(PATH, text)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 3] + "..."
