"""Write the results: one JSON file, a markdown table, and PNG charts (if matplotlib is there)."""

import json
import os
from typing import Dict, List


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


def _res(r: dict, who: str, k: str) -> str:
    v = r.get("resources", {}).get(who, {}).get(k)
    return "-" if v is None else f"{v:g}"


def markdown(results: Dict[str, List[dict]], meta: dict) -> str:
    lines = [f"Run {meta.get('date')} on {meta.get('machine')}; command: `{meta.get('command')}`", ""]
    delayed = [r for rs in results.values() for r in rs if "p99_ms" in r and r["scenario"] != "naive"]
    if delayed:
        lines += ["| scenario | queue type | zero bits | messages | delays (ms) | target/s | published/s | "
                  "check-in drain/s | p50 ms | p90 ms | p99 ms | max ms | early | lost | dup | "
                  "broker RSS max MB | check-in CPU % | distributor CPU % |",
                  "|" + "---|" * 18]
        for r in delayed:
            lines.append("| " + " | ".join([
                r["scenario"], r["queue_type"], r["zero_bits"], str(r["messages"]),
                "-".join(str(x) for x in r["delay_ms"]), _g(r, "target_rate", "{:g}"), _g(r, "publish_rate", "{:.0f}"),
                _g(r, "checkin_drain_rate", "{:.0f}"), _g(r, "p50_ms"), _g(r, "p90_ms"), _g(r, "p99_ms"),
                _g(r, "max_ms"), _g(r, "early"), _g(r, "lost"), _g(r, "duplicates"),
                _res(r, "broker", "rss_mb_max"), _res(r, "check-in", "cpu_pct_mean"),
                _res(r, "distributor", "cpu_pct_mean")]) + " |")
        lines.append("")
    best = {(r["queue_type"], r["zero_bits"]): r.get("best_rate") for r in results.get("steady", [])}
    if best:
        lines += ["| steady: queue type | zero bits | highest rate with p99 < 100 ms |", "|---|---|---|"]
        lines += [f"| {qt} | {zb} | {b if b is not None else 'none of the ladder'} |" for (qt, zb), b in best.items()]
        lines.append("")
    for r in results.get("naive", []):
        lines += ["| naive single TTL queue | messages | delays (ms) | p50 ms | p90 ms | p99 ms | max ms | early | lost |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| per-message expiration | {r['messages']} | {r['delay_ms'][0]}-{r['delay_ms'][1]} | "
                  f"{_g(r, 'p50_ms')} | {_g(r, 'p90_ms')} | {_g(r, 'p99_ms')} | {_g(r, 'max_ms')} | "
                  f"{_g(r, 'early')} | {_g(r, 'lost')} |", ""]
    if results.get("roles"):
        lines += ["| role alone | queue type | zero bits | messages | seconds | msg/s | CPU µs/msg | msg/s per CPU core |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results["roles"]:
            lines.append(f"| {r['role']} | {r['queue_type']} | {r['zero_bits']} | {r['messages']} | {r['seconds']} | "
                         f"{r['rate']:.0f} | {_g(r, 'cpu_us_per_message')} | {_g(r, 'rate_per_core', '{:.0f}')} |")
        lines.append("")
    if results.get("ceiling"):
        lines += ["| ceiling | hops | messages | msg/s through all hops | hops/s | queue writes/s |", "|---|---|---|---|---|---|"]
        for r in results["ceiling"]:
            lines.append(f"| {r['queue_type']} | {r['hops']} | {r['messages']} | {r['messages_per_s']:.0f} | "
                         f"{r['hops_per_s']:.0f} | {r['writes_per_s']:.0f} |")
        lines.append("")
    if results.get("pending"):
        lines += ["| pending | messages | publish/s | broker RSS before MB | after MB | check-in RSS delta MB | "
                  "distributor RSS delta MB | max-in-memory-length |", "|---|---|---|---|---|---|---|---|"]
        for r in results["pending"]:
            lines.append(f"| {r['queue_type']} | {r['messages']} | {r['publish_rate']:.0f} | "
                         f"{r['before'].get('broker_rss_mb', '-')} | {r['after'].get('broker_rss_mb', '-')} | "
                         f"{r.get('check-in_rss_mb_delta', '-')} | {r.get('distributor_rss_mb_delta', '-')} | "
                         f"{r.get('max_in_memory_length') if r.get('max_in_memory_length') is not None else '-'} |")
        lines.append("")
    eff = efficiency(results)
    if eff:
        lines += ["| efficiency | queue type | zero bits | rate msg/s | writes/msg | ceiling writes/s | efficiency |",
                  "|---|---|---|---|---|---|---|"]
        for e in eff:
            lines.append(f"| {e['from']} | {e['queue_type']} | {e['zero_bits']} | {e['rate']:.0f} | {e['writes_per_message']} | "
                         f"{e['ceiling_writes_per_s']:.0f} | {e['efficiency']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def efficiency(results: Dict[str, List[dict]]) -> List[dict]:
    """End-to-end rate x queue writes per message / the broker's raw write rate."""
    ceilings = {r["queue_type"]: r["writes_per_s"] for r in results.get("ceiling", [])}
    out = []
    for r in results.get("steady", []):
        if r.get("meets_p99_limit") and r["queue_type"] in ceilings and r.get("target_rate") == r.get("best_rate"):
            c = ceilings[r["queue_type"]]
            out.append({"from": "steady", "queue_type": r["queue_type"], "zero_bits": r["zero_bits"],
                        "rate": r["publish_rate"], "writes_per_message": r["writes_per_message"],
                        "ceiling_writes_per_s": c, "efficiency": r["publish_rate"] * r["writes_per_message"] / c})
    return out


def charts(out_dir: str, results: Dict[str, List[dict]]) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    runs = [r for rs in results.values() for r in rs if "lateness_ms" in r.get("series", {})]
    if runs:
        fig, ax = plt.subplots(figsize=(9, 5))
        for i, r in enumerate(runs):
            late = r["series"]["lateness_ms"]
            if not late:
                continue
            ys = [(i + 1) / len(late) for i in range(len(late))]
            label = f"{r['scenario']} {r.get('queue_type', '')}/{r.get('zero_bits', '')} {r.get('target_rate') or ''}"
            ax.plot([max(v, 0.01) for v in late], ys, label=label.strip(), linestyle=("-", "--", ":")[i // 10 % 3])
        ax.set_xscale("log")
        ax.set_xlabel("lateness (ms, log scale): receive time - due time")
        ax.set_ylabel("fraction of messages")
        ax.set_title("Lateness distribution (CDF)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        path = os.path.join(out_dir, "lateness.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path)
    runs = [r for rs in results.values() for r in rs if "published_per_s" in r.get("series", {})]
    for idx, r in enumerate(runs):
        s = r["series"]
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot(s["published_per_s"], label="published (confirmed) / s")
        if s.get("delivered_per_s"):
            ax.plot(s["delivered_per_s"], label="delivered at pick-up / s")
        samples = s.get("sampler", [])
        for role in ("check-in", "distributor"):
            pts = [(row["t"], row[f"{role}_forwarded"]) for row in samples if f"{role}_forwarded" in row]
            if len(pts) > 1:
                xs = [b[0] for b in pts[1:]]
                ys = [(b[1] - a[1]) / max(1e-6, b[0] - a[0]) for a, b in zip(pts, pts[1:])]
                ax.plot(xs, ys, label=f"{role} forwarded / s", alpha=0.7)
        ax.set_xlabel("seconds")
        ax.set_ylabel("messages / s")
        ax.set_title(f"{r['scenario']} {r.get('queue_type', '')}/{r.get('zero_bits', '')} "
                     f"{r['messages']} msgs {('at %g/s' % r['target_rate']) if r.get('target_rate') else ''}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        name = f"throughput-{idx:02d}-{r['scenario']}-{r.get('queue_type', '')}-{r.get('zero_bits', '')}"
        path = os.path.join(out_dir, name.rstrip("-") + ".png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path)
    return files
