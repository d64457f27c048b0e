"""stk-train --compile: the denoiser's repeated blocks compiled by torch.compile (inductor's C++ code on the CPU),
trained with gradient checkpointing and a LoRA under ZeRO-2, resumed, and a machine without a compiler.

Real DeepSpeed engines on the CPU, a tiny random-weight SD pipeline and its stk-cache cache (fixtures `scan` and
`setups`), the real g++."""

from __future__ import annotations

import re
import shutil

import pytest
from support.commands import FAST, one_error, run_train, summary_of
from support.train_outputs import metrics

from stk.models import Family
from stk.train.trainable.compiled import CACHE_DIR

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler: torch.compile cannot build on the CPU"),
]

# rank 0's set-up lines shown (the compile line, the warning), no samples
LOUD = [a for a in FAST if a != "-q"] + ["--no-validation", "--deepspeed", "zero2", "--lora-rank", 4]


@pytest.fixture(scope="module")
def eager(setups, tmp_path_factory) -> list[float]:
    """The losses of 4 eager steps, the runs below' reference."""
    model, cache = setups(Family.SD)
    out = tmp_path_factory.mktemp("eager") / "run"
    proc = run_train(["--cache", cache, "--model", model, "--output-dir", out, "--max-steps", 4, *LOUD], mpi=1)
    assert proc.returncode == 0, proc.stderr
    return [r["loss"] for r in metrics(out)]


def test_compiled_blocks_train_as_eager_do_and_resume(setups, eager, tmp_path):
    """2 compiled steps, then 2 more resumed from their checkpoint: the losses of the eager run to float rounding
    (inductor fuses and reorders), the code generated once and found in OUTPUT/compile-cache by the resumed run."""
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    common = ["--cache", cache, "--model", model, "--output-dir", out, "--compile", "default", *LOUD]
    first = run_train([*common, "--max-steps", 2], mpi=1)
    assert first.returncode == 0, first.stderr
    compiled = re.search(r"--compile default: (\d+) blocks \(BasicTransformerBlock\)", first.stderr)
    assert compiled and int(compiled.group(1)) > 1, first.stderr
    assert "gradient checkpointing on" in first.stderr
    assert any((out / CACHE_DIR).rglob("*.so")), "no compiled code in the run's cache"
    second = run_train([*common, "--max-steps", 4], mpi=1)
    assert second.returncode == 0, second.stderr
    assert summary_of(second)["resumed_from"].endswith("step-00000002")
    assert "failed to compile" not in first.stderr + second.stderr
    losses = [r["loss"] for r in metrics(out)]
    # inductor's fused kernels round differently from the first forward on, and Adam's update magnifies the last
    # bits of near-zero gradients: far below the steps' 10% spread
    assert losses == pytest.approx(eager, rel=1e-3), (losses, eager)


def test_compile_without_a_compiler_is_one_line_before_any_weight_loads(setups, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--compile", "default", "--max-steps", 1, *LOUD]
    proc = run_train(args, mpi=1, env={"CXX": str(tmp_path / "no-such-g++")})
    one_error(proc, 3, "--compile default", "C++ compiler", "no-such-g++")
    assert "DeepSpeed ZeRO" not in proc.stderr and not (out / "checkpoints").exists()


def test_a_block_that_fails_to_compile_turns_the_run_eager_with_one_warning(setups, eager, tmp_path):
    """A C++ compiler that answers `--version` (so the check before the weights passes) but fails on inductor's code,
    as one without OpenMP's headers does: one warning line, and the run trains on eager, as the eager run does."""
    model, cache = setups(Family.SD)
    cxx = tmp_path / "g++-without-openmp"
    cxx.write_text(
        "#!/bin/sh\n"
        'case "$*" in *compile-cache*) echo "fatal error: omp.h: No such file or directory" >&2; exit 1;; esac\n'
        'exec g++ "$@"\n'
    )
    cxx.chmod(0o755)
    out = tmp_path / "run"
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--compile", "default", "--max-steps", 2, *LOUD]
    proc = run_train(args, mpi=1, env={"CXX": str(cxx)})
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "failed to compile" in line]
    assert len(warnings) == 1 and "the run goes on eager" in warnings[0], proc.stderr
    assert [r["loss"] for r in metrics(out)] == pytest.approx(eager[:2], rel=1e-6)
