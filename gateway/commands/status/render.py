"""The status report as text (a table for a terminal) or as JSON."""

import json
from dataclasses import asdict
from typing import Any, Dict, Optional

from gateway.commands.status.report import Chain, Report, Row, gateways_text
from gateway.times import duration, plain_utc


def _window(r: Row) -> str:
    if r.note and not r.scheduled:
        return r.note
    if r.due_max_ms is None:
        return r.note or f"in {duration(r.due_min_ms or 0)} or later"
    text = f"within {duration(r.due_max_ms)}"
    return f"{text} ({r.note})" if r.note else text


def text(r: Report) -> str:
    lines = [f"prefix {r.prefix!r} at {plain_utc(r.at_ms)}; lead {r.lead_ms} ms"]
    if r.missing:  # every row would say "missing": only what to do
        return "\n".join(lines + [f"problem: {p}" for p in r.problems]) + "\n"
    if r.chains:
        lines.append("chains:")
        width = max(len(c.key.describe()) for c in r.chains)
        for c in r.chains:
            state = [] if c.declared else ["not declared"]
            if c.yours:
                state.insert(0, "your settings")
            if c.declared:
                state.append(gateways_text(c.gateways))
            if c.empty_by_ms is not None:
                state.append(f"retiring, empty by {plain_utc(c.empty_by_ms)}")
            lines.append(f"  {c.key.describe():<{width}}  {', '.join(state)}")
    width = max(len(row.label) for row in r.rows)
    lines += ["", f"{'waiting':<{width}}  {'messages':>9}  falls due"]
    for row in r.rows:
        if not row.exists and row.role in ("delay", "pass", "meditation"):
            shown = "missing"
        elif row.messages is None:
            shown = "?" if row.exists else "missing"
        else:
            shown = ("≈" if row.carriers is not None else "") + str(row.messages)
        lines.append(f"{row.label:<{width}}  {shown:>9}  {_window(row)}")
    held = next(row for row in r.rows if row.role == "held")
    total = f"{r.total}" + ("" if held.messages is not None else " + held")
    lines.append(f"{'total':<{width}}  {total:>9}")
    counted = (r.waiting or {}).get("due_within")
    lines += ["", f"{'due within':<12} {'at least':>9} {'at most':>9}" + (f" {'messages':>9}" if counted else "")]
    for w in r.due_within:
        lines.append(f"{w.within:<12} {w.at_least:>9} {w.at_most:>9}" + (f" {counted[w.within]:>9}" if counted else ""))
    if r.waiting is not None:
        lines.append(_waiting_line(r.waiting))
    if r.cancellations is not None:
        rules = r.cancellations.get("rules")
        lines += ["", f"cancellations: {r.cancellations['held']} message id(s) cancelled within the retention "
                      f"window of {duration(r.cancellations['window_ms'])}"
                      + (f"; {rules} live rule(s), which `delay-gateway pending rules` lists" if rules else ""),
                  f"cancels: {_promise(r.cancellations)}"]
    if r.retries:
        lines += ["", "retries by queue (the gateways' counts since they started): waiting ≈ scheduled - delivered"]
        for queue, counts in sorted(r.retries.items()):
            lines.append(f"  {queue}: {counts['scheduled']} scheduled, {counts['delivered']} delivered back, "
                         f"{counts['gave_up']} gave up (parked)"
                         + (f", {counts['parked']} parked (the queue was gone, or the broker refused it)"
                            if counts.get("parked") else ""))
    for note in r.notes:
        lines.append(f"note: {note}")
    for problem in r.problems:
        lines.append(f"problem: {problem}")
    return "\n".join(lines) + "\n"


def _waiting_line(w: Dict[str, Any]) -> str:
    if w.get("total") is None:
        return f"messages: {w['why']}"
    how = "exact" if w["exact"] else f"not exact: {w['why']}"
    return (f"messages: {w['total']} waiting, counted one by one from the index of what waits ({how}; "
            "`delay-gateway pending` lists them)")


def _promise(c: Dict[str, Any]) -> str:
    if c.get("arrival_stamp"):
        return "exact with any number of gateways (the broker stamps arrival times)"
    consumers = c.get("check_in_consumers")
    now = "" if consumers is None else f"; {consumers} now"
    why = "it does not stamp arrival times" if c.get("arrival_stamp") is False else "whether it stamps is unknown"
    return f"exact while one gateway consumes check-in ({why}{now})"


def as_json(r: Report, indent: Optional[int] = 2) -> str:
    def chain(c: Chain) -> dict:
        d = asdict(c)
        d["key"] = asdict(c.key)
        d["key"]["generation"] = c.key.generation
        d["chain"] = d.pop("key")
        return d

    doc = {"prefix": r.prefix, "at_ms": r.at_ms, "lead_ms": r.lead_ms, "total": r.total,
           "chains": [chain(c) for c in r.chains], "queues": [asdict(row) for row in r.rows],
           "due_within": [asdict(w) for w in r.due_within], "held_source": r.held_source,
           "distributor_consumers": r.distributor_consumers, "problems": r.problems, "notes": r.notes,
           "cancellations": r.cancellations, "retries": r.retries, "waiting": r.waiting}
    return json.dumps(doc, indent=indent) + "\n"
