"""Who broke a secure sum: adaptive group testing over the following rounds
(docs/THREAT-MODEL.md, "Steering the secure sum"; docs/PRIVACY.md, "Naming the client
that breaks a sum").

A sum that fails its checks (:mod:`.secure_sum`) says that one of its clients lied
inside its mask, never which: the masks hide every client's vector. But the next
rounds can be summed in smaller groups. The search keeps the **suspects**: the
partitions of the first refused sum, intersected with the partitions of every later
refused sum. While suspects train, a round is summed as (:meth:`CulpritSearch.groups`)

- a *test* group: half of the round's suspects, filled up to ``min-secure-clients``
  with the round's other clients (the fewest needed), and
- the *rest*: its own group when it holds at least ``min-secure-clients`` clients,
  else left out of that round.

A test group that is refused halves the suspects; the rest's sum, checked on its own,
is applied when it passes. When one suspect is left it is named and left out of the run
(:meth:`CulpritSearch.after`). A client that breaks every sum it is in is named within
about log2 K rounds after the first refusal (K the round's clients; one more round
each time the test group passes while it sits out). A search in which no sum is
refused for ceil(log2 K) + 2 rounds ends: a client that stopped lying costs the others
no more rounds.

Why this names no honest client while one client breaks the sums: every refused sum
holds that client, so it stays among the suspects, and a suspect is named only when it
is the one left in every refused sum's intersection. A passing group clears no one (a
liar may behave in a round). A round in which two groups are refused cannot have one
liar: the search then stops and names no one (two liars, or a bound the honest updates
break), until a later refusal starts it again. Two colluding clients can still have an
honest suspect named: one breaks the first sum, the other a later test group in which
that suspect is the one left; the record of every group and refusal (``culprit_search``)
lets the operator see it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from common.seeds import derive_seed


@dataclass
class CulpritSearch:
    """The search's state, kept in the checkpoint: the ``suspects`` (partition ids,
    sorted; empty: no search), the round whose refused sum started it, the round of the
    last refused sum, and how many rounds without one end it (``patience``)."""

    suspects: list[int] = field(default_factory=list)
    since: int = 0
    last: int = 0
    patience: int = 0

    def groups(self, partitions: list[int], min_clients: int, seed: int,
               server_round: int) -> list[list[int]] | None:
        """The round's ``partitions`` as the search sums them (module docstring): [the
        test group, the rest] or [the test group] (the rest left out of the round);
        None when no suspect trains in the round, no group smaller than the round can
        be formed, or no sum was refused for ``patience`` rounds (a client that stopped
        lying costs the others no more rounds: the search ends). The halves and the
        fillers are drawn by (seed, round)."""
        if self.suspects and server_round - self.last > self.patience:
            self.suspects = []
        suspects = [p for p in partitions if p in self.suspects]
        if not suspects or len(partitions) <= min_clients:
            return None
        rng = np.random.default_rng(derive_seed(seed, "culprit-search", server_round))
        suspects = [int(p) for p in rng.permutation(suspects)]
        others = [int(p) for p in rng.permutation(
            [p for p in partitions if p not in self.suspects])]
        half = max(1, len(suspects) // 2)
        test = suspects[:half] + others[:max(0, min_clients - half)]
        test += suspects[half:half + max(0, min_clients - len(test))]
        rest = sorted(set(partitions) - set(test))
        return [sorted(test), rest] if len(rest) >= min_clients else [sorted(test)]

    def after(self, server_round: int, refused: list[list[int]]) -> tuple[int | None, str]:
        """Take in the round's sums refused by their checks (each a list of its
        partitions): (the partition named, or None; what the search concluded, in
        words, or "" when nothing changed)."""
        if not refused:
            return None, ""
        if len(refused) > 1:
            self.suspects, self.since = [], 0
            return None, ("two sums of this round were refused: more than one client "
                          "broke them, or the update bound is too small for this model; "
                          "the search names no one")
        members = sorted(int(p) for p in refused[0])
        left = [p for p in self.suspects if p in members]
        if not left:  # a first refusal, or one the suspects had no part in
            self.suspects, self.since = members, server_round
            self.patience = math.ceil(math.log2(max(2, len(members)))) + 2
        else:
            self.suspects = left
        self.last = server_round
        if len(self.suspects) > 1:
            return None, (f"suspects {self.suspects}: each refused sum since round "
                          f"{self.since} held one of them")
        named, since = self.suspects[0], self.since
        self.suspects, self.since = [], 0
        return named, (f"partition {named} is the one client in every sum refused since "
                       f"round {since}: it broke them from inside its mask")

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, state: dict[str, Any] | None) -> CulpritSearch:
        state = state or {}
        return cls([int(p) for p in state.get("suspects", [])], int(state.get("since", 0)),
                    int(state.get("last", 0)), int(state.get("patience", 0)))
