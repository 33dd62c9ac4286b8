#!/usr/bin/env python3
"""One summary.json per GPU-machine session under benches/results.

A session folder (benches/results/DATE-GPU[-sN]) holds what benches/gpu_run.sh
left in /tmp/rocket-logs: `rocket bench` tables (NAME.txt) and their --json
reports (NAME.json), the PyTorch peer's reports (peer-*.json), test logs, power
samples and Nsight Compute exports. This script reads them and writes
FOLDER/summary.json: the date, GPU, commits and, per measured run (files named
runN-*; unprefixed files are the session's main run), the figures: every bench
row, the peer's times, the test results and the figure lines the GPU tests print
(MK-*, MATMUL, FENCE, ...), power and stall figures. The bench and peer JSON
reports stay beside it; the raw logs can go once the summary is written.

Usage: benches/summarize_results.py [--force] [FOLDER ...]
(default: every folder under benches/results). A folder that already has a
summary.json is left alone unless --force, and always once its raw logs are
gone (a new summary would have less in it).
"""
from __future__ import annotations

import csv
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import ncu_step  # benches/, beside this script

RESULTS = Path(__file__).resolve().parent / "results"

# Lines of test logs and probe output that carry a figure or a verdict.
FIGURE_LINE = re.compile(
    r"(MK-[A-Z]+|MATMUL|FENCE|HANDOFF|L2-LATENCY|STREAM|RING|PARITY|AGREE|TC-|F16-|GREEDY|test result:|ERROR SUMMARY|"
    r"RACECHECK|Hazard|panicked|FAILED|rc=\d)"
)
BENCH_HEADER = re.compile(r"model: (\S+)\s+device: (.+?)\s+commit: (\S+)")
BENCH_LOAD = re.compile(r"load ([\d.]+) s\s+weights/step ([\d.]+) GB\s+copy bandwidth (\S+)")
BENCH_TTFT = re.compile(r"TTFT ms \(p=(\d+)\)")
RUN_PREFIX = re.compile(r"^(run\d+)-(.*)$")

# The bench notes' entry for each run and its command, where its files do not record it
# (the bench tables of `gpu_run.sh ab` carry no command line). Key: (folder, run).
RUNS = {
    ("2026-12-03-h200-s13", "main"): ("Session 13 Run 3", "benches/gpu_final.sh"),
    ("2026-12-04-h200-s16", "main"): ("Session 16 Runs 1 and 4", "MK_TIMEOUT=240 SANITIZE_TOOLS=memcheck benches/gpu_run.sh mk ab long sanitize; BENCH_CONFIGS=default benches/gpu_run.sh bench peer"),
    ("2026-12-04-h200-s16", "run2"): ("Session 16 Run 2", 'POWER_LOG=1 AB_ENV="ROCKET_MK_LM_TILE=8|ROCKET_MK_LM_TILE=2" benches/gpu_run.sh ab abshort'),
    ("2026-12-04-h200-s16", "run3"): ("Session 16 Run 3", "ROCKET_LOG=info ROCKET_MK_TRACE_STEP=100 rocket bench ... --reps 1"),
    ("2026-12-04-h200-s16", "run5"): ("Session 16 Run 5", "AB_ENV=... benches/gpu_run.sh ab (hold per op)"),
    ("2026-12-04-h200-s16", "run6"): ("Session 16 Run 6", "MK_TIMEOUT=200 benches/gpu_run.sh mk ab"),
    ("2026-12-04-h200-s17", "run1"): ("Session 17 Run 1", 'MK_TIMEOUT=220 AB_ENV="ROCKET_MK_FUSED_CONTEXT=0" benches/gpu_run.sh mkfused ab'),
    ("2026-12-04-h200-s17", "run2"): ("Session 17 Run 2", 'MK_TIMEOUT=220 AB_ENV="ROCKET_MK_TAGGED=0" benches/gpu_run.sh mk ab'),
    ("2026-12-04-h200-s17", "run3"): ("Session 17 Run 3", 'POWER_LOG=1 AB_ENV="ROCKET_MK_TAGGED=0" benches/gpu_run.sh ab (plus variants/xu64.xz)'),
    ("2026-12-04-h200-s17", "run5"): ("Session 17 Runs 4-5", "ncu --replay-mode application -k regex:megakernel -c 1 --metrics regex:^smsp__average_warps_issue_stalled_.*"),
    ("2026-12-04-h200-s17", "run6"): ("Session 17 Run 6", "MK_TIMEOUT=220 BENCH_CONFIGS=default benches/gpu_run.sh mk bench peer"),
    ("2026-12-04-h200-s17", "run7"): ("Session 17 Run 7", 'ROCKET_MK_COUNTER_STRIDE=32 MK_TIMEOUT=200 benches/gpu_run.sh mk; AB_ENV="ROCKET_MK_COUNTER_STRIDE=32" benches/gpu_run.sh ab'),
    ("2026-12-04-h200-s17", "run8"): ("Session 17 Runs 8-9", "cuda-test --test-threads=1 --nocapture probe"),
    ("2026-12-04-h200-s17", "run9"): ("Session 17 Runs 8-9", "ROCKET_FIXTURES=... cuda-test --test-threads=1 --nocapture probe"),
    ("2026-12-04-h200-s18", "main"): ("Session 18 Run 1", "BENCH_CONFIGS=default benches/gpu_run.sh tests bench"),
    ("2026-12-04-h200-s18", "run2"): ("Session 18 Run 2", "MK_TIMEOUT=420 benches/gpu_run.sh mk peer"),
    ("2026-12-04-h200-s18", "run3"): ("Session 18 Run 3", "SANITIZE_TIMEOUT=250 benches/gpu_run.sh sanitize"),
    ("2026-12-04-h200-s19", "main"): ("Session 19 Run 2", 'FUELS="qwen3-0.6b llama-3.2-1b" MK_FILTER=sampled MK_TIMEOUT=150 benches/gpu_run.sh mk race'),
}


def _num(text: str) -> float | None:
    text = text.strip().rstrip("%")
    try:
        return float(text)
    except ValueError:
        return None


def _mean_std(cell: str) -> tuple[float | None, float | None]:
    parts = [p.strip() for p in cell.split("±")]
    return _num(parts[0]), (_num(parts[1]) if len(parts) > 1 else None)


def parse_bench_table(text: str) -> dict | None:
    """A `rocket bench` table as printed (stdout), or None if the text has none."""
    header = BENCH_HEADER.search(text)
    rows = []
    prompt_len = None
    for line in text.splitlines():
        if m := BENCH_TTFT.search(line):
            prompt_len = int(m.group(1))
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) < 9 or not cells[0].isdigit():
            continue
        ttft, ttft_std = _mean_std(cells[2])
        step, step_std = _mean_std(cells[4])
        rows.append({
            "batch": int(cells[0]),
            "decode_path": cells[1],
            "ttft_ms": ttft, "ttft_ms_std": ttft_std,
            "prefill_tokens_per_s": _num(cells[3]),
            "decode_ms_per_step": step, "decode_ms_per_step_std": step_std,
            "decode_tokens_per_s": _num(cells[5]),
            "effective_gbs": _num(cells[6]),
            "pct_of_copy_bandwidth": _num(cells[7]),
            "host_cpu_us_per_token": _num(cells[8]),
        })
    if not rows:
        return None
    out: dict = {"rows": rows, "prompt_len": prompt_len}
    if header:
        out.update(model=header.group(1), device=header.group(2), commit=header.group(3))
    if load := BENCH_LOAD.search(text):
        out.update(load_seconds=float(load.group(1)), weights_gb_per_step=float(load.group(2)),
                   copy_bandwidth_gbs=_num(load.group(3)))
    return out


def bench_from_json(report: dict) -> dict:
    keys = ("batch", "decode_path", "ttft_ms", "ttft_ms_std", "prefill_tokens_per_s", "decode_ms_per_step",
            "decode_ms_per_step_std", "decode_tokens_per_s", "effective_gbs", "pct_of_copy_bandwidth",
            "host_cpu_us_per_token")
    out = {k: report.get(k) for k in ("model", "device", "commit", "command", "load_seconds", "copy_bandwidth_gbs",
                                      "prompt_len", "gen_len", "reps", "sampling", "gpu_clocks")}
    if report.get("date_unix"):
        out["date"] = datetime.fromtimestamp(report["date_unix"], timezone.utc).isoformat(timespec="seconds")
    out["rows"] = [{k: r.get(k) for k in keys} for r in report.get("results", [])]
    return out


def peer_from_json(report: dict) -> dict:
    rows = []
    for r in report.get("results", []):
        for impl, fig in r.items():
            if isinstance(fig, dict) and "ms_per_step" in fig:
                rows.append({"batch": r.get("batch"), "impl": impl, "ms_per_step": fig["ms_per_step"].get("mean"),
                             "ttft_ms": fig.get("ttft_ms", {}).get("mean"), "pct_of_copy": fig.get("pct_of_copy")})
    return {k: report.get(k) for k in ("date", "device", "torch", "transformers", "command", "model",
                                       "copy_gbps", "prompt_len", "gen_len", "reps")} | {"rows": rows}


def power_from_csv(path: Path) -> dict | None:
    sm, watts, temp = [], [], []
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 5:
                continue
            try:
                sm.append(float(row[1].split()[0]))
                watts.append(float(row[3].split()[0]))
                temp.append(float(row[4]))
            except ValueError:
                continue
    if not sm:
        return None
    return {"samples": len(sm), "sm_mhz_min": min(sm), "sm_mhz_max": max(sm), "watts_mean": round(sum(watts) / len(watts), 1),
            "watts_max": max(watts), "temp_c_max": max(temp)}


def kernel_times_from_csv(path: Path) -> list[dict] | None:
    """Nsight Compute --csv with one metric a row (gpu__time_duration.sum alone, as gpu_run.sh's
    `profile` asks): launches and total µs per kernel name, the longest first."""
    totals = ncu_step.totals_by_kernel(ncu_step.duration_rows(path.read_text(errors="replace").splitlines()))
    out = [{"kernel": k, "launches": n, "us_total": round(us, 1)} for k, (n, us) in totals.items()]
    return sorted(out, key=lambda k: -k["us_total"]) or None


def stalls_from_csv(path: Path) -> list[dict] | None:
    """Nsight Compute --csv --page raw: per profiled kernel, its name and the stall metrics
    (or, for a one-metric-a-row CSV, the kernels' times: kernel_times_from_csv)."""
    rows = list(csv.reader(line for line in path.read_text(errors="replace").splitlines() if line.startswith('"')))
    if not rows:
        return None
    header = rows[0]
    if "Metric Name" in header:
        return kernel_times_from_csv(path)
    out = []
    for row in rows[1:]:
        if not row or not row[0].isdigit():
            continue  # the units row
        cells = dict(zip(header, row))
        metrics = {k: _num(v.replace(",", "")) for k, v in cells.items() if "stalled" in k}
        out.append({"kernel": cells.get("Kernel Name"), "metrics": metrics})
    return out or None


def other_lines(text: str) -> list[str]:
    """Lines of a bench's output besides its table (e.g. a traced step's profile)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("|") or line.startswith("==") or BENCH_HEADER.search(line) or BENCH_LOAD.search(line):
            continue
        if any(c.isdigit() for c in line):
            keep.append(line.rstrip())
    return keep


def figure_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if FIGURE_LINE.search(line)]


def summarize(folder: Path) -> dict:
    runs: dict[str, dict] = {}
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != "summary.json")
    jsons = {p.stem for p in files if p.suffix == ".json"}
    for p in files:
        m = RUN_PREFIX.match(p.name)
        run = runs.setdefault(m.group(1) if m else "main", {})
        name = p.stem
        if p.suffix == ".json":
            report = json.loads(p.read_text())
            if "copy_convention" in report or "torch" in report:
                run.setdefault("peer", []).append({"file": p.name} | peer_from_json(report))
            else:
                run.setdefault("benches", []).append({"file": p.name} | bench_from_json(report))
            continue
        if p.suffix == ".csv":
            if "power" in name:
                run["power"] = {"file": p.name} | (power_from_csv(p) or {})
            else:
                run.setdefault("stalls", []).append({"file": p.name, "kernels": stalls_from_csv(p)})
            continue
        text = p.read_text(errors="replace")
        if name in jsons:
            continue  # the JSON report carries the same table
        if (table := parse_bench_table(text)) is not None:
            extra = other_lines(text)
            run.setdefault("benches", []).append({"file": p.name} | table | ({"lines": extra} if extra else {}))
            continue
        if p.name == "gpu.txt":
            run["gpu"] = [line for line in text.splitlines()[1:] if line.strip()]
            continue
        if p.suffix == ".md":  # a table written by power_summary.py: keep its rows
            run.setdefault("tables", []).append({"file": p.name, "lines": [l for l in text.splitlines() if l.startswith("|")]})
            continue
        lines = figure_lines(text) or [l.rstrip() for l in text.splitlines() if l.strip() and not l.startswith("==")]
        if lines:
            run.setdefault("checks", []).append({"file": p.name, "lines": lines})
    commits = sorted({b["commit"] for r in runs.values() for b in r.get("benches", []) if b.get("commit")})
    devices = sorted({b["device"] for r in runs.values() for b in r.get("benches", []) if b.get("device")})
    date = re.match(r"\d{4}-\d{2}-\d{2}", folder.name)
    return {
        "folder": f"benches/results/{folder.name}",
        "date": date.group(0) if date else None,
        "gpu": devices,
        "commits": commits,
        "runs": {
            k: ({"notes_entry": RUNS[(folder.name, k)][0], "command": RUNS[(folder.name, k)][1]} if (folder.name, k) in RUNS else {}) | runs[k]
            for k in sorted(runs, key=lambda k: (k != "main", int(k[3:]) if k[3:].isdigit() else 0))
        },
    }


def render(summary: dict) -> str:
    return json.dumps(summary, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    force = "--force" in argv
    folders = [Path(a) for a in argv if a != "--force"] or sorted(p for p in RESULTS.iterdir() if p.is_dir())
    for folder in folders:
        target = folder / "summary.json"
        if target.exists() and not force:
            print(f"{target}: exists, left alone (--force rewrites it)")
            continue
        if target.exists() and not any(p.suffix != ".json" for p in folder.iterdir() if p.is_file()):
            print(f"{target}: left alone, the raw logs it came from are gone")
            continue
        summary = summarize(folder)
        target.write_text(render(summary))
        n = sum(len(r.get("benches", [])) for r in summary["runs"].values())
        print(f"{target}: {len(summary['runs'])} runs, {n} bench reports")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
