"""Collect the raw outputs of tests/gpu/run_gpu_checks.sh into one JSON of figures.

Usage: python collect_gpu_checks.py OUTDIR

run_gpu_checks.sh leaves, per step NAME, in OUTDIR/raw/:

    NAME.rc     the step's exit status       NAME.secs   its wall time
    NAME.out    its stdout (a bench's JSON)  NAME.xml    a pytest step's JUnit report
    NAME.skip   why the step did not run (no CUDA, out of time): no .rc then

and OUTDIR/raw/env.json (the machine; stand_in.log if the embedded model was replaced). This writes OUTDIR/gpu_checks.json: every step's
status (passed, failed, timeout, skipped) and figures, plus a `summary` of the headline
figures, and prints where it wrote it. It needs only the standard library.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

RESULT_FILE = "gpu_checks.json"
# Exit statuses of `timeout` (SIGTERM) and of a kill after it (SIGKILL).
TIMEOUT_CODES = (124, 137)


def _read(path: Path) -> str | None:
    return path.read_text(errors="replace").strip() if path.is_file() else None


def last_json_line(text: str | None) -> Any:
    """The last line of `text` that parses as JSON (benches print logs before it)."""
    for line in reversed((text or "").splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def junit_counts(path: Path) -> dict[str, Any] | None:
    """Totals of a pytest JUnit report, plus the ids of the tests that failed."""
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    counts["failed_tests"] = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return counts


def step_status(rc: int | None, skip: str | None) -> str:
    if rc is None:
        return "skipped" if skip is not None else "missing"
    if rc in TIMEOUT_CODES:
        return "timeout"
    return "passed" if rc == 0 else "failed"


def collect_step(raw: Path, name: str) -> dict[str, Any]:
    rc_text, skip = _read(raw / f"{name}.rc"), _read(raw / f"{name}.skip")
    rc = int(rc_text) if rc_text else None
    step: dict[str, Any] = {"status": step_status(rc, skip), "rc": rc}
    if skip is not None:
        step["reason"] = skip
    secs = _read(raw / f"{name}.secs")
    if secs:
        step["seconds"] = int(secs)
    tests = junit_counts(raw / f"{name}.xml")
    if tests is not None:
        step["tests"] = tests
    report = last_json_line(_read(raw / f"{name}.out"))
    if report is not None:
        step["report"] = report
    log = _read(raw / f"{name}.log")
    if step["status"] in ("failed", "timeout") and log:
        step["log_tail"] = log[-2000:]
    return step


def _throughput(step: dict[str, Any]) -> float | None:
    kvflow = (step.get("report") or {}).get("kvflow") or {}
    return kvflow.get("output_tokens_per_s")


def summarize(steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline figures, None where a step gave none."""
    summary: dict[str, Any] = {
        "output_tokens_per_s_graphs": _throughput(steps.get("throughput_graphs", {})),
        "output_tokens_per_s_eager": _throughput(steps.get("throughput_eager", {})),
    }
    host = steps.get("host_time", {}).get("report") or []
    for row in host if isinstance(host, list) else []:
        summary[f"host_ms_per_decode_step_batch{row['batch_size']}"] = row.get("host_ms")
        summary[f"step_ms_batch{row['batch_size']}"] = row.get("execute_ms")
    kernels = steps.get("bench_kernels", {}).get("report") or {}
    summary["kernel_times_ms"] = {
        f"{r['kernel']}/{r['impl']}": r["time_ms"] for r in kernels.get("results", [])
    }
    return summary


def collect(out_dir: Path) -> dict[str, Any]:
    raw = out_dir / "raw"
    names = sorted({p.stem for p in raw.glob("*.rc")} | {p.stem for p in raw.glob("*.skip")})
    steps = {name: collect_step(raw, name) for name in names}
    env = json.loads(_read(raw / "env.json") or "{}")
    if (raw / "stand_in.log").is_file():  # the benches and parity ran on random weights
        env["embedded_model"] = "random-weight stand-in (tests/gpu/embedded_stand_in.py)"
    failed = [n for n, s in steps.items() if s["status"] in ("failed", "timeout", "missing")]
    return {
        "env": env,
        "ok": not failed,
        "failed_steps": failed,
        "summary": summarize(steps),
        "steps": steps,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    result = collect(out_dir)
    path = out_dir / RESULT_FILE
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    status = "ok" if result["ok"] else f"FAILED: {', '.join(result['failed_steps'])}"
    print(f"GPU checks {status}; figures in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
