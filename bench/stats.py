"""Lateness statistics from what the receiver saw. Pure: lists in, numbers out."""

from typing import Dict, List, Sequence


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    k = (len(sorted_values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def lateness_stats(data: Dict[str, list], published: int) -> dict:
    """From receiver data (`id`, `due` and `recv`, epoch ms on the publisher's host): lateness
    percentiles (ms), and how many were early, lost or duplicated."""
    late = sorted(r - d for r, d in zip(data["recv"], data["due"], strict=False))
    unique = len(set(data["id"]))
    out = {"published": published, "received": len(data["id"]), "unique": unique,
           "duplicates": len(data["id"]) - unique, "lost": published - unique,
           "early": sum(1 for v in late if v < 0)}
    if late:
        for p in (50, 90, 99, 99.9):
            out[f"p{p:g}_ms"] = round(percentile(late, p), 2)
        out["max_ms"] = round(late[-1], 2)
        out["min_ms"] = round(late[0], 2)
        out["mean_ms"] = round(sum(late) / len(late), 2)
    return out


def per_second(times_s: Sequence[float], t0: float = 0.0) -> List[int]:
    """Counts per whole second since t0, for throughput-over-time charts."""
    counts: List[int] = []
    for t in times_s:
        k = int(t - t0)
        if k < 0:
            continue
        while len(counts) <= k:
            counts.append(0)
        counts[k] += 1
    return counts


def thin(values: Sequence[float], k: int = 20000) -> List[float]:
    """At most k values, evenly spaced in sorted order (for the lateness chart)."""
    values = sorted(values)
    if len(values) <= k:
        return [round(v, 2) for v in values]
    step = len(values) / k
    return [round(values[int(i * step)], 2) for i in range(k)]


def per_message(total: float, messages: int, scale: float = 1.0, digits: int = 2):
    """total x scale / messages, or None when there is nothing to divide."""
    if messages <= 0 or total is None:
        return None
    return round(total * scale / messages, digits)
