"""The run-config keys as tables (docs/RUN-CONFIG.md), written from ``pyproject.toml``'s
``[tool.flwr.app.config]`` and its comments, so that the reference cannot drift from
the declaration: ``fedefc keys`` prints it, ``--write`` writes the doc, ``--check`` exits
1 where the doc differs.

The declaration is read as its header says: ``## `` lines open a tier, ``### `` lines a
group within it; a key's meaning is the comment after it on its line, or else the
``# `` lines just above it, which also cover the keys after it that have no comment of
their own (one row for all of them). A key without a meaning is an error naming it.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import ConfigError

from .run_configs import APP_DIR

PYPROJECT = APP_DIR / "pyproject.toml"
DOC = APP_DIR / "docs" / "RUN-CONFIG.md"
TABLE = "[tool.flwr.app.config]"
KEY_LINE = re.compile(r'^(?P<key>[a-z0-9-]+) = (?P<value>"[^"]*"|[^#\s]+)\s*(?:#\s*(?P<note>.*))?$')
INTRO = """\
# Run-config keys

Every key a run has, with its default, in three tiers: what a user sets, the method's,
and the operator's and experimental ones. Set a key with `fedefc run --set KEY=VALUE`
(or in a TOML file for `flwr run --run-config`); a bad key or value fails before
anything starts, naming the key, the value and what is allowed.

This page is written from `pyproject.toml` (`[tool.flwr.app.config]` and its comments)
by `fedefc keys --write`; a test fails where the two differ. Section signs (§) are
[FEDEFC.md](FEDEFC.md)'s.
"""


class KeysDocError(ConfigError):
    """The declaration cannot be read as tables; the message names the line and the fix."""


@dataclass
class Row:
    keys: list[str]
    defaults: list[str]
    meaning: str


@dataclass
class Group:
    title: str  # "" for the rows of a tier before its first group
    rows: list[Row] = field(default_factory=list)


@dataclass
class Tier:
    title: str
    groups: list[Group] = field(default_factory=list)


def config_lines(text: str) -> list[str]:
    """The lines of ``[tool.flwr.app.config]``, up to the next table or blank line."""
    lines = text.splitlines()
    try:
        start = lines.index(TABLE) + 1
    except ValueError:
        raise KeysDocError(f"pyproject.toml has no {TABLE} table") from None
    body = []
    for line in lines[start:]:
        if not line.strip() or line.startswith("["):
            break
        body.append(line)
    return body


def read_tiers(text: str) -> list[Tier]:
    """The tiers of the declaration in ``text`` (a pyproject.toml), as the module says."""
    tiers: list[Tier] = []
    block: list[str] = []  # the comment lines above the next key
    shared: Row | None = None  # the row a block opened, which the next bare keys join
    for number, line in enumerate(config_lines(text), 1):
        where = f"pyproject.toml {TABLE}, line {number} ({line.strip()!r})"
        if line.startswith("## "):
            tiers.append(Tier(line[3:].strip()))
            block, shared = [], None
        elif line.startswith("### "):
            _tier(tiers, where).groups.append(Group(line[4:].strip()))
            block, shared = [], None
        elif line.startswith("#"):
            block.append(line.lstrip("#").strip())
            shared = None
        else:
            match = KEY_LINE.match(line)
            if match is None:
                raise KeysDocError(f"{where}: not 'key = value  # meaning'")
            key, value, note = match["key"], match["value"], match["note"]
            if note and block:
                raise KeysDocError(f"{where}: {key!r} has a comment above it and one on its "
                                   "line; keep one")
            if note or block:
                shared = Row([key], [value], note or " ".join(block))
                _group(tiers, where).rows.append(shared)
                block = []
                if note:
                    shared = None
            elif shared is not None:
                shared.keys.append(key)
                shared.defaults.append(value)
            else:
                raise KeysDocError(f"{where}: {key!r} says nothing of what it does; add "
                                   "'# meaning' after it")
    return tiers


def _tier(tiers: list[Tier], where: str) -> Tier:
    if not tiers:
        raise KeysDocError(f"{where}: a key or group before the first '## ' tier")
    return tiers[-1]


def _group(tiers: list[Tier], where: str) -> Group:
    tier = _tier(tiers, where)
    if not tier.groups:
        tier.groups.append(Group(""))
    return tier.groups[-1]


def _linked(text: str) -> str:
    """A meaning as a table cell: ``docs/X.md`` linked (the doc sits beside it), ``|``
    escaped."""
    return re.sub(r"docs/([A-Z-]+\.md)", r"[\1](\1)", text).replace("|", "\\|")


def render(text: str) -> str:
    """docs/RUN-CONFIG.md for the pyproject.toml ``text``; refused where a declared key
    is not in the tables or one is there twice."""
    tiers = read_tiers(text)
    declared = list(tomllib.loads(text)["tool"]["flwr"]["app"]["config"])
    listed = [k for t in tiers for g in t.groups for r in g.rows for k in r.keys]
    if sorted(listed) != sorted(declared):
        raise KeysDocError(f"pyproject.toml {TABLE}: keys missing from the tables "
                           f"{sorted(set(declared) - set(listed))}, listed twice "
                           f"{sorted({k for k in listed if listed.count(k) > 1})}")
    out = [INTRO]
    for tier in tiers:
        count = sum(len(r.keys) for g in tier.groups for r in g.rows)
        out.append(f"## {tier.title} ({count} keys)\n")
        for group in tier.groups:
            if group.title:
                out.append(f"### {_linked(group.title)}\n")
            out += ["| key | default | what it does |", "| --- | --- | --- |"]
            out += [f"| {', '.join(f'`{k}`' for k in r.keys)} | "
                    f"{', '.join(f'`{d}`' for d in r.defaults)} | {_linked(r.meaning)} |"
                    for r in group.rows]
            out.append("")
    return "\n".join(out)


def keys_doc(write: bool = False, pyproject: Path = PYPROJECT, doc: Path = DOC
             ) -> tuple[str, bool]:
    """(the doc's text, whether the file on disk differs from it); ``write`` writes it."""
    text = render(pyproject.read_text(encoding="utf-8"))
    stale = not doc.is_file() or doc.read_text(encoding="utf-8") != text
    if write and stale:
        doc.write_text(text, encoding="utf-8")
    return text, stale
