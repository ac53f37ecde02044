"""A run's interruptions and resumes, kept in its own records (docs/RELIABILITY.md,
"Checkpoint and resume").

A run that stops mid-way (its ServerApp stopped itself because a restarted SuperLink
may have lost a round's messages, :mod:`.link_watch`; or its process, its SuperExec or
the SuperLink stopped it) is resumed from its checkpoint and runs the round it was in
again. So that its files do not read like one clean run:

- a ServerApp that stops itself leaves why in its out-dir (:func:`note_interruption`,
  ``interrupted.json``); a process stopped from outside leaves nothing;
- the resumed run reads that note (and takes it away), or else says that the run
  stopped without a word, before its recorder starts (:func:`resume_event`: a run
  extended after it completed is no interruption);
- the record of the round it runs first carries the event (``resumed``: when, why),
  the summary lists them all (:func:`interruptions`), and ``curves.png`` marks each.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.results import atomic_write_json

NOTE = "interrupted.json"


def now() -> str:
    """The time, as the records write it (UTC, to the second)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def note_interruption(out_dir: str | Path, server_round: int, reason: str) -> None:
    """Leave in ``out_dir`` why the run stops in ``server_round``, for its resumption."""
    atomic_write_json(Path(out_dir) / NOTE, {"round": server_round, "at": now(),
                                             "reason": reason})


def resume_event(out_dir: str | Path, done: int) -> dict[str, Any] | None:
    """The event a run resumed after round ``done`` records in the round it runs first:
    ``{"at": when it resumed, "reason": why the run had stopped, "stopped_at": when,
    where its ServerApp said}``; None for a run that had ended (completed or degraded:
    resumed to run more rounds). Reads (and removes) the note of
    :func:`note_interruption`; call it before the recorder drops the summary."""
    folder = Path(out_dir)
    note = folder / NOTE
    said = json.loads(note.read_text()) if note.is_file() else None
    note.unlink(missing_ok=True)
    summary = folder / "summary.json"
    ended = json.loads(summary.read_text()) if summary.is_file() else {}
    if ended.get("status") in ("completed", "degraded"):
        return None
    if said is not None and said.get("round") == done + 1:
        return {"at": now(), "reason": str(said["reason"]), "stopped_at": said.get("at")}
    if ended.get("status") == "failed":
        return {"at": now(), "reason": f"the run failed: {ended.get('failure')}"}
    return {"at": now(), "reason": f"the run stopped after round {done} without a word from "
            "its ServerApp (its process, its SuperExec or the SuperLink stopped it)"}


def interruptions(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every resume of the run, from its records: ``{round, at, reason}`` (and
    ``stopped_at`` where known), ``round`` being the round it ran again first."""
    return [{"round": r["round"], **r["resumed"]} for r in rounds if r.get("resumed")]
