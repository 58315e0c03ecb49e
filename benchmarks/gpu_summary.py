"""The summary of a benchmarks/gpu_check.sh run: one table, a JSON file, and the exit status of the check.

    python benchmarks/gpu_summary.py LOGS SUMMARY.json [TITLE]

Reads `LOGS/stages.tsv` (per stage: name, limit, seconds, exit status or `not-run`) and each stage's `LOGS/NAME.txt`.
A stage with item lines (`PLAN`, `PASS`, `FAIL`, `SKIP`: benchmarks/gpu_paths.py, gpu_wheels.py --check) counts its
items; an item planned but not reported failed ("not reached"), as does the stage itself when it exited non-zero
with no failed item to say why (a crash) or was cut off by its limit (exit 124 or 137). A stage without item lines
is one item: passed when it exited 0. Standard library only: it must run where nothing else does. Exits 1 when
anything failed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

CUT_OFF = {"124", "137"}  # timeout's status for a command it stopped (137: killed after its grace period)


def stage_result(name: str, limit: int, seconds: int, status: str, text: str) -> dict:
    lines = {kind: [line for line in text.splitlines() if line.startswith(kind + " ")]
             for kind in ("PASS", "FAIL", "SKIP")}
    planned = re.findall(r"^PLAN (.+)$", text, re.M)
    failures = list(lines["FAIL"])
    has_items = bool(planned or any(lines.values()))
    if status == "not-run":
        failures.append(f"FAIL {name}: not run (the budget was spent before it)")
    elif has_items:  # gpu_paths.py's lines: `KIND name (12.3 s)...` or `SKIP name (skipped): why`
        done = set(re.findall(r"^(?:PASS|FAIL|SKIP) (.+?) \((?:[0-9.]+ s|skipped)\)", text, re.M))
        unreached = [item for item in planned if item not in done]
        why = f"cut off by its {limit} s limit" if status in CUT_OFF else f"the stage ended (exit {status}) before it"
        failures += [f"FAIL {item}: not reached ({why})" for item in unreached]
        if status != "0" and not failures:
            failures.append(f"FAIL {name}: exit {status}" + (" (cut off by its limit)" if status in CUT_OFF else ""))
    elif status != "0":
        last = [line for line in text.splitlines() if line.strip()][-3:]
        failures.append(f"FAIL {name}: exit {status}"
                        + (f" (cut off by its {limit} s limit)" if status in CUT_OFF else "") + ": " + " | ".join(last))
    passed = len(lines["PASS"]) if has_items else int(status == "0")
    return {"stage": name, "passed": passed, "failed": len(failures), "skipped": len(lines["SKIP"]),
            "seconds": seconds, "limit": limit, "exit": status, "failures": failures, "skips": lines["SKIP"]}


def main() -> None:
    logs, summary = Path(sys.argv[1]), Path(sys.argv[2])
    title = sys.argv[3] if len(sys.argv) > 3 else ""
    rows = []
    for line in (logs / "stages.tsv").read_text().splitlines():
        name, limit, seconds, status = line.split("\t")
        log = logs / f"{name}.txt"
        text = log.read_text(errors="replace") if log.exists() else ""
        rows.append(stage_result(name, int(limit), int(seconds), status, text))
    failed = sum(row["failed"] for row in rows)
    print(f"\n=== summary{f' ({title})' if title else ''}")
    print(f"{'stage':<20} {'passed':>6} {'failed':>6} {'skipped':>7} {'seconds':>7} {'limit':>5}")
    for row in rows:
        print(f"{row['stage']:<20} {row['passed']:>6} {row['failed']:>6} {row['skipped']:>7} {row['seconds']:>7} "
              f"{row['limit']:>5}")
    total = sum(row["seconds"] for row in rows)
    print(f"{'all':<20} {sum(r['passed'] for r in rows):>6} {failed:>6} {sum(r['skipped'] for r in rows):>7} "
          f"{total:>7} {sum(r['limit'] for r in rows):>5}")
    for row in rows:
        for line in row["failures"] + row["skips"]:
            print(f"  {row['stage']}: {line}")
    summary.write_text(json.dumps({"title": title, "failed": failed, "stages": rows}, indent=1) + "\n")
    print(f"=== {'FAILED' if failed else 'PASSED'}: {failed} failed; {summary}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
