"""Parameter importances of a search's Optuna study, per kernel family.

A study's trials name a ``family`` and that family's parameters as ``<family>.<PARAM>``
(``search.domain``), so Optuna's importances over a whole study see only what every trial
shares: the family. Each family's completed trials are therefore put in a study of their
own (in memory) and ``optuna.importance.get_param_importances`` is asked there, about
that family's parameters. fANOVA (Optuna's default evaluator, seeded) needs scikit-learn;
without it PED-ANOVA, which Optuna ships, is used and named.

Contract. Reads the study, never writes it; never creates Optuna's tables in a store that
has none. Never raises for a study it cannot judge: the answer says why instead (no
Optuna tables, no such study, too few trials, Optuna's own refusal).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import optuna
import sqlalchemy as sa
from optuna.importance import BaseImportanceEvaluator
from optuna.trial import FrozenTrial, TrialState

from evoengine.search.domain import FAMILY

# Fewer completed trials than this in a family (or a study) give importances that mean
# nothing: a random forest over a handful of points.
MIN_TRIALS = 8


@dataclass(frozen=True)
class FamilyImportance:
    """One family's parameters by importance (largest first), or why there are none."""

    family: str
    trials: int
    best_us: float
    importances: dict[str, float] = field(default_factory=dict)
    note: str | None = None


@dataclass(frozen=True)
class StudyImportance:
    """A study's importances per family, the evaluator that computed them, and notes on
    what the study cannot tell."""

    study: str
    complete: int = 0
    total: int = 0
    evaluator: str | None = None
    families: tuple[FamilyImportance, ...] = ()
    notes: tuple[str, ...] = ()


def has_optuna_tables(url: str) -> bool:
    """Whether the database holds Optuna's tables (opening Optuna's storage would create
    them otherwise)."""
    engine = sa.create_engine(url)
    try:
        return sa.inspect(engine).has_table("studies")
    finally:
        engine.dispose()


def study_importances(url: str, study: str) -> StudyImportance:
    """The importances of ``study`` in the Optuna storage at ``url`` (the store's URL)."""
    if not has_optuna_tables(url):
        return StudyImportance(study, notes=("the store holds no Optuna studies",))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        loaded = optuna.load_study(study_name=study, storage=url)
    except KeyError:
        return StudyImportance(study, notes=(f"no Optuna study named {study!r} in the store",))
    except (RuntimeError, ValueError, sa.exc.SQLAlchemyError) as e:  # e.g. an older schema
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return StudyImportance(study, notes=(f"Optuna could not open the study: {first}",))
    trials = loaded.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE
                and t.value is not None and FAMILY in t.params]
    if len(complete) < MIN_TRIALS:
        return StudyImportance(study, len(complete), len(trials), notes=(
            f"too small for importances: {len(complete)} completed trials (at least "
            f"{MIN_TRIALS} needed)",))
    by_family: dict[str, list[FrozenTrial]] = {}
    for t in sorted(complete, key=lambda t: t.value or 0.0):  # fastest family first
        by_family.setdefault(str(t.params[FAMILY]), []).append(t)
    if len(by_family) == 1:
        note = (f"one family ({next(iter(by_family))}): the importances are of its "
                "parameters; the choice of family is not compared")
    else:
        note = (f"{len(by_family)} families, compared by their best times (below), not by "
                "importance: each family's parameters exist only in its own trials")
    evaluator, name = _evaluator()
    families = tuple(_family(evaluator, f, ts) for f, ts in by_family.items())
    return StudyImportance(study, len(complete), len(trials), name, families, (note,))


def _family(evaluator: BaseImportanceEvaluator, family: str,
            trials: list[FrozenTrial]) -> FamilyImportance:
    """Importances of ``family``'s parameters over its completed trials."""
    best = min(float(t.value or 0.0) for t in trials)
    if len(trials) < MIN_TRIALS:
        return FamilyImportance(family, len(trials), best, note=f"too few trials "
                                f"({len(trials)}; at least {MIN_TRIALS} needed)")
    prefix = f"{family}."
    own = optuna.create_study(direction="minimize")
    own.add_trials([optuna.trial.create_trial(
        params={k[len(prefix):]: v for k, v in t.params.items() if k.startswith(prefix)},
        distributions={k[len(prefix):]: d for k, d in t.distributions.items()
                       if k.startswith(prefix)},
        value=t.value) for t in trials])
    varied = [n for n in own.trials[0].params
              if len({repr(t.params.get(n)) for t in own.trials}) > 1]
    if not varied:
        return FamilyImportance(family, len(trials), best,
                                note="every trial has the same parameters")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(own, evaluator=evaluator,
                                                            params=varied)
    except (ValueError, RuntimeError) as e:
        return FamilyImportance(family, len(trials), best, note=f"Optuna could not tell: {e}")
    return FamilyImportance(family, len(trials), best, {k: float(v) for k, v in found.items()})


def _evaluator() -> tuple[BaseImportanceEvaluator, str]:
    """fANOVA (seeded) where scikit-learn imports, else PED-ANOVA; with its name."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return optuna.importance.PedAnovaImportanceEvaluator(), "PED-ANOVA"
    return optuna.importance.FanovaImportanceEvaluator(seed=0), "fANOVA"
