"""The search's adapter to Optuna: the study on the store's database, and its trials.

The loop sees Optuna only through ``SearchStudy``. A trial is created holding its point (in
one transaction when our samplers propose it, through ``ask`` and ``suggest`` when Optuna's
do), heartbeats while the point compiles and runs, and ends COMPLETE with its time or FAIL
with a reason (the ``reason`` user attribute). Failing the stale trials of killed workers
goes through here too.

This is the one module of evoengine that uses Optuna's private API; ``tests/test_imports.py``
checks that no other does, and ``tests/test_search.py`` pins each name below against the
installed Optuna, so a release that renames one fails there rather than in a search. Each
is read in exactly one place:

- ``Study._storage``, the storage behind the study (Optuna wraps ours in a cache that the
  samplers read, so writes must go through this one): to create a trial with all of its
  parameters in one transaction, as ``Study.add_trial`` does, where ``ask`` and one
  ``suggest`` per parameter write a dozen; to record heartbeats, which Optuna records only
  inside ``Study.optimize``; to write a trial's end state without ``Study.tell`` reading the
  trial back first (our samplers learn nothing in ``after_trial``);
- ``Study._study_id``, the id ``create_new_trial`` takes;
- ``Trial._trial_id``, a trial's id in the storage: heartbeats, and the store's claims and
  measurements name their trial by it.

Contract. ``SearchStudy`` writes only trials it created (and, through ``fail_stale``, the
stale trials of any worker, as Optuna's ``fail_stale_trials`` does, and through
``holds_unclaimed`` those of a worker killed before their first heartbeat) and the study's two
ownership attributes; it never enqueues a trial, so no waiting trial is skipped, and never
changes a finished trial. ``open_storage`` raises Optuna's ``StorageInternalError`` or a
SQLAlchemy error when the database cannot be opened in five attempts. ``complete``, ``fail``
and ``tell_known`` raise what Optuna raises for a trial that is already finished
(``RuntimeError``, ``ValueError``), except that ``complete`` and ``fail`` return quietly
when another worker failed the trial as stale meanwhile: the store then holds what this
worker measured, and the trial stays failed. ``finished`` raises ``KeyError`` for a trial
whose study was deleted.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
import warnings
from collections.abc import Container, Iterable, Iterator
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState
from sqlalchemy import exc as sa_exc

from evoengine.search.domain import Domain, Point
from evoengine.search.samplers import IDENTITY_ATTR, REASON_ATTR, proposes_only_fresh


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's INFO logs off; its warnings that a search expects, silenced."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        # Heartbeats (so a killed run's trials are failed, not RUNNING forever) are marked
        # experimental, and meant for Study.optimize; the loop records them itself.
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        yield


def open_storage(url: str, *, heartbeat_s: int, grace_s: int) -> optuna.storages.RDBStorage:
    """Optuna's storage on the store's database, heartbeats on. Optuna creates its tables on
    first use without a lock, so workers starting together on a fresh database can collide
    (a duplicate ``alembic_version`` row): the losers try again, and then find the tables."""
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=heartbeat_s, grace_period=grace_s,
                engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite")
                else {})
        except (optuna.exceptions.StorageInternalError, sa_exc.SQLAlchemyError):
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


class SearchStudy:
    """One Optuna study (minimising µs) as the loop uses it, over ``domain``'s points."""

    def __init__(self, study: optuna.Study, domain: Domain) -> None:
        self.study = study
        self.domain = domain
        self.sampler = study.sampler
        # Our samplers avoid rejected and taken points themselves, and propose before the
        # trial exists (``next_point``); Optuna's go through ``ask``.
        self.fresh_only = proposes_only_fresh(study.sampler)
        self._storage = study._storage  # private: see the module docstring
        self._study_id = study._study_id  # private: see the module docstring
        self._distributions = domain.distributions()

    @classmethod
    def open(cls, storage: optuna.storages.BaseStorage, name: str,
             sampler: optuna.samplers.BaseSampler, domain: Domain) -> SearchStudy:
        """The study ``name`` in ``storage``, created if new."""
        return cls(optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                       direction="minimize", load_if_exists=True), domain)

    @property
    def name(self) -> str:
        return self.study.study_name

    def tie(self, arch: str, workload_key: str) -> tuple[str | None, str | None] | None:
        """Tie the study to (arch, workload) if nothing tied it yet. Returns the (arch,
        workload) it is tied to when that is another, for the caller to refuse; else None."""
        attrs = self.study.user_attrs
        if "workload" not in attrs:
            self.study.set_user_attr("arch", arch)
            self.study.set_user_attr("workload", workload_key)
            return None
        if attrs.get("workload") != workload_key or attrs.get("arch") != arch:
            return attrs.get("arch"), attrs.get("workload")
        return None

    # ---- creating trials ----------------------------------------------------------------

    def next_point(self) -> Point | None:
        """Our sampler's next point (None: none is fresh); only where ``fresh_only``."""
        return self.sampler.next_point(self.study)

    def create(self, family: str, params: dict[str, Any], identity: str | None) -> Trial:
        """A new RUNNING trial, heartbeating, holding ``(family, params)`` and, for an
        admitted point, its ``identity``: all written in one transaction."""
        named = self.domain.to_trial_params(family, params)
        template = FrozenTrial(
            number=-1, state=TrialState.RUNNING, value=None,
            datetime_start=datetime.datetime.now(), datetime_complete=None, params=named,
            distributions={n: self._distributions[n] for n in named},
            user_attrs={} if identity is None else {IDENTITY_ATTR: identity},
            system_attrs={}, intermediate_values={}, trial_id=-1)
        trial_id = self._storage.create_new_trial(self._study_id, template_trial=template)
        self._storage.record_heartbeat(trial_id)
        return Trial(self.study, trial_id)

    def ask(self) -> tuple[Trial, Point]:
        """A new RUNNING trial from Optuna's sampler, heartbeating, and the point it
        suggested (not yet checked against the constraints)."""
        trial = self.study.ask()
        # At once, so a trial of a worker killed from here on is failed as stale later.
        self._storage.record_heartbeat(self.trial_id(trial))
        return trial, self.domain.suggest(trial)

    def set_identity(self, trial: Trial, identity: str) -> None:
        trial.set_user_attr(IDENTITY_ATTR, identity)

    @staticmethod
    def trial_id(trial: Trial) -> int:
        """The trial's id in the storage (what claims and measurements name)."""
        return trial._trial_id  # private: see the module docstring

    # ---- liveness -----------------------------------------------------------------------

    def heartbeat(self, trials: Iterable[Trial]) -> None:
        for trial in trials:
            self._storage.record_heartbeat(self.trial_id(trial))

    def fail_stale(self) -> None:
        """Fail the study's RUNNING trials silent for longer than the grace period."""
        optuna.storages.fail_stale_trials(self.study)

    def holds_unclaimed(self, claimed: Container[str], grace_s: float) -> bool:
        """Whether a RUNNING trial of another worker holds a point not in ``claimed`` (the
        points taken, and this worker's own): its worker claims it in a moment. One older
        than ``grace_s`` never will: its worker died between creating it and recording its
        first heartbeat, and Optuna's stale check passes over a trial with no heartbeat. It
        is failed here (as stale: no reason), so its point is fresh again, and this says True
        too: there is a point to propose or to wait for, not none."""
        grace = datetime.timedelta(seconds=grace_s)
        now = datetime.datetime.now()  # datetime_start: the creating worker's clock
        held = False
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            identity = t.user_attrs.get(IDENTITY_ATTR)
            if identity is None or identity in claimed:
                continue
            if t.datetime_start is None or now - t.datetime_start <= grace:
                held = True
                continue
            trial_id = self._storage.get_trial_id_from_study_id_trial_number(self._study_id,
                                                                           t.number)
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self._storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
            held = True  # freed: the next proposal may take it
        return held

    def finished(self, trial_id: int) -> bool:
        """Whether the trial has ended (``KeyError`` if its study was deleted)."""
        return self._storage.get_trial(trial_id).state.is_finished()

    # ---- ending trials ------------------------------------------------------------------

    def complete(self, trial: Trial, value: float) -> None:
        """End the trial with its measured time (see the module docstring on raising)."""
        try:
            self._finish(trial, value)
        except (RuntimeError, ValueError):
            if not self.finished(self.trial_id(trial)):
                raise

    def fail(self, trial: Trial, reason: str) -> None:
        """Fail the trial, saying why (see the module docstring on raising)."""
        try:
            trial.set_user_attr(REASON_ATTR, reason[:1000])
            self._finish(trial, None)
        except (RuntimeError, ValueError):
            if not self.finished(self.trial_id(trial)):
                raise

    def tell_known(self, trial: Trial, value: float) -> None:
        """End a trial whose point the store has already measured, with that time, through
        ``Study.tell`` (so the sampler sees it as any result)."""
        self.study.tell(trial, value)

    def _finish(self, trial: Trial, value: float | None) -> None:
        """Complete the trial with ``value``, or fail it (None). ``Study.tell`` reads the
        trial back first, for the sampler's ``after_trial``; ours learn nothing there, so
        for them the state is written at once (a finished trial raises, as with ``tell``)."""
        if not self.fresh_only or (value is not None and not math.isfinite(value)):
            if value is None:
                self.study.tell(trial, state=TrialState.FAIL)
            else:
                self.study.tell(trial, value)
            return
        state = TrialState.FAIL if value is None else TrialState.COMPLETE
        if not self._storage.set_trial_state_values(
                self.trial_id(trial), state, None if value is None else [value]):
            raise RuntimeError(f"trial {trial.number} could not be set {state.name}")
