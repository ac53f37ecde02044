"""Error text scrubbed before it leaves a node (docs/PRIVACY.md, "Data at rest and in
the clear").

Flower sends the text of a ClientApp's exception to the server (``<class ...>:<'...'>``),
and exception texts name files: the node's ``data-path``, its cache, a label file
that failed to decode, the user's home. :func:`scrub` replaces every string value of
the node config (the operator's private settings) by ``<node-config:KEY>``, every quoted
text holding a path separator (a file name with spaces in it, whole) and every absolute,
home-relative, relative (``site-a/img 017.png`` up to its extension, or two folders
deep) or Windows path and ``file:`` URL by ``<path>``, and cuts the text at
:data:`MAX_CHARS`. An exception of another package than the project's (``KeyError``,
``OSError``, an image decoder's) may name the data itself, a label, a sample id, a
person, a date or a record number: :func:`exception_text` replaces each of its quoted
texts (straight or typographic quotes) by ``'<text>'`` and every other word but one of
lowercase ASCII letters (``Jane``, ``Doe``, ``Jane_Doe``, ``patient-0042``, ``42``,
``2024-03-05``, ``jane@ward.org``) by ``<id>``: what stays reads as English (issue 58:
a capitalized name, a number, a date and an e-mail address went through). The
project's own errors quote only what the project wrote, but may carry another
package's text (``DatasetError(f"... ({err})")``): that text, found through the
exception's cause or context, is scrubbed as another package's. The full exception
stays in the node's own log (docs/PRIVACY.md, "Data at rest and in the clear").
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

MAX_CHARS = 500
PATH = "<path>"
TEXT = "'<text>'"
IDENTIFIER = "<id>"
OWN_PACKAGES = frozenset({"common", "fedefc_client", "fedefc_server", "fedefc_cli"})

_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"|\u2018[^\u2019\n]*\u2019|\u201c[^\u201d\n]*\u201d"
                     r"|\u00ab[^\u00bb\n]*\u00bb|`[^`\n]*`")
_PLACEHOLDER = re.compile(r"(['\"])<[\w:-]+>\1")  # '<path>', what scrub wrote
_PLACEHOLDERS = re.compile(r"(<[\w:-]+>)")  # <path>, <node-config:KEY>: left as they are
_TOKEN = re.compile(r"[^\s'\"()\[\]{},:;=<>\u2018\u2019\u201c\u201d\u00ab\u00bb`]+")
_QUOTED_PATH = re.compile(r"(['\"])[^'\"\n]*[/\\][^'\"\n]*\1")
# a relative path: folders then a file name with an extension (spaces allowed inside it),
# or at least two folders deep; "and/or", "1/2" and URLs are left alone
_RELATIVE = re.compile(r"(?<![\w/.~:-])(?:[\w.-]+/)+(?:[\w .-]*[\w-]\.[A-Za-z0-9]{1,5}\b"
                       r"|(?<=/)[\w.-]+(?=/)[\w./-]*)")

_PATTERNS = (
    _QUOTED_PATH,
    re.compile(r"file:/{0,3}[^\s'\"<>]+"),
    re.compile(r"(?<![\w/.~-])~[\w.-]*(?:/[^\s'\"<>|,;:()\[\]{}]*)+"),
    re.compile(r"(?<![\w/.-])/[^\s/'\"<>|,;:()\[\]{}=]+(?:/[^\s/'\"<>|,;:()\[\]{}=]*)*"),
    re.compile(r"(?<![\w])[A-Za-z]:\\[^\s'\"<>|]*"),
    re.compile(r"\\\\[^\s'\"<>|]+"),
    _RELATIVE,
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
        text = pattern.sub(lambda m: f"{m.group(1)}{PATH}{m.group(1)}"
                           if m.re is _QUOTED_PATH else PATH, text)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 3] + "..."


def _identifier(token: str) -> bool:
    """Whether an unquoted word of another package's text may name data: anything but
    a word of lowercase ASCII letters (module docstring)."""
    core = token.strip(".-!?")
    return bool(core) and not (core.isascii() and core.isalpha() and core.islower())


def foreign_text(text: str, private: Mapping[str, str]) -> str:
    """Another package's exception text as it may leave the node: :func:`scrub`bed,
    every quoted text ``'<text>'`` (a quoted path ``'<path>'``), every unquoted word but
    lowercase English ``<id>``."""
    text = scrub(text, private)
    text = _QUOTED.sub(lambda m: m.group(0) if _PLACEHOLDER.fullmatch(m.group(0)) else TEXT,
                       text)
    return "".join(part if i % 2 else _TOKEN.sub(
        lambda m: IDENTIFIER if _identifier(m.group(0)) else m.group(0), part)
        for i, part in enumerate(_PLACEHOLDERS.split(text)))


def _foreign(err: BaseException) -> bool:
    return type(err).__module__.split(".")[0] not in OWN_PACKAGES


def exception_text(err: BaseException, private: Mapping[str, str]) -> str:
    """``<class name>: <text>`` of ``err`` as it may leave the node, :func:`scrub`bed:
    another package's text through :func:`foreign_text`, whether ``err`` is its
    exception or the project's carrying its text (an exception of its cause or context
    chain whose text the project's quotes)."""
    text = str(err)
    if _foreign(err):
        text = foreign_text(text, private)
    else:
        inner, seen = err.__cause__ or err.__context__, {id(err)}
        while inner is not None and id(inner) not in seen:
            seen.add(id(inner))
            quoted = str(inner)
            if _foreign(inner) and quoted and quoted in text:
                text = text.replace(quoted, foreign_text(quoted, private))
            inner = inner.__cause__ or inner.__context__
    return scrub(f"{type(err).__name__}: {text}", private)
