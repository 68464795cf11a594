"""The resume record of `schedule`: what a run was, and which partitions it finished.

A directory on the driver (`--state`): `run.json` names the run (a fingerprint of the
input files and every option that decides which rows become which messages, the instant
the run started, the number of partitions) and `done/part-NNNNN.json` is written, with
the partition's row count, once every row of that partition was confirmed by the broker.
A re-run with the same fingerprint recomputes the same partitions (rows are hash-
partitioned by message id into the recorded number of partitions, and checked against the
recorded start instant) and skips the ones marked done. Files are replaced atomically, so
a kill leaves either the old record or the new one.
"""

import hashlib
import json
import os
from typing import Any, Dict, Optional

from gateway.settings import UsageError
from gateway.urls import redact
from gateway.spark.publisher import Target


def run_description(a, fmt: str, target: Target, df, m) -> Dict[str, Any]:
    """What decides which rows become which messages: a change means another run."""
    files = []
    for path in sorted(df.inputFiles()):
        local = path[len("file:"):] if path.startswith("file:") else path
        try:
            st = os.stat(local)
            files.append([path, st.st_size, st.st_mtime_ns])
        except OSError:
            files.append([path])
    options = {k: getattr(a, k) for k in ("routing_key", "payload_row", "due_expr", "content_type",
                                            "max_overdue_ms", "max_payload_bytes", "rows_per_partition")}
    hosts = sorted(redact(u) for u in target.urls)
    return {"format": fmt, "files": files, "mapping": m, "options": options,
            "exchange": target.exchange, "brokers": hosts}


def fingerprint(description: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Progress:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.done_dir = os.path.join(directory, "done")

    def run(self) -> Optional[Dict[str, Any]]:
        return _read(os.path.join(self.directory, "run.json"))

    def begin(self, run: Dict[str, Any]) -> None:
        """A new run: forget the old one's partitions."""
        try:
            os.makedirs(self.done_dir, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--state {self.directory}: cannot create it: {exc.strerror}") from None
        for name in os.listdir(self.done_dir):
            os.remove(os.path.join(self.done_dir, name))
        _write(os.path.join(self.directory, "run.json"), run)

    def update(self, **fields: Any) -> None:
        run = self.run() or {}
        run.update(fields)
        _write(os.path.join(self.directory, "run.json"), run)

    def done(self) -> Dict[int, int]:
        """partition -> rows published, for every partition finished so far."""
        out: Dict[int, int] = {}
        if not os.path.isdir(self.done_dir):
            return out
        for name in os.listdir(self.done_dir):
            record = _read(os.path.join(self.done_dir, name)) if name.endswith(".json") else None
            if record is not None:
                out[int(record["partition"])] = int(record["rows"])
        return out

    def mark(self, partition: int, rows: int, seconds: float) -> None:
        _write(os.path.join(self.done_dir, f"part-{partition:05d}.json"),
               {"partition": partition, "rows": rows, "seconds": round(seconds, 3)})


def _read(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the resume record {path}: {exc}; remove it or pass --restart") from None


def _write(path: str, value: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
