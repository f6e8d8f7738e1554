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
from collections import Counter
from dataclasses import dataclass, field

import sqlalchemy as sa

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
    import optuna

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
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE
                and t.value is not None and FAMILY in t.params]
    evaluator, name = _evaluator()
    per_family = Counter(str(t.params[FAMILY]) for t in complete)
    notes: list[str] = []
    if len(complete) < MIN_TRIALS:
        notes.append(f"too small for importances: {len(complete)} completed trials "
                     f"(at least {MIN_TRIALS} needed)")
        return StudyImportance(study, len(complete), len(trials), None, (), tuple(notes))
    if len(per_family) == 1:
        notes.append(f"one family ({next(iter(per_family))}): the importances are of its "
                     "parameters; the choice of family is not compared")
    else:
        notes.append(f"{len(per_family)} families, compared by their best times (below), not "
                     "by importance: each family's parameters exist only in its own trials")
    families = tuple(_family(optuna, evaluator, f, [t for t in complete
                                                    if t.params[FAMILY] == f])
                     for f, _ in per_family.most_common())
    return StudyImportance(study, len(complete), len(trials), name, families, tuple(notes))


def _family(optuna, evaluator, family: str, trials: list) -> FamilyImportance:  # type: ignore[no-untyped-def]
    """Importances of ``family``'s parameters over its completed trials."""
    best = min(t.value for t in trials)
    if len(trials) < MIN_TRIALS:
        return FamilyImportance(family, len(trials), best, note=f"too few trials ({len(trials)}; "
                                f"at least {MIN_TRIALS} needed)")
    prefix = f"{family}."
    study = optuna.create_study(direction="minimize")
    study.add_trials([optuna.trial.create_trial(
        params={k[len(prefix):]: v for k, v in t.params.items() if k.startswith(prefix)},
        distributions={k[len(prefix):]: d for k, d in t.distributions.items()
                       if k.startswith(prefix)},
        value=t.value) for t in trials])
    varied = [n for n in study.trials[0].params
              if len({repr(t.params.get(n)) for t in study.trials}) > 1]
    if not varied:
        return FamilyImportance(family, len(trials), best,
                                note="every trial has the same parameters")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study, evaluator=evaluator,
                                                            params=varied)
    except (ValueError, RuntimeError) as e:
        return FamilyImportance(family, len(trials), best, note=f"Optuna could not tell: {e}")
    return FamilyImportance(family, len(trials), best, {k: float(v) for k, v in found.items()})


def _evaluator():  # type: ignore[no-untyped-def]
    """fANOVA (seeded) where scikit-learn imports, else PED-ANOVA; with its name."""
    import optuna

    try:
        import sklearn  # noqa: F401
    except ImportError:
        return optuna.importance.PedAnovaImportanceEvaluator(), "PED-ANOVA"
    return optuna.importance.FanovaImportanceEvaluator(seed=0), "fANOVA"
