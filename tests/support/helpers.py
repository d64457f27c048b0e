"""What the tests share besides fixtures: how each command is run as users run it (a subprocess,
alone or under mpiexec, in a clean environment), what it printed, the processes it started, and
a local receiver for apprise alerts. Fixtures live in fixtures.py; test modules import from here (or
the other modules of tests/support/), never from one another."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from stk.lease import lease_name
from stk.models import Family
from stk.train.batch import StepInputs
from support.slurm_cluster import free_ports
from support.weed_server import S3_ENV, s3_client

__all__ = [
    "BIN",
    "CACHE",
    "CHANNELS",
    "EXTENSIONS_DIR",
    "FAST",
    "FRESH_EXTENSIONS_DIR",
    "LEASE_NAME",
    "LOUD",
    "MPIEXEC",
    "REPO",
    "S3_ENV",
    "SCAN",
    "STK_LAUNCH",
    "TEXT",
    "TRAIN",
    "TRAIN_IMAGES",
    "Mount",
    "Receiver",
    "Recorder",
    "RunScan",
    "board_scalars",
    "board_tags",
    "cache_command",
    "cache_env",
    "descendant_pids",
    "free_ports",
    "gpu",
    "kill_cache_ranks_when",
    "loader_threads",
    "metrics",
    "mpi_rank_pids",
    "one_error",
    "process_ended",
    "raising",
    "run_train",
    "s3_client",
    "scan_command",
    "scan_env",
    "step_inputs",
    "summary_of",
    "train_command",
    "train_env",
    "unimplemented_dds",
    "upload_cache",
    "without_dac_override",
]  # fmt: skip


REPO = Path(__file__).resolve().parents[2]  # the checkout: its bin/, etc/, sbatch/ and bench/
BIN = Path(sys.executable).parent
STK_LAUNCH = str(REPO / "bin" / "stk-launch")
MPIEXEC = BIN / "mpiexec"
SCAN = [sys.executable, "-m", "stk.cli.scan"]

RunScan = Callable[..., "subprocess.CompletedProcess[str]"]
Mount = Callable[[str, str], Path]


def scan_env() -> dict[str, str]:
    """The environment for a scan subprocess: no stray STK_/AWS_ settings, and no Slurm or MPI
    variables (they would change the GPU count, or make a plain run think it is a rank). STK_PYTHON stays:
    it names the venv under test to the checkout's bin/ scripts (make test sets it)."""
    dropped = ("STK_", "AWS_", "SLURM_", "PMI_", "PMIX_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped) or k == "STK_PYTHON"}
    env.pop("MPI_LOCALNRANKS", None)
    env.update(S3_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def scan_command(args: list[str], mpi: int = 0) -> list[str]:
    command = [*SCAN, *map(str, args)]
    return [str(MPIEXEC), "-n", str(mpi), *command] if mpi else command


def summary_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The one JSON summary line stk-scan prints on stdout."""
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one summary line on stdout, got {proc.stdout!r}; stderr:\n{proc.stderr}"
    summary: dict[str, Any] = json.loads(lines[0])
    return summary


CACHE = [sys.executable, "-m", "stk.cli.cache"]


def cache_env() -> dict[str, str]:
    """scan_env() with one torch thread per process. CPU results are bitwise equal across rank counts only at equal
    threads per rank: under mpiexec, Intel's OpenMP divides the cores among the node's ranks (MPI_LOCALNRANKS), and
    oneDNN's convolutions sum in another order with another thread count."""
    env = scan_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


def cache_command(args: list[Any], mpi: int = 0) -> list[str]:
    """stk-cache as users run it, alone or under `mpiexec -n MPI` (same clean env: scan_env())."""
    command = [*CACHE, *map(str, args)]
    return [str(MPIEXEC), "-n", str(mpi), *command] if mpi else command


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid` (mpiexec -> hydra proxy -> ranks), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_ended(pid: int, timeout: float) -> bool:
    """Whether `pid` has exited (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2] == "Z":
            return True
        time.sleep(0.05)
    return False


def mpi_rank_pids(mpiexec_pid: int, module: str) -> dict[int, int]:
    """{rank: pid} of the `python -m MODULE` processes that mpiexec started."""
    ranks = {}
    for pid in descendant_pids(mpiexec_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() not in cmdline or any(part.endswith(b"mpiexec") for part in cmdline):
            continue
        for item in environ:
            if item.startswith(b"PMI_RANK="):
                ranks[int(item.split(b"=", 1)[1])] = pid
    return ranks


def kill_cache_ranks_when(
    command: list[str], env: dict[str, str], ready: Callable[[], bool], what: str, victims: tuple[int, ...]
) -> subprocess.CompletedProcess[str]:
    """Run a 2-rank stk-cache, SIGKILL the `victims` ranks once `ready()` holds (`what` names that
    moment in a failure), and return the finished run; nothing of it is left running."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, f"the build ended before it could be killed: {proc.communicate()}"
            assert time.monotonic() < deadline, f"{what} after 120 s"
            time.sleep(0.01)
        ranks = mpi_rank_pids(proc.pid, "stk.cli.cache")
        assert sorted(ranks) == [0, 1], ranks
        for victim in victims:
            os.kill(ranks[victim], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


# --- a local HTTP receiver for apprise json:// alerts -----------------------------------


class Receiver:
    """An HTTP server that records the JSON bodies POSTed to it: on 127.0.0.1, or on `host` (the
    four-node cluster's bridge address, which its nodes reach)."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append({"path": self.path, **json.loads(self.rfile.read(length))})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.host, self.port = host, self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"json://{self.host}:{self.port}{path}"

    def events(self) -> list[str]:
        return [b["type"] for b in self.bodies]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def upload_cache(client: Any, cache: Path) -> str:
    """A copy of a local stk-cache directory in a new bucket of `client`'s server; its s3:// URL."""
    bucket = f"cache-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    for path in cache.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"cache/{path.relative_to(cache)}")
    return f"s3://{bucket}/cache"


# --- in-process CLI runs (click's CliRunner) --------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str | None]:
    """An environment for CliRunner: no STK_ settings, no Slurm or MPI launcher from the caller."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("STK_", "SLURM_"))}
    for name in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        env[name] = None
    env.update(extra)
    return env


# --- stk-train --------------------------------------------------------------------------

TRAIN = [sys.executable, "-m", "stk.cli.train"]
# DeepSpeed's ops build into a fresh directory per test session, as on a fresh machine, so every session takes
# the cold path: its first training run builds the shared-memory op (~60 s on 2 cores), its first offloaded one
# CPU Adam (~85 s). fixtures.py removes it at the end. TORCH_EXTENSIONS_DIR set for pytest keeps builds instead.
FRESH_EXTENSIONS_DIR = not os.environ.get("TORCH_EXTENSIONS_DIR")
EXTENSIONS_DIR = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or tempfile.mkdtemp(prefix="stk-torch-extensions-"))


def train_env() -> dict[str, str]:
    """scan_env() for DeepSpeed on the CPU: one torch thread per rank (bitwise-equal runs), the
    session's build directory for DeepSpeed's ops."""
    env = scan_env()
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR))
    return env


def train_command(args: list[Any], mpi: int = 0) -> list[str]:
    """stk-train as users run it, alone or under `mpiexec -n MPI`."""
    command = [*TRAIN, *map(str, args)]
    return [str(MPIEXEC), "-n", str(mpi), *command] if mpi else command


FAST = ["--batch-size", "1", "--lr", "1e-3", "--precision", "fp32", "-q"]
LOUD = [a for a in FAST if a != "-q"]  # warnings shown (a skipped checkpoint is one)


def run_train(
    args: list[Any], mpi: int = 2, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """stk-train under `mpiexec -n MPI` (2 ranks unless told), finished, with no traceback."""
    full_env = train_env()
    full_env.update(env or {})
    proc = subprocess.run(train_command(args, mpi), capture_output=True, text=True, env=full_env, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def board_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard shows for `tag`: every events file of the run read back, purges applied."""
    return [(e.step, e.value) for e in _board(directory).Scalars(tag)]


def board_images(directory: Path, tag: str) -> list[tuple[int, bytes]]:
    """The images TensorBoard shows for `tag`: (step, PNG bytes), purges applied."""
    return [(e.step, e.encoded_image_string) for e in _board(directory).Images(tag)]


def wandb_history(output_dir: Path) -> list[dict[str, Any]]:
    """The rows an offline W&B run logged (OUTPUT/wandb/offline-run-*/run-*.wandb), each {key: value, "_step": n}.
    The file is a LevelDB-style log of protobuf Records: a 7-byte file header, then 32 KiB blocks of records, each
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); wandb's own reader is in Go."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = output_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, position = path.read_bytes(), 32768, 7
    rows, pending = [], b""
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # the block's tail is padding
            position += room
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
    return rows


def board_tags(directory: Path) -> list[str]:
    return sorted(_board(directory).Tags()["scalars"])


def _board(directory: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def metrics(out: Path) -> list[dict[str, Any]]:
    """The rows of OUTPUT/metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


PROMPTS = ["a red square", "two blue circles", "x"]  # 3 over 2 ranks: under ZeRO-3 one rank makes a spare
SAMPLING = [arg for prompt in PROMPTS for arg in ("--validation-prompt", prompt)] + ["--validation-steps", "2"]


def sample_pngs(out: Path, step: int) -> dict[str, bytes]:
    """OUTPUT/samples/step-N/'s files by name."""
    return {p.name: p.read_bytes() for p in sorted((out / "samples" / f"step-{step:08d}").iterdir())}


def samples_match(pipe: Any, pngs: dict[str, bytes], guidance: float, steps: int = 2) -> bool:
    """Whether `pipe` (a diffusers pipeline, encoding each prompt itself) makes the sample images `pngs` of PROMPTS
    with their seeds (0, 1, ...) at 64x64: every pixel within one level, under 1% of them off at all."""
    import numpy as np
    import torch
    from PIL import Image

    torch.set_num_threads(1)  # as each rank runs
    for k, prompt in enumerate(PROMPTS):
        image = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, width=64, height=64,
                     generator=torch.Generator().manual_seed(k)).images[0]  # fmt: skip
        sample = next(png for name, png in pngs.items() if name.startswith(f"{k}-"))
        difference = np.abs(np.asarray(image, dtype=int) - np.asarray(Image.open(io.BytesIO(sample)), dtype=int))
        if difference.max() > 1 or (difference > 0).mean() >= 0.01:
            return False
    return True


TRAIN_IMAGES = 24  # one 64x64 bucket (sides 64-80 px at alignment 64)


# The tiny models' text embedding shapes per sample (stk.models.tiny) and latent channels.
TEXT: dict[Family, dict[str, tuple[int, ...]]] = {
    Family.SD: {"prompt_embeds": (77, 32)},
    Family.SDXL: {"prompt_embeds": (77, 96), "pooled_prompt_embeds": (64,)},
    Family.FLUX: {"prompt_embeds": (16, 48), "pooled_prompt_embeds": (32,)},
}
CHANNELS = {Family.SD: 4, Family.SDXL: 4, Family.FLUX: 16}


def step_inputs(family: Family, size: tuple[int, int] = (8, 8), batch: int = 2, seed: int = 0) -> StepInputs:
    """A random training micro-batch shaped for the tiny model of `family`."""
    g = torch.Generator().manual_seed(seed)
    return StepInputs(
        latents=torch.randn(batch, CHANNELS[family], *size, generator=g),
        text={name: torch.randn(batch, *shape, generator=g) for name, shape in TEXT[family].items()},
        original_size=torch.tensor([[100, 120], [64, 80]])[:batch],
        crop_top_left=torch.tensor([[3, 5], [0, 7]])[:batch],
    )


class Recorder(torch.nn.Module):
    """Stands in for a DeepSpeed engine (the model as `.module`, no `.config` of its own) and records each call."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        self.calls.append((args, kwargs, output[0]))
        return output


# --- scripted GPU readings (STK_HEALTH_SCRIPT) -------------------------------------------


def gpu(index: int, **readings: Any) -> dict[str, Any]:
    """One GPU's readings as a STK_HEALTH_SCRIPT file lists them: a healthy H100 unless `readings` say otherwise."""
    healthy = {"temperature": 40, "shutdown_temperature": 92, "ecc_volatile_uncorrectable": 0}
    return {"index": index, "uuid": f"GPU-0000000{index}", "name": "NVIDIA H100 80GB HBM3", **healthy, **readings}


def one_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The run ended with `code` and exactly one ERROR line holding every needle, and no traceback."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and "unexpected error" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(lines) == 1, proc.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]
    return lines[0]


def without_dac_override() -> tuple[str, ...]:
    """A prefix that makes permission checks apply: for root, setpriv dropping CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH (root still owns its files, but a 0555 directory is not writable and a 0000 one
    cannot be listed); nothing otherwise."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root bypasses permissions and setpriv (util-linux) is missing to drop that")
    caps = "-dac_override,-dac_read_search"
    return (setpriv, "--bounding-set", caps, "--inh-caps", caps)


def unimplemented_dds() -> bytes:
    """A 4x4 DDS of DXGI format 93, which Pillow 13's DDS plugin does not implement: `Image.open` raises
    NotImplementedError, as on some real DDS files (a plugin may raise anything, not only Pillow's usual kinds)."""
    pixel_format = struct.pack("<II4s5I", 32, 0x4, b"DX10", 0, 0, 0, 0, 0)  # DDPF_FOURCC, then a DX10 header
    header = struct.pack("<7I44x", 124, 0x1007, 4, 4, 0, 0, 0) + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0)
    return b"DDS " + header + struct.pack("<5I", 93, 3, 0, 1, 0) + bytes(64)


def raising(exc: BaseException) -> Callable[..., Any]:
    """A stand-in for a function (a decoder's `open_image`) that raises `exc` whatever it is given."""

    def raise_it(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return raise_it


def loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("stk-load", "stk-prefetch"))]


LEASE_NAME = lease_name("stk-train")
