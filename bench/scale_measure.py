"""bench/scale.py's measurement of one command: its wall time and the peak RSS (VmHWM) of each of its ranks, up to its
exit or up to the first stderr line that matches a marker (then the command is killed: "up to the first batch").

Each rank's peak is read twice: by a poller that walks the command's process tree every POLL_S, and, for a rank that
exits normally, by a sitecustomize hook (on PYTHONPATH) that writes VmHWM at exit, so a peak in the last moments is
not missed. The rank is PMI_RANK (mpiexec's), else 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import scale_data  # noqa: F401  (puts the tests' support modules on the path)
from support.processes import descendant_pids

POLL_S = 0.05
RSS_DIR_ENV = "STK_BENCH_RSS_DIR"
EXIT_HOOK = f"""import atexit, os
def _stk_bench_peak():
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    path = os.path.join(os.environ["{RSS_DIR_ENV}"], f"{{os.environ.get('PMI_RANK', '0')}}-{{os.getpid()}}")
    with open(path, "w") as f:
        f.write(str(hwm))
if os.environ.get("{RSS_DIR_ENV}"):
    atexit.register(_stk_bench_peak)
"""


@dataclass
class Run:
    """One command: seconds to its exit (or to the marker), each rank's peak RSS in bytes, what it printed."""

    seconds: float
    peaks: dict[int, int]
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the marker
    marks: dict[str, float] = field(default_factory=dict)  # seconds from the start to the first line matching each

    def peak(self, rank: int = 0) -> int:
        return self.peaks.get(rank, 0)


def _python_peaks(root: int) -> dict[int, int]:
    """VmHWM of every Python process under `root` (itself included), by rank."""
    peaks: dict[int, int] = {}
    for pid in [root, *descendant_pids(root)]:
        try:
            if "python" not in os.path.basename(os.readlink(f"/proc/{pid}/exe")):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                found = re.search(rb"(?:^|\0)PMI_RANK=(\d+)", f.read())
            with open(f"/proc/{pid}/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            continue
        rank = int(found.group(1)) if found else 0
        peaks[rank] = max(peaks.get(rank, 0), hwm)
    return peaks


def _merge(into: dict[int, int], more: dict[int, int]) -> None:
    for rank, value in more.items():
        into[rank] = max(into.get(rank, 0), value)


def measured(command: list[str], env: dict[str, str], marks: dict[str, str] | None = None, stop: str = "") -> Run:
    """Run `command`; `marks` names regexes whose first matching stderr line is timed; at `stop` (one of them) the
    command's process group is killed and the peaks are those seen so far."""
    patterns = {name: re.compile(regex) for name, regex in (marks or {}).items()}
    with tempfile.TemporaryDirectory(prefix="stk-bench-rss-") as rss_dir:
        Path(rss_dir, "sitecustomize.py").write_text(EXIT_HOOK)
        env = {**env, RSS_DIR_ENV: rss_dir, "PYTHONPATH": os.pathsep.join([rss_dir, env.get("PYTHONPATH", "")])}
        started = time.perf_counter()
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        peaks: dict[int, int] = {}
        seen: dict[str, float] = {}
        err_lines: list[str] = []
        out: list[str] = []
        stopped = threading.Event()

        def read_stderr() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                err_lines.append(line)
                for name, pattern in patterns.items():
                    if name not in seen and pattern.search(line):
                        seen[name] = time.perf_counter() - started
                        if name == stop:
                            _merge(peaks, _python_peaks(proc.pid))
                            stopped.set()
                            os.killpg(proc.pid, signal.SIGKILL)

        def read_stdout() -> None:
            assert proc.stdout is not None
            out.append(proc.stdout.read())

        readers = [threading.Thread(target=read_stderr), threading.Thread(target=read_stdout)]
        for reader in readers:
            reader.start()
        while proc.poll() is None:
            if not stopped.is_set():
                _merge(peaks, _python_peaks(proc.pid))
            time.sleep(POLL_S)
        seconds = time.perf_counter() - started
        for reader in readers:
            reader.join()
        for hook in Path(rss_dir).glob("*-*"):
            _merge(peaks, {int(hook.name.split("-")[0]): int(hook.read_text() or 0)})
    killed = stopped.is_set()
    return Run(
        seen[stop] if killed else seconds,
        peaks,
        "".join(out),
        "".join(err_lines),
        None if killed else proc.returncode,
        seen,
    )
