"""Benchmark the start-up cost of one `stk-health check` process, the way cron and Slurm's
HealthCheckProgram pay it: every minute (cron) or every few minutes (Slurm) on every node.

    python bench/health.py [--runs 10]

Side by side, each as a fresh process, median of `--runs` runs after one warm-up run:

  * the interpreter alone: `python -c pass` (the floor every Python command pays);
  * `python -m stk.cli.health check` (on a machine without a GPU it ends at "no NVIDIA driver",
    exit 3, so the time is start-up, imports and nvmlInit failing: the fixed cost);
  * `nvidia-smi -q`, what sites run from cron today, when it is installed;
  * the import of stk.cli.health alone, from `python -X importtime`, with the heaviest packages
    it pulls in, and whether torch is among them (it must not be).

Target: `stk-health check` costs < 300 ms over the interpreter's own start. The script always
exits 0: it is a report, and a missed target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_OVERHEAD_S = 0.300
HEALTH = [sys.executable, "-m", "stk.cli.health", "check"]
_IMPORTTIME = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)$")


def clean_env(cache_dir: str) -> dict[str, str]:
    """No Slurm, MPI or STK_ settings (they would change what the check does), and the alert state
    in a temporary directory."""
    dropped = ("STK_", "SLURM_", "PMI_", "PMIX_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped) and k != "MPI_LOCALNRANKS"}
    env["XDG_CACHE_HOME"] = cache_dir
    return env


def wall_times(command: list[str], runs: int, env: dict[str, str]) -> tuple[list[float], int]:
    """Seconds per run of `command` (after one warm-up run), and its exit code."""
    code = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times, code


def import_profile(runs: int, env: dict[str, str]) -> tuple[list[float], dict[str, int], bool]:
    """Seconds to import stk.cli.health per run, the median cumulative microseconds of each module
    it imports directly, and whether torch was imported."""
    command = [sys.executable, "-X", "importtime", "-c", "import stk.cli.health"]
    totals: list[float] = []
    per_package: dict[str, list[int]] = {}
    torch = False
    for _ in range(runs + 1):
        lines = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stderr.splitlines()
        seen: dict[str, int] = {}
        for line in lines:
            match = _IMPORTTIME.match(line)
            if match is None:
                continue
            cumulative, depth, name = int(match[2]), len(match[3]) // 2, match[4]
            torch = torch or name.split(".")[0] == "torch"
            if name == "stk.cli.health":
                totals.append(cumulative / 1e6)
                break
            if depth == 0:  # the children listed so far belong to another module (site, encodings)
                seen.clear()
            elif depth == 1:
                seen[name] = cumulative
        for name, micros in seen.items():
            per_package.setdefault(name, []).append(micros)
    medians = {top: int(statistics.median(values)) for top, values in per_package.items()}
    return totals[1:], medians, torch  # the first run warms the page cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} cores, {platform.platform()}, load average {load} (1, 5, 15 min)")
    print(f"software: Python {platform.python_version()} ({sys.executable})")
    with tempfile.TemporaryDirectory(prefix="stk-bench-health-") as cache_dir:
        env = clean_env(cache_dir)
        rows = [("python -c pass", [sys.executable, "-c", "pass"])]
        rows.append(("stk-health check", HEALTH))
        smi = shutil.which("nvidia-smi")
        if smi:
            rows.append(("nvidia-smi -q", [smi, "-q"]))
        results = {}
        print(f"\n{'command':<22} {'exit':>4} {'runs':>4} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
        for label, command in rows:
            times, code = wall_times(command, args.runs, env)
            results[label] = statistics.median(times)
            print(
                f"{label:<22} {code:>4} {len(times):>4} {results[label] * 1e3:>10.1f} "
                f"{min(times) * 1e3:>8.1f} {max(times) * 1e3:>8.1f}"
            )
        imports, packages, torch = import_profile(args.runs, env)
        print(
            f"{'import stk.cli.health':<22} {'':>4} {len(imports):>4} {statistics.median(imports) * 1e3:>10.1f} "
            f"{min(imports) * 1e3:>8.1f} {max(imports) * 1e3:>8.1f}   (python -X importtime, cumulative)"
        )
    if not smi:
        print("nvidia-smi: not installed here (no NVIDIA driver): row skipped")

    heaviest = sorted(packages.items(), key=lambda item: -item[1])[:6]
    listed = ", ".join(f"{name} {us / 1e3:.1f}" for name, us in heaviest)
    print(f"heaviest direct imports of stk.cli.health (median ms, cumulative): {listed}")
    print(f"torch imported: {'YES (must not be)' if torch else 'no'}")

    floor, health = results["python -c pass"], results["stk-health check"]
    overhead = health - floor
    verdict = "PASS" if overhead < TARGET_OVERHEAD_S else "FAIL"
    print(f"\nstk-health check / python -c pass: {health / floor:.2f}x")
    target = f"target < {TARGET_OVERHEAD_S * 1e3:.0f} ms"
    print(f"overhead over the interpreter's start: {overhead * 1e3:.1f} ms   {target}   {verdict}")
    if smi:
        print(f"stk-health check / nvidia-smi -q: {health / results['nvidia-smi -q']:.2f}x")


if __name__ == "__main__":
    main()
