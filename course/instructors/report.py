"""The class report: what the whole class got wrong, at a glance. ``python -m course.instructors.report grading/ --top 5``.

`make autograde` (course/instructors/autograde.py) writes it beside the grades, from every student's checks:
- report.html, one page that opens from disk (charts are inline SVG; no script, no file, no
  server): per exercise a histogram of the scores and the share of students passing each check;
  the most frequent mistakes of the class; the submissions that crashed, hung or did not import,
  with the reason; how long each submission's checks took, and the slowest submissions;
- report.json, the same summary as data, and every check of every student, for your own analysis.

Failures are grouped by the mistake a check diagnosed, as facts (Check.mistake, made by
course.grading.plugin.mistake: a failure's kind, ranks, collective and place, or the `assert` of the check
that failed), never by the words of its message: two submissions with the same mistake fall in
one row however their numbers differ. On the command line, the top of it: the most frequent
mistakes with how many students made each.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import html
import json
import os
import statistics
import sys

from course.exercises import STUDENT_FILES
from course.kinds import KINDS, WORLD

# What a submission's failures mean for the submission as a whole, by mistake kind.
TROUBLE = {name: kind.trouble for name, kind in KINDS.items() if kind.trouble}
BINS = 10


# ---- the summary: data -----------------------------------------------------------------------


def records(results: dict) -> list:
    """Every check of every student ({student: [course.grading.plugin.Check]}), as plain dicts."""
    return [
        {"student": student} | dataclasses.asdict(check) | {"score": check.score}
        for student, checks in sorted(results.items())
        for check in checks
    ]


def _names_student_code(mistake: dict) -> bool:
    places = [mistake] + list(mistake.get("ranks", []))
    return any(place.get("file") in STUDENT_FILES for place in places)


def group_key(row: dict) -> dict:
    """The facts one row of the mistakes table stands for.

    The ranks' places without their rank numbers: a crash in mlp.py's __init__ is one mistake
    whichever rank crashed first, and a deadlock one whatever the world's size. A mistake found
    at a place of the student's code (or a file that does not import) is one mistake whichever
    exercise met it; any other is one per exercise (an `assert` of checks/helpers.py judges several).
    """
    mistake = row.get("mistake") or {"kind": "unknown"}
    if "ranks" in mistake:
        places = {json.dumps({k: v for k, v in r.items() if k != "rank"}, sort_keys=True) for r in mistake["ranks"]}
        mistake = mistake | {"ranks": [json.loads(place) for place in sorted(places)]}
    if mistake["kind"] == "unimportable" or _names_student_code(mistake) or "exercise" in mistake:
        return mistake
    return {"exercise": row["exercise"]} | mistake


def title(mistake: dict) -> str:
    """The mistake's facts in a few words (the example message says the rest)."""
    kind = mistake.get("kind", "unknown")
    if kind == "stub":
        return f"{mistake['func']} not written yet"
    if kind == "unimportable":
        return f"{mistake['file']} does not import ({mistake['error']})"
    if kind == "assert" and mistake.get("concept"):  # what the check diagnosed (course/grading/points.py)
        return mistake["concept"]
    if kind in ("assert", "exception"):
        what = "assertion failed" if kind == "assert" else f"{mistake.get('error', 'an exception')} raised"
        where = f" in {mistake['func']} ({mistake['file']}:{mistake['line']})" if mistake.get("file") else ""
        return what + where
    if kind == "check_died":
        return f"the check's process died (exit code {mistake.get('exit_code')})"
    if kind == "cell_error":
        return f"the cell raised {mistake.get('error')}"
    if kind in WORLD:
        places = [
            (f" {fact['error']}" if kind == "error" and fact.get("error") else "")
            + (f" in {fact['collective']}" if fact.get("collective") else "")
            + (f" at {fact['file']}, {fact['func']}" if fact.get("file") else "")
            + (f", past the world's {fact['limit']} limit" if fact.get("limit") else "")
            for fact in mistake.get("ranks", [])
        ]
        label = KINDS[kind].label
        if not KINDS[kind].story:
            return f"a rank {label}{places[0] if places else ''}"
        return f"{label}:{';'.join(places)}" if any(places) else label
    return KINDS[kind].label if kind in KINDS else kind


def check_label(row: dict) -> str:
    """A check's name with its exercise: the notebooks' names say it (ex4_steps), make grade's do not."""
    prefix = f"ex{row['exercise']}"
    return row["name"] if row["name"].startswith(prefix + "_") else f"{prefix} {row['name']}"


def _histogram(scores: list, top: float) -> list:
    """BINS equal bins from 0 to top (the last one holds full marks); count of scores in each."""
    width = top / BINS if top else 1.0
    counts = [0] * BINS
    for score in scores:
        counts[min(int(score / width), BINS - 1)] += 1
    return [{"from": round(i * width, 2), "to": round((i + 1) * width, 2), "students": n} for i, n in enumerate(counts)]


def summarize(rows: list) -> dict:
    """The class report as data, from records()."""
    students = sorted({r["student"] for r in rows})
    exercises = []
    for exercise in sorted({r["exercise"] for r in rows}):
        mine = [r for r in rows if r["exercise"] == exercise]
        scores = {s: round(sum(r["score"] for r in mine if r["student"] == s), 2) for s in students}
        top = max(sum(r["max_score"] for r in mine if r["student"] == s) for s in students)
        checks = []
        for name in dict.fromkeys(r["name"] for r in mine):
            of = [r for r in mine if r["name"] == name]
            passed = sum(r["passed"] for r in of)
            checks.append({"name": name, "passed": passed, "students": len(of), "share": round(passed / len(of), 3)})
        exercises.append(
            {
                "exercise": exercise,
                "max_score": round(top, 2),
                "median": statistics.median(scores.values()),
                "scores": scores,
                "histogram": _histogram(list(scores.values()), top),
                "checks": checks,
            }
        )

    groups: dict = {}
    unwritten: dict = {}  # a stub's function -> who left it: not attempted, no mistake
    for row in rows:
        if row["passed"]:
            continue
        if (row.get("mistake") or {}).get("kind") == "stub":
            entry = unwritten.setdefault(row["mistake"]["func"], {"exercise": row["exercise"], "students": set()})
            entry["students"].add(row["student"])
            continue
        key = group_key(row)
        group = groups.setdefault(
            json.dumps(key, sort_keys=True),
            {
                "mistake": key,
                "title": title(key),
                "students": [],
                "exercises": set(),
                "checks": [],
                "example": row["message"],
                "said": [],
            },
        )
        group["students"] = sorted(set(group["students"]) | {row["student"]})
        group["exercises"].add(row["exercise"])
        check = check_label(row)
        if check not in group["checks"]:
            group["checks"].append(check)
        if row["message"] not in group["said"]:
            group["said"].append(row["message"])
    mistakes = [
        {
            "count": len(g["students"]),
            "title": g["title"],
            "mistake": g["mistake"],
            "exercises": sorted(g["exercises"]),
            "checks": g["checks"],
            "students": g["students"],
            "example": g["example"],
            "wordings": len(g["said"]),  # a group of several wordings: the check's sentences tell more apart
        }
        for g in groups.values()
    ]
    mistakes.sort(key=lambda m: (-m["count"], -len(m["checks"]), m["title"]))
    not_attempted = sorted(
        (
            {
                "function": func,
                "exercise": e["exercise"],
                "count": len(e["students"]),
                "students": sorted(e["students"]),
            }
            for func, e in unwritten.items()
        ),
        key=lambda n: (n["exercise"], -n["count"], n["function"]),
    )

    trouble: dict = {}
    for row in rows:
        what = TROUBLE.get((row.get("mistake") or {}).get("kind")) if not row["passed"] else None
        if what:
            entry = trouble.setdefault(
                (row["student"], what),
                {"student": row["student"], "what": what, "reason": row["message"], "exercises": [], "checks": 0},
            )
            entry["checks"] += 1
            if row["exercise"] not in entry["exercises"]:
                entry["exercises"].append(row["exercise"])
    troubled = sorted(trouble.values(), key=lambda t: (t["student"], t["what"]))

    timing = []
    for student in students:
        seconds = [r["seconds"] for r in rows if r["student"] == student and r.get("seconds") is not None]
        if seconds:
            slowest = max(
                (r for r in rows if r["student"] == student and r.get("seconds") is not None),
                key=lambda r: r["seconds"],
            )
            timing.append(
                {
                    "student": student,
                    "median_s": round(statistics.median(seconds), 3),
                    "total_s": round(sum(seconds), 3),
                    "checks": len(seconds),
                    "slowest_check": check_label(slowest),
                    "slowest_s": slowest["seconds"],
                }
            )
    timing.sort(key=lambda t: -t["total_s"])
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "students": students,
        "exercises": exercises,
        "mistakes": mistakes,
        "not_attempted": not_attempted,
        "troubled": troubled,
        "timing": {
            "median_check_s": round(statistics.median(r["seconds"] for r in rows if r.get("seconds") is not None), 3)
            if any(r.get("seconds") is not None for r in rows)
            else None,
            "by_student": timing,
        },
    }


# ---- the page ---------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; padding: 0 1em; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 0.85em; white-space: pre-wrap; }
.exercise { display: flex; flex-wrap: wrap; gap: 2em; align-items: flex-start; }
svg text { font-size: 11px; fill: #333; }
"""
# The page may load nothing at all: a browser refuses any reference outside it, and says so.
_POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_BAR = "#4c72b0"
_PASS = "#55a868"
_FAIL = "#dd8452"


def _e(value) -> str:
    return html.escape(str(value))


def histogram_svg(exercise: dict) -> str:
    """Inline SVG: how many students scored in each tenth of the exercise's points."""
    bins = exercise["histogram"]
    w, h, left, bottom = 360, 170, 30, 30
    most = max(b["students"] for b in bins) or 1
    step = (w - left - 10) / len(bins)
    parts = [
        f'<svg class="histogram" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img"'
        f' aria-label="Scores of exercise {exercise["exercise"]}">',
        f'<text x="{left}" y="12">students per score, exercise {exercise["exercise"]}'
        f" (median {exercise['median']:g}/{exercise['max_score']:g})</text>",
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - 10}" y2="{h - bottom}" stroke="#888"/>',
    ]
    for i, b in enumerate(bins):
        height = (h - bottom - 25) * b["students"] / most
        x, y = left + i * step, h - bottom - height
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{step - 2:.1f}" height="{height:.1f}" fill="{_BAR}">'
            f"<title>{b['from']:g} to {b['to']:g} points: {b['students']} students</title></rect>"
        )
        if b["students"]:
            parts.append(f'<text x="{x + step / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle">{b["students"]}</text>')
        if i % 2 == 0:  # every other bound: a tenth of 25 points does not fit below its bar
            parts.append(f'<text x="{x:.1f}" y="{h - bottom + 13}" text-anchor="middle">{b["from"]:g}</text>')
    parts.append(f'<text x="{w - 10}" y="{h - bottom + 13}" text-anchor="end">{bins[-1]["to"]:g}</text>')
    parts.append(f'<text x="{(w + left) / 2}" y="{h - 3}" text-anchor="middle">points</text>')
    return "\n".join(parts + ["</svg>"])


def checks_svg(exercise: dict) -> str:
    """Inline SVG: one bar per check, the share of students who passed it."""
    checks = exercise["checks"]
    w, row, left = 420, 20, 170
    h = 22 + row * len(checks)
    parts = [
        f'<svg class="checks" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img"'
        f' aria-label="Share of students passing each check of exercise {exercise["exercise"]}">',
        '<text x="0" y="12">share of students passing each check</text>',
    ]
    for i, c in enumerate(checks):
        y = 20 + i * row
        length = (w - left - 60) * c["share"]
        parts += [
            f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{_e(c["name"])}</text>',
            f'<rect x="{left}" y="{y + 2}" width="{w - left - 60}" height="{row - 5}" fill="{_FAIL}" opacity="0.35"/>',
            f'<rect x="{left}" y="{y + 2}" width="{length:.1f}" height="{row - 5}" fill="{_PASS}">'
            f"<title>{_e(c['name'])}: {c['passed']} of {c['students']} passed</title></rect>",
            f'<text x="{w - 55}" y="{y + 13}">{c["passed"]}/{c["students"]}</text>',
        ]
    return "\n".join(parts + ["</svg>"])


def _table(head: list, rows: list) -> str:
    if not rows:
        return "<p>None.</p>"
    header = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "\n".join("<tr>" + "".join(rows_cell for rows_cell in r) + "</tr>" for r in rows)
    return f"<table>\n<tr>{header}</tr>\n{body}\n</table>"


def _td(value, numeric=False, code=False) -> str:
    text = f"<code>{_e(value)}</code>" if code else _e(value)
    return f'<td class="n">{text}</td>' if numeric else f"<td>{text}</td>"


def _some(names: list, shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def page(summary: dict) -> str:
    """The report as one HTML page that needs nothing beside it."""
    n = len(summary["students"])
    mistakes = [
        [
            _td(m["count"], numeric=True),
            _td(m["title"]),
            _td(", ".join(str(x) for x in m["exercises"])),
            _td(_some(m["checks"])),
            _td(m["example"] + (f"  ({m['wordings']} different messages)" if m["wordings"] > 1 else ""), code=True),
            _td(", ".join(m["students"])),
        ]
        for m in summary["mistakes"]
    ]
    troubled = [
        [_td(t["student"]), _td(t["what"]), _td(", ".join(map(str, t["exercises"]))), _td(t["reason"], code=True)]
        for t in summary["troubled"]
    ]
    unwritten = [
        [
            _td(u["exercise"], numeric=True),
            _td(u["function"]),
            _td(u["count"], numeric=True),
            _td(_some(u["students"], 8)),
        ]
        for u in summary["not_attempted"]
    ]
    timing = summary["timing"]
    times = [
        [
            _td(t["student"]),
            _td(f"{t['median_s']:.2f}", numeric=True),
            _td(f"{t['total_s']:.1f}", numeric=True),
            _td(f"{t['slowest_check']} ({t['slowest_s']:.1f} s)"),
        ]
        for t in timing["by_student"]
    ]
    sections = "\n".join(
        f'<section id="ex{ex["exercise"]}"><h3>Exercise {ex["exercise"]}</h3>\n<div class="exercise">\n'
        f"{histogram_svg(ex)}\n{checks_svg(ex)}\n</div></section>"
        for ex in summary["exercises"]
    )
    median = "" if timing["median_check_s"] is None else f" The median check took {timing['median_check_s']:.2f} s."
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_POLICY}">
<title>Class report: {n} submissions</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>Class report</h1>
<p>{n} submissions, graded {_e(summary["generated"])}. Everything here is also in report.json.</p>
{f"<p><strong>These grades are advisory</strong>: {_e(summary['advisory'])}.</p>" if summary.get("advisory") else ""}

<h2 id="mistakes">Most frequent mistakes</h2>
<p>Failed checks grouped by the mistake each diagnosed (its kind, ranks, collective and place, or the
check's own assertion), not by the words of its message. Count: students.</p>
{_table(["students", "mistake", "exercises", "checks", "one message", "who"], mistakes)}

<h2 id="not-attempted">Not attempted yet</h2>
<p>Functions still as the course gave them (their checks stop at "not written yet"): no mistake, no row above.</p>
{_table(["exercise", "function", "students", "who"], unwritten)}

<h2 id="troubled">Submissions that crashed, hung or did not import</h2>
{_table(["student", "what", "exercises", "reason"], troubled)}

<h2 id="exercises">Scores and checks, per exercise</h2>
{sections}

<h2 id="timing">Time</h2>
<p>How long each submission's checks ran (each notebook cell), slowest submissions first.{median}</p>
{_table(["student", "median check (s)", "all checks (s)", "slowest check"], times)}
</body>
</html>
"""


def write(out: str, results: dict, advisory: str = "") -> dict:
    """Write report.html and report.json into out from {student: [Check]}; return the summary.
    ``advisory``: why these grades cannot be trusted for credit (course/runtime/sandbox.py), said first."""
    rows = records(results)
    summary = summarize(rows) | {"advisory": advisory}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(summary | {"checks": rows}, f, indent=1)
    with open(os.path.join(out, "report.html"), "w") as f:
        f.write(page(summary))
    return summary


def top(summary: dict, n: int = 5) -> str:
    """The n most frequent mistakes, with how many students made each, one per line."""
    lines = [f"The {n} most frequent mistakes of {len(summary['students'])} submissions (students, mistake):"]
    for m in summary["mistakes"][:n]:
        exercises = ", ".join(str(x) for x in m["exercises"])
        lines.append(f"{m['count']:>4}  exercise {exercises}: {m['title']}")
        lines.append(f"      e.g. {m['example']}")
    if not summary["mistakes"]:
        lines.append("   none: every check passed")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="grading", help="the folder make autograde wrote (default: grading)")
    parser.add_argument("--top", type=int, default=5, help="how many mistakes to print (default: 5)")
    args = parser.parse_args(argv)
    path = os.path.join(args.out, "report.json")
    if not os.path.isfile(path):
        print(f"no {path}: run make autograde first (it writes the report)", file=sys.stderr)
        return 1
    with open(path) as f:
        print(top(json.load(f), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
