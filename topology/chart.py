"""What the Helm chart ships that comes from the pure topology, generated here so the chart
holds no second copy of the topology's logic:

- `files/topology.json`: for each queue type x zero-bits mode, the operator resources
  (topology/operator.py) of the fixed objects, of each level 0..37, of each meditation size
  and of each band of the waiting streams, with the prefix, the resolution and the
  cancellations stream's retention as the only placeholders and every number that scales
  with the resolution given in units. The chart's template only picks the levels below
  maxLevel, the meditation of maxLevel and the bands a lap needs, substitutes, and
  multiplies.
- the `allOf` of `values.schema.json`: for each max level, the resolutions above which
  RabbitMQ's 10-year TTL cap rules it out (settings.max_level_for), and the choices of
  queueType and zeroBits.

`python -m topology.chart CHART_DIR` rewrites both; a test fails when they are stale.
"""

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

from topology import index_bands
from topology.model import build
from topology.names import generation
from topology.operator import ClusterReference, resources
from topology.settings import MAX_LEVELS, MAX_TTL_MS, QUEUE_TYPES, ZERO_BITS, ChainSettings, max_level_for

Json = Dict[str, Any]  # a JSON object

PREFIX = "@prefix@"
RESOLUTION = "@resolution@"
# The cancellations stream's x-max-age, the default retention window: 2^maxLevel units plus
# a day (topology.model.cancel_window_ms), which the template computes.
CANCEL_MAX_AGE = "@cancel-max-age@"
# Rendered with this prefix, then replaced by PREFIX: it must be a valid prefix and
# Kubernetes name, so that object names come out as the names themselves.
_MARK = "prefix-placeholder"
# Filled in by the chart from its values.
_FROM_VALUES = ("vhost", "rabbitmqClusterReference")


def _rendered(chain: ChainSettings) -> Dict[Tuple[str, str], Json]:
    docs = resources(build(chain), ClusterReference("cluster"))
    for d in docs:
        if d["kind"] == "Queue" and d["spec"]["name"] == chain.names.cancellations:
            d["spec"]["arguments"]["x-max-age"] = CANCEL_MAX_AGE
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _group(chain: ChainSettings, d: Json) -> Tuple[str, int]:
    """Which part of the chain an object belongs to: ("fixed", 0), ("level", k),
    ("meditation", max_level) or ("waiting", band), by the names the topology gives them."""
    n = chain.names
    name = d["spec"].get("name") or d["spec"]["source"]
    stream = d["spec"].get("name") or d["spec"].get("destination")
    for b in range(index_bands.BANDS):
        if stream == n.waiting_stream(index_bands.band_key(b)):
            return "waiting", b
    if name in (chain.meditation, n.gateways(chain.max_level)):  # the objects of one max level
        return "meditation", chain.max_level
    for k in range(chain.max_level):
        if name == n.level(k) or name.startswith(n.level(k) + "."):
            return "level", k
    if name.startswith(n.chain + "."):
        raise ValueError(f"chain object {name} belongs to no level")
    return "fixed", 0


def _symbolic(d: Json, resolution: int, queue_type: str, zero_bits: str, scaled: Dict[str, int]) -> Json:
    tag = generation(resolution, queue_type, zero_bits)
    symbolic_tag = generation(RESOLUTION, queue_type, zero_bits)  # type: ignore[arg-type]

    def sub(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(_MARK, PREFIX).replace(tag, symbolic_tag)
        if isinstance(value, dict):
            return {k: sub(v) for k, v in value.items()}
        return value

    spec = {k: v for k, v in d["spec"].items() if k not in _FROM_VALUES}
    out = {"kind": d["kind"], "name": sub(d["metadata"]["name"]), "labels": sub(d["metadata"]["labels"]),
           "spec": sub(spec)}
    if scaled:
        out["spec"]["arguments"] = {k: v for k, v in out["spec"]["arguments"].items() if k not in scaled}
        out["unitsArguments"] = scaled
    return out


def _scaled(one: Json, two: Json) -> Dict[str, int]:
    """The arguments that double when the resolution does: numbers in units."""
    a, b = one["spec"].get("arguments", {}), two["spec"].get("arguments", {})
    out = {}
    for key, value in a.items():
        if isinstance(value, int) and not isinstance(value, bool) and b[key] != value:
            if b[key] != 2 * value:
                raise ValueError(f"{key} neither scales with the resolution nor stays: {value} -> {b[key]}")
            out[key] = value
    return out


def chain_data(queue_type: str, zero_bits: str) -> Json:
    # Rendered at resolutions 1 and 2 (the comparison tells which numbers are in units).
    # The top level and meditation size fit RabbitMQ's TTL cap at 1 ms only, where a unit is
    # a millisecond, so for them the 1 ms rendering alone is exact.
    top, top_at_2 = max_level_for(1), max_level_for(2)
    fixed: List[Json] = []
    levels: List[List[Json]] = [[] for _ in range(top)]
    meditation: List[List[Json]] = [[] for _ in range(top)]
    waiting: List[List[Json]] = [[] for _ in range(index_bands.BANDS)]
    seen = set()
    # (every band: a lap of nearly 10 years, the longest RabbitMQ allows, needs all of them)
    longest = ChainSettings(prefix=_MARK, max_level=18, resolution_ms=1_200_000, queue_type=queue_type,
                            zero_bits=zero_bits)
    for key, d in _rendered(longest).items():
        group, b = _group(longest, d)
        if group == "waiting":
            seen.add(key)
            waiting[b].append(_symbolic(d, 1_200_000, queue_type, zero_bits, {}))
    for size in range(1, top + 1):
        one = ChainSettings(prefix=_MARK, max_level=size, resolution_ms=1, queue_type=queue_type, zero_bits=zero_bits)
        two = _rendered(ChainSettings(prefix=_MARK, max_level=size, resolution_ms=2, queue_type=queue_type,
                                      zero_bits=zero_bits)) if size <= top_at_2 else {}
        tag_one, tag_two = generation(1, queue_type, zero_bits), generation(2, queue_type, zero_bits)
        for key, d in _rendered(one).items():
            other = two.get((key[0], key[1].replace(tag_one, tag_two)))
            group, k = _group(one, d)
            if group != "meditation" and key in seen:
                continue
            seen.add(key)
            entry = _symbolic(d, 1, queue_type, zero_bits, _scaled(d, other) if other else {})
            if group == "fixed":
                fixed.append(entry)
            elif group == "level":
                levels[k].append(entry)
            elif group == "waiting":
                raise AssertionError(f"band {k} missing from the longest chain's")
            else:
                meditation[k - 1].append(entry)
    if not all(waiting):
        raise AssertionError("a band has no objects")
    return {"fixed": fixed, "levels": levels, "meditation": meditation, "waiting": waiting}


def chart_data() -> Json:
    return {
        "about": "Generated by `python -m topology.chart` from the gateway's operator rendering; do not edit. "
                 f"Placeholders: {PREFIX} (the prefix), {RESOLUTION} (resolutionMs) and {CANCEL_MAX_AGE} (the "
                 "cancellations stream's x-max-age: 2^maxLevel x resolutionMs + 1 day, in s); unitsArguments are "
                 "queue arguments in units of resolutionMs. levels[k]: the objects of level k; meditation[n-1]: "
                 "the meditation objects of maxLevel n; waiting[b]: the waiting stream of band b, for laps "
                 "((2^maxLevel - 1) x resolutionMs) above 4^(b-1) s.",
        "chains": {f"{q}-{z}": chain_data(q, z) for q in QUEUE_TYPES for z in ZERO_BITS},
    }


def schema_clauses() -> List[Any]:
    """JSON Schema `allOf` clauses: for each max level L that some resolution rules out,
    `if resolutionMs > largest resolution allowing L then maxLevel <= L - 1`."""
    clauses = []
    for level in range(2, MAX_LEVELS + 1):
        largest = MAX_TTL_MS // ((1 << level) - 1)  # the largest resolution at which `level` fits
        if max_level_for(largest + 1) != level - 1 and largest >= 1:
            raise AssertionError("max_level_for is not the step function this assumes")
        clauses.append({
            "if": {"properties": {"resolutionMs": {"minimum": largest + 1}}, "required": ["resolutionMs"]},
            "then": {"properties": {"maxLevel": {"maximum": level - 1,
                                                 "description": f"at resolutionMs >= {largest + 1}, "
                                                                f"RabbitMQ's 10-year TTL cap allows at most "
                                                                f"maxLevel {level - 1}"}}},
        })
    return clauses


def schema(current: Json) -> Json:
    """The chart's values schema with its generated parts brought up to date."""
    out = dict(current)
    props = dict(out["properties"])
    props["queueType"] = {**props["queueType"], "enum": list(QUEUE_TYPES)}
    props["zeroBits"] = {**props["zeroBits"], "enum": list(ZERO_BITS)}
    props["maxLevel"] = {**props["maxLevel"], "minimum": 1, "maximum": MAX_LEVELS}
    props["resolutionMs"] = {**props["resolutionMs"], "minimum": 1, "maximum": MAX_TTL_MS}
    out["properties"] = props
    own = [c for c in out.get("allOf", []) if "resolutionMs" not in json.dumps(c.get("if", {}))]
    out["allOf"] = own + schema_clauses()
    return out


def dump(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False) + "\n"


def data_text() -> str:
    # one object per line: small enough to ship, and a diff shows which objects changed
    data = chart_data()
    lines = ["{", f'"about": {json.dumps(data["about"])},', '"chains": {']
    chains = list(data["chains"].items())
    for i, (name, chain) in enumerate(chains):
        lines.append(f"{json.dumps(name)}: {{")
        parts = [("fixed", [chain["fixed"]]), ("levels", chain["levels"]), ("meditation", chain["meditation"]),
                 ("waiting", chain["waiting"])]
        for j, (part, groups) in enumerate(parts):
            lines.append(f'"{part}": [' if part != "fixed" else '"fixed":')
            for g, group in enumerate(groups):
                objs = [json.dumps(o, sort_keys=True, separators=(",", ":")) for o in group]
                lines.append("[\n" + ",\n".join(objs) + "\n]" + ("," if g < len(groups) - 1 else ""))
            if part != "fixed":
                lines.append("]")
            lines[-1] += "," if j < len(parts) - 1 else ""
        lines.append("}" + ("," if i < len(chains) - 1 else ""))
    lines += ["}", "}"]
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == data
    return text


def write(chart_dir: Path) -> None:
    (chart_dir / "files").mkdir(exist_ok=True)
    (chart_dir / "files" / "topology.json").write_text(data_text())
    path = chart_dir / "values.schema.json"
    path.write_text(dump(schema(json.loads(path.read_text()))))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m topology.chart CHART_DIR")
    write(Path(sys.argv[1]))
