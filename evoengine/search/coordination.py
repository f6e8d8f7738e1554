"""Coordination of the workers that search one (arch, workload) in one store.

Workers (threads of one process, processes, hosts) share nothing but the store and the
Optuna study in it. ``Coordination`` is one worker's side of that:

- **Claims.** A point is claimed before it is compiled (``Store.claim``: a row unique per
  (arch, workload, identity), inserted in its own transaction), so the second worker to
  pick a point gets a duplicate key and moves on. The measurement settles the claim, in the
  transaction that writes it (``Evidence.measurement``).
- **What is taken.** ``taken`` holds the identities that any worker has measured or
  claimed, which the sampler must not propose; ``measured`` those measured. Both are read
  back from the store every ``refresh_s`` and whenever this worker runs out of fresh points.
- **Liveness.** This worker's RUNNING trials heartbeat every ``heartbeat_s / 3`` (at least
  1 s). Every ``heartbeat_s`` it fails the study's trials silent for the grace period (a
  killed worker's, or a lost host's) and releases the claims of every finished trial that
  measured nothing, so their points are proposed again.

Contract. ``taken`` is the very set object the sampler was given: it is updated in place,
never replaced. ``Coordination`` writes claims (this worker's, and the deletion of
unmeasured claims of finished trials), heartbeats and stale-trial failures, never a
measurement, and never releases the claim of a trial still running anywhere. Store and
Optuna errors propagate, except from ``release_quietly`` (used while stopping: the next
worker's reap releases what it could not).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from evoengine.search.domain import Domain
from evoengine.search.study import SearchStudy
from evoengine.store import Store


class Coordination:
    """One worker's claims, heartbeats and view of the others, for one (arch, workload).

    ``in_flight()`` gives this worker's ``(trial, identity)`` pairs that are compiling,
    waiting for a GPU or on one: what it heartbeats, and whose claims are its own.
    """

    def __init__(self, store: Store, study: SearchStudy, taken: set[str], *, arch: str,
                 workload_key: str, run_id: int, heartbeat_s: float, refresh_s: float,
                 in_flight: Callable[[], Iterable[tuple[Any, str]]]) -> None:
        self.store = store
        self.study = study
        self.taken = taken
        self.measured: set[str] = set()
        self.arch = arch
        self.key = workload_key
        self.run_id = run_id
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat_s = heartbeat_s
        self.refresh_s = refresh_s
        self.beat_s = max(1.0, heartbeat_s / 3)
        self._in_flight = in_flight
        self._last_beat = self._last_reap = self._last_refresh = time.monotonic()

    def mine(self) -> set[str]:
        """Identities in flight here."""
        return {identity for _, identity in self._in_flight()}

    # ---- claims -------------------------------------------------------------------------

    def claim(self, identity: str, trial_id: int) -> bool:
        """Claim the point for this worker's trial; False if another worker holds it. The
        point is taken either way."""
        won = self.store.claim(arch=self.arch, workload_key=self.key, identity=identity,
                               run_id=self.run_id, trial_id=trial_id, owner=self.owner)
        self.taken.add(identity)
        return won

    def measured_here(self, identity: str) -> None:
        self.measured.add(identity)
        self.taken.add(identity)

    def fresh_left(self, domain: Domain) -> bool:
        """Whether some admitted point is neither taken nor on its way here."""
        mine = self.mine()
        return any(i not in self.taken and i not in mine for i, _ in domain.items())

    def others_hold_claims(self) -> bool:
        """Whether other workers hold points not measured yet: they will be measured soon,
        or released if their worker died, so this one should wait rather than stop."""
        return bool(self.taken - self.measured - self.mine())

    def release_quietly(self, identities: list[str]) -> None:
        """Give back this worker's claims on points it will not measure (best effort)."""
        try:
            self.store.release_claims(arch=self.arch, workload_key=self.key,
                                      identities=identities)
        except Exception:  # noqa: BLE001 (the heartbeat releases them later)
            pass

    # ---- liveness and the others --------------------------------------------------------

    def heartbeat(self) -> None:
        """Record a heartbeat for this worker's trials, at most once per ``beat_s``."""
        if time.monotonic() - self._last_beat < self.beat_s:
            return
        self._last_beat = time.monotonic()
        self.study.heartbeat(trial for trial, _ in self._in_flight())

    def refresh(self) -> None:
        """Read back what every worker has measured or claimed (for the sampler)."""
        self._last_refresh = time.monotonic()
        self.measured = self.store.measured_identities(arch=self.arch, workload_key=self.key)
        taken = self.store.taken_identities(arch=self.arch, workload_key=self.key)
        self.taken.clear()
        self.taken.update(taken)

    def reap_due(self) -> bool:
        return time.monotonic() - self._last_reap >= self.heartbeat_s

    def refresh_due(self) -> bool:
        return time.monotonic() - self._last_refresh >= self.refresh_s

    def reap(self) -> int:
        """Fail the study's trials whose worker stopped heartbeating (killed, or its host
        lost), and release the claims of every finished trial that measured nothing, so
        their points can be taken again. Returns the claims released."""
        self._last_reap = time.monotonic()
        self.study.fail_stale()
        mine = self.mine()
        dead = []
        for identity, trial_id in self.store.open_claims(arch=self.arch,
                                                         workload_key=self.key).items():
            if identity in mine:
                continue
            try:
                finished = trial_id is None or self.study.finished(trial_id)
            except KeyError:  # the study was deleted
                finished = True
            if finished:
                dead.append(identity)
        if not dead:
            return 0
        return self.store.release_claims(arch=self.arch, workload_key=self.key,
                                         identities=dead)
