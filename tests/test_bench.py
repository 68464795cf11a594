"""The benchmark command runs end to end at tiny sizes, so it cannot rot.

Only the shape of its JSON and correctness (nothing early, nothing lost) are checked here:
timing targets live in BENCHMARKS.md, never in assertions.
"""

import json
import os
import subprocess
import sys

from .support import ROOT, broker_url


def test_bench_runs_and_reports(broker, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "bench", "accuracy", "naive", "ceiling", "roles",
           "--out", str(out), "--messages", "60", "--rates", "200", "--min-delay", "300",
           "--max-delay", "1500", "--queue-types", "quorum", "--zero-bits", "exchange"]
    env = dict(os.environ, DELAY_GATEWAY_URL=broker_url())
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert {"date", "machine", "command"} <= set(data["meta"])
    results = data["results"]
    [acc] = results["accuracy"]
    for key in ("publish_rate", "p50_ms", "p90_ms", "p99_ms", "max_ms", "early", "lost", "duplicates",
                "resources", "writes_per_message", "series"):
        assert key in acc, key
    assert acc["received"] >= 60 and acc["early"] == 0 and acc["lost"] == 0
    [naive] = results["naive"]
    assert naive["lost"] == 0 and naive["early"] == 0
    [ceiling] = results["ceiling"]
    assert ceiling["arrived"] == 60 and ceiling["hops_per_s"] > 0
    assert {r["role"] for r in results["roles"]} == {"check-in", "distributor"}
    assert all(r["forwarded"] >= 60 for r in results["roles"])
    assert (out / "results.md").read_text().count("|") > 10
    # scripts/test installs the bench extra, so the charts are drawn, not skipped
    assert (out / "lateness.png").stat().st_size > 1000
    assert list(out.glob("throughput-*.png"))
