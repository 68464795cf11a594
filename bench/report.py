"""Write the results: one JSON file, markdown tables, and PNG charts (if matplotlib is there)."""

import json
import os
from typing import Dict, List, Optional

DELAYED = ("paced", "burst", "at-once", "steady", "trickle")


def write(out_dir: str, results: Dict[str, List[dict]], meta: dict) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    files = []
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    files.append(path)
    path = os.path.join(out_dir, "results.md")
    with open(path, "w") as f:
        f.write(markdown(results, meta))
    files.append(path)
    files += charts(out_dir, results)
    return files


def _g(r: dict, k: str, fmt: str = "{}") -> str:
    v = r.get(k)
    return "-" if v is None else fmt.format(v)


def _load(r: dict) -> str:
    la = r.get("resources", {}).get("load_average", {})
    return f"{la['mean']:.1f} ({la['max']:.1f})" if "mean" in la else "-"


def _span(values: List[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def delayed_table(runs: List[dict]) -> List[str]:
    head = ["round", "target", "messages", "published/s", "check-in drain/s", "p50 ms", "p90 ms", "p99 ms",
            "max ms", "early", "lost", "dup", "queue writes/msg", "WAL entries/msg", "Mnesia log writes/msg",
            "broker CPU µs/msg",
            "gateway CPU µs/msg (kernel share)", "gateway wake-ups/msg", "load avg mean (max)"]
    lines = [_row(head), "|" + "---|" * len(head)]
    for r in runs:
        lines.append(_row([
            r.get("round", 1), r["label"], r["messages"], _g(r, "publish_rate", "{:.0f}"),
            _g(r, "checkin_drain_rate", "{:.0f}"), _g(r, "p50_ms"), _g(r, "p90_ms"), _g(r, "p99_ms"), _g(r, "max_ms"),
            r["early"], r["lost"], r["duplicates"], _g(r, "queue_writes_per_message"),
            _g(r, "wal_writes_per_message"), _g(r, "mnesia_log_writes_per_message"),
            _g(r, "broker_cpu_us_per_message"), _gateway_cpu(r), _g(r, "gateway_wakeups_per_message"), _load(r)]))
    return lines


def _gateway_cpu(r: dict) -> str:
    cpu, share = r.get("gateway_cpu_us_per_message"), r.get("gateway_cpu_system_share")
    return "-" if cpu is None else f"{cpu:g}" + ("" if share is None else f" ({share:.0%})")


def side_by_side(runs: List[dict]) -> List[str]:
    """One row per target over all rounds: the comparison at a glance."""
    labels: List[str] = []
    for r in runs:
        if r["label"] not in labels:
            labels.append(r["label"])
    head = ["target", "runs", "p50 ms", "p99 ms", "max ms", "early", "lost", "queue writes/msg",
            "WAL entries/msg", "Mnesia log writes/msg", "broker CPU µs/msg", "gateway CPU µs/msg",
            "total CPU µs/msg"]
    lines = [_row(head), "|" + "---|" * len(head)]
    for label in labels:
        mine = [r for r in runs if r["label"] == label]
        lines.append(_row([
            label, len(mine), _span([r.get("p50_ms") for r in mine]), _span([r.get("p99_ms") for r in mine]),
            _span([r.get("max_ms") for r in mine]), sum(r["early"] for r in mine), sum(r["lost"] for r in mine),
            _span([r.get("queue_writes_per_message") for r in mine]),
            _span([r.get("wal_writes_per_message") for r in mine]),
            _span([r.get("mnesia_log_writes_per_message") for r in mine]),
            _span([r.get("broker_cpu_us_per_message") for r in mine]),
            _span([r.get("gateway_cpu_us_per_message") for r in mine]),
            _span([total_cpu(r) for r in mine])]))
    return lines


def total_cpu(r: dict) -> Optional[float]:
    """Broker plus gateway process CPU per message (the broker's alone for the others)."""
    broker = r.get("broker_cpu_us_per_message")
    return None if broker is None else round(broker + (r.get("gateway_cpu_us_per_message") or 0.0), 1)


def floor_lines(results: Dict[str, List[dict]], receiver_queue_type: Optional[str]) -> List[str]:
    """The plain queues' cost, and every paced target's total against the replicated floor:
    one quorum queue plus the receiver's own queue."""
    floors = {r["queue_type"]: r for r in results.get("floor", [])}
    if not floors:
        return []
    head = ["floor: plain durable queue", "messages", "published/s", "p50 ms", "p99 ms", "broker CPU µs/msg",
            "queue writes/msg"]
    lines = [_row(head), "|" + "---|" * len(head)]
    for r in floors.values():
        lines.append(_row([r["label"], r["messages"], _g(r, "publish_rate", "{:.0f}"), _g(r, "p50_ms"),
                           _g(r, "p99_ms"), _g(r, "broker_cpu_us_per_message"), _g(r, "queue_writes_per_message")]))
    quorum, own = floors.get("quorum"), floors.get(receiver_queue_type or "quorum")
    if quorum and own and quorum.get("broker_cpu_us_per_message") and own.get("broker_cpu_us_per_message"):
        replicated = quorum["broker_cpu_us_per_message"] + own["broker_cpu_us_per_message"]
        lines += ["", f"Replicated delay floor (one quorum queue + the receiver's {receiver_queue_type} queue): "
                  f"{replicated:.0f} µs/msg. Paced, total CPU against it:", ""]
        for r in results.get("paced", []):
            t = total_cpu(r)
            if t:
                lines.append(f"- round {r.get('round', 1)}, {r['label']}: {t:.0f} µs/msg = {t / replicated:.2f}x")
    return lines + [""]


def markdown(results: Dict[str, List[dict]], meta: dict) -> str:
    lines = [f"Run {meta.get('date')} on {meta.get('machine')}; RabbitMQ {meta.get('rabbitmq')} at "
             f"{meta.get('url')}; plugin: {meta.get('plugin')}; kombu: {meta.get('kombu', 'not asked')}; "
             f"write counters: {meta.get('counters')}; "
             f"load average at start {_loads(meta.get('load_average_start'))}, at end "
             f"{_loads(meta.get('load_average_end'))}", "", f"`{meta.get('command')}`", ""]
    for name in DELAYED:
        runs = results.get(name) or []
        if not runs:
            continue
        lines += [f"{name}:", ""] + delayed_table(runs) + [""]
        if len({r["label"] for r in runs}) > 1:
            lines += side_by_side(runs) + [""]
    lines += floor_lines(results, meta.get("receiver_queue_type"))
    best = {}
    for r in results.get("steady", []):
        best[r["label"]] = r.get("best_rate")
    if best:
        lines += ["| steady: target | highest rate with p99 < 100 ms |", "|---|---|"]
        lines += [f"| {label} | {b if b is not None else 'none of the ladder'} |" for label, b in best.items()]
        lines.append("")
    if results.get("pending"):
        head = ["pending: target", "messages", "publish/s", "broker RSS before MB", "peak MB", "after MB",
                "Erlang total after MB (binary)", "gateway RSS delta MB", "queue writes/msg", "WAL entries/msg",
                "Mnesia log writes/msg", "broker CPU µs/msg"]
        lines += [_row(head), "|" + "---|" * len(head)]
        for r in results["pending"]:
            mem = r.get("broker_erlang_memory_mb") or {}
            deltas = [r[k] for k in ("gateway0_rss_mb_delta", "gateway1_rss_mb_delta") if k in r]
            lines.append(_row([
                r["label"], r["messages"], _g(r, "publish_rate", "{:.0f}"), r["before"].get("broker_rss_mb", "-"),
                r.get("resources", {}).get("broker", {}).get("rss_mb_max", "-"), r["after"].get("broker_rss_mb", "-"),
                f"{mem.get('total', '-')} ({mem.get('binary', '-')})" if mem else "-",
                ", ".join(f"{d:+g}" for d in deltas) if deltas else "-",
                _g(r, "queue_writes_per_message"), _g(r, "wal_writes_per_message"),
                _g(r, "mnesia_log_writes_per_message"), _g(r, "broker_cpu_us_per_message")]))
        lines.append("")
    if results.get("holding"):
        head = ["holding: target", "body B", "messages", "carriers of", "held", "deliveries", "RSS at rest MiB",
                "holding MiB", "after MiB", "B per held message", "x its body", "B per held delivery"]
        lines += [_row(head), "|" + "---|" * len(head)]
        for r in results["holding"]:
            lines.append(_row([r["label"], r["size"], r["messages"], r["carriers"], f"{r['held']:.0f}",
                               f"{r['held_deliveries']:.0f}", r["rss_rest_mib"], r["rss_holding_mib"],
                               r["rss_after_mib"], _g(r, "bytes_per_held_message"), _g(r, "per_message_over_size"),
                               _g(r, "bytes_per_held_delivery")]))
        lines.append("")
    if results.get("roles"):
        lines += ["| role alone | queue type | zero bits | timed messages | seconds | msg/s | CPU µs/msg | "
                  "msg/s per CPU core | wake-ups | msg a wake-up | CPU µs a wake-up | broker CPU µs/msg | "
                  "broker CPU % |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["roles"]:
            lines.append(f"| {r['role']} | {r['queue_type']} | {r['zero_bits']} | {r['timed_messages']:.0f} | "
                         f"{r['seconds']} | {_g(r, 'rate', '{:.0f}')} | {_g(r, 'cpu_us_per_message')} | "
                         f"{_g(r, 'rate_per_core', '{:.0f}')} | {_g(r, 'wakeups')} | {_g(r, 'messages_per_wakeup')} | "
                         f"{_g(r, 'cpu_us_per_wakeup')} | {_g(r, 'broker_cpu_us_per_message')} | "
                         f"{_g(r, 'broker_cpu_pct')} |")
        lines.append("")
        lines += steps_lines(results["roles"])
    lines += ceiling_lines(results.get("ceiling", []))
    if results.get("idle"):
        lines += ["| idle: target | seconds | gateway CPU, % of a core | event loop wake-ups/s | gateway RSS MiB |",
                  "|---|---|---|---|---|"]
        for r in results["idle"]:
            lines.append(_row([r["label"], r["seconds"], r["gateway_cpu_pct"], r["gateway_wakeups_per_s"],
                               _g(r, "gateway_rss_mib")]))
        lines.append("")
    lines += footprint_lines(results.get("footprint", []))
    lines += soak_lines(results.get("soak", []))
    lines += vhosts_lines(results.get("vhosts", []))
    lines += catch_up_lines(results.get("catch-up", []))
    if results.get("hops"):
        lines += ["| broker alone | hops | messages | msg/s through all hops | hops/s | queue writes/s |",
                  "|---|---|---|---|---|---|"]
        for r in results["hops"]:
            lines.append(f"| {r['queue_type']} | {r['hops']} | {r['messages']} | {r['messages_per_s']:.0f} | "
                         f"{r['hops_per_s']:.0f} | {r['writes_per_s']:.0f} |")
        lines.append("")
    for r in results.get("naive", []):
        lines += ["| naive single TTL queue | messages | delays (ms) | p50 ms | p90 ms | p99 ms | max ms "
                  "| early | lost |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| per-message expiration | {r['messages']} | {r['delay_ms'][0]}-{r['delay_ms'][1]} | "
                  f"{_g(r, 'p50_ms')} | {_g(r, 'p90_ms')} | {_g(r, 'p99_ms')} | {_g(r, 'max_ms')} | "
                  f"{_g(r, 'early')} | {_g(r, 'lost')} |", ""]
    eff = efficiency(results)
    if eff:
        lines += ["| efficiency | target | rate msg/s | queue writes/msg | ceiling writes/s | efficiency |",
                  "|---|---|---|---|---|---|"]
        for e in eff:
            lines.append(f"| steady | {e['label']} | {e['rate']:.0f} | {e['writes_per_message']} | "
                         f"{e['ceiling_writes_per_s']:.0f} | {e['efficiency']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def steps_lines(roles: List[dict]) -> List[str]:
    """--profile: each step's CPU µs a message, per role (bench/profile.py)."""
    profiled = [r for r in roles if "steps_us_per_message" in r]
    if not profiled:
        return []
    lines = []
    for r in profiled:
        if r.get("profile_note"):
            lines.append(f"{r['role']}: no profile ({r['profile_note']})")
    steps = sorted({s for r in profiled for s in r["steps_us_per_message"]},
                   key=lambda s: -max(r["steps_us_per_message"].get(s, 0) for r in profiled))
    if steps:
        head = ["step: CPU µs a message"] + [f"{r['role']} {r['queue_type']}/{r['zero_bits']}" for r in profiled]
        lines += [_row(head), "|" + "---|" * len(head)]
        for step in steps:
            lines.append(_row([step] + [r["steps_us_per_message"].get(step, "-") for r in profiled]))
    return lines + [""]


def footprint_lines(runs: List[dict]) -> List[str]:
    """What one prefix costs the broker at rest (the sums of every node of a cluster)."""
    if not runs:
        return []
    lines = ["| footprint per prefix: chain | nodes | quorum | streams | classic | exchanges | bindings | "
             "file handles (3.x) | prefixes the limit holds | open fds | processes | memory MiB | "
             "CPU % of a core |", "|" + "---|" * 13]
    for r in runs:
        lines.append(_row([f"{r['queue_type']}/{r['zero_bits']}", r["nodes"], r["quorum"], r["stream"], r["classic"],
                           r["exchanges"], r["bindings"], _g(r, "file_handles"), _g(r, "prefixes_the_limit_holds"),
                           r["open_fds"], r["processes"], r["memory_mib"], r["cpu_pct"]]))
    return lines + [""]


def vhosts_lines(runs: List[dict]) -> List[str]:
    """One gateway serving many vhosts: at rest, and under a paced load spread over them."""
    if not runs:
        return []
    lines = ["| vhosts: one gateway | ready s | at rest: RSS MiB, threads, CPU % | broker connections, channels | "
             "msg/s | p50 ms | p99 ms | max ms | lost | early | loaded: RSS MiB, CPU % |", "|" + "---|" * 11]
    for r in runs:
        rest, loaded, links = r["rest"], r["loaded"], r["broker_links"]
        at_rest = f"{_g(rest, 'rss_mib')}, {_g(rest, 'threads')}, {rest['cpu_pct']}"
        lines.append(_row([r["vhosts"], r["ready_s"], at_rest,
                           f"{_g(links, 'connections')}, {_g(links, 'channels')}", r["publish_rate"], _g(r, "p50_ms"),
                           _g(r, "p99_ms"), _g(r, "max_ms"), r["lost"], r["early"],
                           f"{_g(loaded, 'rss_mib')}, {loaded['cpu_pct']}"]))
    return lines + [""]


def catch_up_lines(runs: List[dict]) -> List[str]:
    """After an outage: the overdue backlog released at once or paced, and the on-time flow."""
    if not runs:
        return []
    lines = ["| catch-up: round | --catch-up-rate | outage s | overdue | caught up after s | peak msg/s | "
             "overdue p50 / p99 / max ms | on time p50 / p99 / max ms | lost | early | duplicates |",
             "|" + "---|" * 11]
    for r in runs:
        o, t = r["overdue"], r["on_time"]
        lines.append(_row([r["round"], f"{r['rate']:g}" if r["rate"] else "0 (at once)", r["outage_s"],
                           o["published"], _g(r, "catch_up_s"), r["peak_per_s"],
                           f"{_g(o, 'p50_ms')} / {_g(o, 'p99_ms')} / {_g(o, 'max_ms')}",
                           f"{_g(t, 'p50_ms')} / {_g(t, 'p99_ms')} / {_g(t, 'max_ms')}",
                           o["lost"] + t["lost"], o["early"] + t["early"], o["duplicates"] + t["duplicates"]]))
    return lines + [""]


def soak_lines(runs: List[dict]) -> List[str]:
    """Window by window: which interpreter was fed, and what it cost."""
    lines: List[str] = []
    for r in runs:
        lines += [f"soak: {r['rate']:.0f} msg/s for {r['flow_seconds']:.0f} s in windows of "
                  f"{r['window_seconds']:.0f} s, delays {r['delay_ms'][0]}-{r['delay_ms'][1]} ms", "",
                  "| window | from s | interpreter | messages | gateway CPU µs/msg | broker CPU µs/msg | "
                  "gateway RSS MiB | p50 ms | p99 ms | max ms | early |", "|" + "---|" * 11]
        for w in r["windows"]:
            lines.append("| " + " | ".join(str(w[k]) for k in (
                "window", "start_s", "python", "messages", "gateway_cpu_us_per_message", "broker_cpu_us_per_message",
                "gateway_rss_mib", "p50_ms", "p99_ms", "max_ms", "early")) + " |")
        lines += ["", "| interpreter | published | lost | early | duplicates | p99 ms | RSS at the end MiB |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {t['python']} | {t['published']} | {t['lost']} | {t['early']} | {t['duplicates']} | "
                  f"{t['p99_ms']} | {t['rss_mib_end']} |" for t in r["totals"]]
        lines.append("")
    return lines


def ceiling_lines(runs: List[dict]) -> List[str]:
    """Rising paced rates, every target at each: its p99, and its highest rate under the limit."""
    if not runs:
        return []
    labels = list(dict.fromkeys(r["label"] for r in runs))
    rates = list(dict.fromkeys(r["target_rate"] for r in runs))
    limit = runs[0].get("p99_limit_ms", 100)
    head = ["ceiling: target"] + [f"p99 ms at {rate:,.0f}/s" for rate in rates] + [f"highest rate, p99 < {limit:g} ms"]
    lines = [_row(head), "|" + "---|" * len(head)]
    cpu_lines = [_row(["gateway CPU µs/msg (wake-ups/msg)"] + [f"at {rate:,.0f}/s" for rate in rates]),
                 "|" + "---|" * (len(rates) + 1)]
    for label in labels:
        at = {r["target_rate"]: r for r in runs if r["label"] == label}
        cells = []
        for rate in rates:
            r = at.get(rate)
            if r is None:
                cells.append("-")
                continue
            lost = f", lost {r['lost']}" if r["lost"] else ""
            early = f", early {r['early']}" if r["early"] else ""
            slow = "" if r["publish_rate"] >= 0.95 * rate else f", published {r['publish_rate']:.0f}/s"
            cells.append(f"{_g(r, 'p99_ms')}{lost}{early}{slow}")
        best = next(iter(at.values())).get("best_rate")
        lines.append(_row([label] + cells + [f"{best:,}/s" if best else "none tried"]))
        if any(r.get("gateway_cpu_us_per_message") for r in at.values()):
            cpu_lines.append(_row([label] + [
                f"{_g(at[rate], 'gateway_cpu_us_per_message')} ({_g(at[rate], 'gateway_wakeups_per_message')})"
                if rate in at else "-" for rate in rates]))
    return lines + [""] + (cpu_lines + [""] if len(cpu_lines) > 2 else [])


def _loads(values: Optional[list]) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "?"


def efficiency(results: Dict[str, List[dict]]) -> List[dict]:
    """Highest steady rate x measured queue writes per message / the broker's raw write rate."""
    ceilings = {r["queue_type"]: r["writes_per_s"] for r in results.get("hops", [])}
    out = []
    for r in results.get("steady", []):
        if (r.get("meets_p99_limit") and r.get("queue_type") in ceilings and r.get("target_rate") == r.get("best_rate")
                and r.get("queue_writes_per_message")):
            c = ceilings[r["queue_type"]]
            out.append({"label": r["label"], "rate": r["publish_rate"],
                        "writes_per_message": r["queue_writes_per_message"],
                        "ceiling_writes_per_s": c, "efficiency": r["publish_rate"] * r["queue_writes_per_message"] / c})
    return out


def charts(out_dir: str, results: Dict[str, List[dict]]) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    for name, runs in results.items():
        runs = [r for r in runs if r.get("series", {}).get("lateness_ms")]
        if not runs:
            continue
        fig, ax = plt.subplots(figsize=(9, 5))
        for i, r in enumerate(runs):
            late = r["series"]["lateness_ms"]
            ys = [(k + 1) / len(late) for k in range(len(late))]
            label = f"{r.get('label', name)} r{r.get('round', 1)}"
            ax.plot([max(v, 0.01) for v in late], ys, label=label, linestyle=("-", "--", ":")[i // 10 % 3])
        ax.set_xscale("log")
        ax.set_xlabel("lateness (ms, log scale): arrival - (publish time + delay)")
        ax.set_ylabel("fraction of messages")
        ax.set_title(f"{name}: lateness distribution (CDF)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        path = os.path.join(out_dir, f"lateness-{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path)
    runs = [r for rs in results.values() for r in rs if r.get("series", {}).get("published_per_s")]
    for idx, r in enumerate(runs):
        s = r["series"]
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot(s["published_per_s"], label="published (confirmed) / s")
        if s.get("delivered_per_s"):
            ax.plot(s["delivered_per_s"], label="arrived at the receiver / s")
        pts = [(row["t"], row["checked_in"]) for row in s.get("sampler", []) if "checked_in" in row]
        if len(pts) > 1:
            xs = [b[0] for b in pts[1:]]
            ys = [(b[1] - a[1]) / max(1e-6, b[0] - a[0]) for a, b in zip(pts, pts[1:], strict=False)]
            ax.plot(xs, ys, label="checked in / s (gateway metrics)", alpha=0.7)
        ax.set_xlabel("seconds")
        ax.set_ylabel("messages / s")
        ax.set_title(f"{r['scenario']} {r.get('label', '')} round {r.get('round', 1)}: {r['messages']} messages")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        slug = "".join(c if c.isalnum() else "-" for c in f"{r['scenario']}-{r.get('label', '')}-r{r.get('round', 1)}")
        path = os.path.join(out_dir, f"throughput-{idx:02d}-{slug.strip('-')}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path)
    return files
