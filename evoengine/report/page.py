"""The report as one self-contained HTML page: inline CSS and SVG, no script, no link out.

``render`` turns what ``gather`` read (and the importances) into the page's text; every
value from the store is escaped. Sections, per workload: the progression plot, ours next to
the anchors, the elites, the parameter importances; then the runs the numbers came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from html import escape
from pathlib import Path

from evoengine._version import __version__
from evoengine.report import plots
from evoengine.report.gather import ANCHOR_NAMES, Gathered, WorkloadReport
from evoengine.report.importance import StudyImportance
from evoengine.store import RunRecord

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
h3 { margin-bottom: 0.3em; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, td.id { font-family: ui-monospace, monospace; font-size: 11px; word-break: break-all; }
.note { color: #7a4b00; } .meta { color: #555; }
.bar { display: inline-block; height: 0.8em; background: #1f6fb4; }
figure { margin: 0.5em 0; } svg { max-width: 100%; height: auto; }
"""


def render(g: Gathered, importances: Mapping[str, StudyImportance], selection: str) -> str:
    """The page's HTML."""
    when = datetime.now(UTC).isoformat(timespec="seconds")
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        "<title>evoengine report</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        "<h1>evoengine report</h1>",
        f'<p class="meta">Store <code>{escape(g.store)}</code>, selection '
        f"<code>{escape(selection)}</code>: {len(g.runs)} runs, {len(g.workloads)} "
        f"workloads. Written {escape(when)} by evoengine {escape(__version__)}.</p>",
        '<nav><ul>',
        *(f'<li><a href="#{escape(w.anchor)}">{escape(w.key)} on {escape(w.arch)}</a></li>'
          for w in g.workloads),
        '<li><a href="#runs">Runs</a></li>', "</ul></nav>",
    ]
    for w in g.workloads:
        parts += _workload(w, importances)
    parts += _runs(g)
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def _workload(w: WorkloadReport, importances: Mapping[str, StudyImportance]) -> list[str]:
    out = [f'<section class="workload" id="{escape(w.anchor)}">',
           f"<h2>{escape(w.key)} on {escape(w.arch)}</h2>",
           f'<p class="meta">Problem kind <code>{escape(w.kind)}</code>; studies: '
           + ", ".join(f"<code>{escape(s)}</code>" for s in w.studies)
           + f"; runs {', '.join(str(r.id) for r in w.runs)}.</p>"]
    if any(p.best_us for p in w.progressions):
        out += ['<section class="progress">', "<h3>Best time against evaluations</h3>",
                "<p>Per study, the fastest valid search-phase time after each evaluation "
                "(failed evaluations count); dotted: the anchors of the final re-time below.</p>",
                f"<figure>{plots.progression(w)}</figure>", "</section>"]
    else:  # re-timed only: a tune's cross re-time times its rungs' candidates off the ladder
        out += ['<section class="progress">', "<h3>Best time against evaluations</h3>",
                '<p class="note">No search evaluated points on this workload: its times are '
                "re-times only (a tune's cross re-time times the candidates for a neighbouring "
                "rung's entry here).</p>", "</section>"]
    out += _anchors(w)
    out += _elites(w)
    out += ['<section class="importance">', "<h3>Parameter importances</h3>"]
    for study in w.studies:
        out += _importance(importances.get(study) or StudyImportance(
            study, notes=("runs without a study name have no Optuna study",)))
    out += ["</section>", "</section>"]
    return out


def _anchors(w: WorkloadReport) -> list[str]:
    out = ['<section class="anchors">', "<h3>Ours next to the anchors</h3>"]
    f = w.final
    if f is None:
        return out + ['<p class="note">No final re-time in the selected runs (a run that '
                      "stopped early, or found no valid point, re-times nothing), so no "
                      "anchor was timed next to ours.</p>", "</section>"]
    rows = [("ours", f.ours_us)] + [(ANCHOR_NAMES.get(a, a), us)
                                    for a, us in f.anchors_us.items()]
    missing = [name for name, us in rows if not us]
    replay = (f.run.versions or {}).get("replay")
    out += [f"<p>The final re-time of run {f.run.id} (study <code>{escape(f.run.study or '-')}"
            f"</code>, {escape(f.run.device or 'unknown device')}, "
            f"{escape(_date(f.run.created_at))}"
            + (f", {f.rounds} rounds" if f.rounds else "")
            + "): its fastest point and each anchor timed interleaved in the same process. "
            + (f"Replayed from <code>{escape(Path(str(replay)).name)}</code>: the times are "
               "the record's." if replay else "")
            + (f" Not timed: {escape(', '.join(missing))}." if missing else "") + "</p>",
            f"<figure>{plots.anchors(w)}</figure>", "</section>"]
    return out


def _elites(w: WorkloadReport) -> list[str]:
    out = ['<section class="elites">', "<h3>Elites</h3>"]
    if not w.elites:
        return out + ['<p class="note">The store holds no elites for this workload.</p>',
                      "</section>"]
    studies = {r.id: r.study for r in w.runs}
    rate = w.rate()
    unit = "TFLOPS" if rate is None else rate.unit
    out += ["<p>The store's ranking for this workload and target (every study's runs); "
            "rank 1 is what <code>evoengine export best</code> ships.</p>",
            '<table class="elites">',
            f"<tr><th>rank</th><th>µs</th><th>{escape(unit)}</th><th>family</th>"
            "<th>parameters</th><th>run</th><th>identity</th></tr>"]
    for e in w.elites:
        tflops = None if rate is None else rate(e.median_us)
        run = "-" if e.run_id is None else f"{e.run_id}" + (
            f" ({studies[e.run_id]})" if studies.get(e.run_id) else "")
        out.append(
            f'<tr data-identity="{escape(e.identity)}"><td class="num">{e.rank}</td>'
            f'<td class="num">{e.median_us:.1f}</td>'
            f'<td class="num">{"-" if tflops is None else f"{tflops:.1f}"}</td>'
            f"<td>{escape(e.family)}</td><td>{escape(_params(e.params))}</td>"
            f"<td>{escape(run)}</td><td class=\"id\">{escape(e.identity)}</td></tr>")
    return out + ["</table>", "</section>"]


def _importance(s: StudyImportance) -> list[str]:
    out = [f"<h4>Study <code>{escape(s.study)}</code></h4>"]
    if s.total:
        out.append(f"<p>{s.complete} of {s.total} trials completed"
                   + (f"; evaluator: {escape(s.evaluator)}" if s.evaluator else "") + ".</p>")
    out += [f'<p class="note">{escape(n)}</p>' for n in s.notes]
    for f in s.families:
        head = (f"<p>Family <code>{escape(f.family)}</code>, {f.trials} completed trials, "
                f"best {f.best_us:.1f} µs")
        if f.note:
            out.append(f'{head}: <span class="note">{escape(f.note)}</span></p>')
            continue
        out += [f"{head}:</p>", '<table class="importance">',
                "<tr><th>parameter</th><th>importance</th><th></th></tr>"]
        for name, value in f.importances.items():
            out.append(f'<tr><td>{escape(name)}</td><td class="num">{value:.3f}</td>'
                       f'<td><span class="bar" style="width: {120 * value:.0f}px"></span>'
                       "</td></tr>")
        out.append("</table>")
    return out


def _runs(g: Gathered) -> list[str]:
    head = ("id", "study", "arch", "workload", "status", "device", "driver", "torch",
            "evoengine", "commit", "started (UTC)", "finished (UTC)", "evaluated")
    out = ['<section id="runs">', "<h2>Runs</h2>",
           "<p>Where the numbers above came from: every selected run, oldest first.</p>",
           '<table class="runs">', "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in g.runs:
        v = r.versions or {}
        cells: Iterable[object] = (
            r.id, r.study or "-", r.arch, r.workload_key, r.status, _device(r),
            v.get("driver", "-"), v.get("torch", "-"), v.get("evoengine", "-"),
            r.commit or "-", _date(r.created_at), _date(r.finished_at),
            g.evaluations.get(r.id, 0))
        out.append(f'<tr data-run="{r.id}">' + "".join(
            f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    return out + ["</table>", "</section>"]


def _device(r: RunRecord) -> str:
    replay = (r.versions or {}).get("replay")
    device = r.device or "unknown device"
    return f"{device}, replay of {Path(str(replay)).name}" if replay else device


def _date(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _params(params: Mapping[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())

