"""stk-train --fp8-matmuls: the repeated blocks' linear layers multiply in float8 (torchao's Float8Linear, whose
torch._scaled_mm the CPU runs too), for a full fine-tune and for the frozen base under a LoRA, against the same runs
in bf16.

Real DeepSpeed engines on the CPU, a tiny random-weight SD pipeline and its stk-cache cache (fixtures `scan` and
`setups`)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from support.commands import LOUD, run_train
from support.train_outputs import metrics

from stk.models import Family

pytestmark = pytest.mark.integration

ARGS = [*LOUD, "--no-validation", "--max-steps", 3]


def _runs(setups, tmp_path, extra: list) -> tuple[list[float], list[float], object]:
    """The losses of a bf16 run and of the same run with --fp8-matmuls, and the latter's process."""
    model, cache = setups(Family.SD)
    common = ["--cache", cache, "--model", model, *ARGS, *extra]
    bf16 = run_train([*common, "--output-dir", tmp_path / "bf16"], mpi=1)
    assert bf16.returncode == 0, bf16.stderr
    fp8 = run_train([*common, "--output-dir", tmp_path / "fp8", "--fp8-matmuls"], mpi=1)
    assert fp8.returncode == 0, fp8.stderr
    return [r["loss"] for r in metrics(tmp_path / "bf16")], [r["loss"] for r in metrics(tmp_path / "fp8")], fp8


@pytest.mark.parametrize(
    ("extra", "final"),
    [
        (["--deepspeed", "zero2"], "unet/diffusion_pytorch_model.safetensors"),
        (["--deepspeed", "zero3", "--lora-rank", 4], "pytorch_lora_weights.safetensors"),
    ],
    ids=["full-zero2", "lora-zero3"],
)
def test_fp8_matmuls_train_as_bf16_does_to_float8_rounding(setups, tmp_path, extra, final):
    """Each step's loss within float8's rounding of the bf16 run's (e4m3 keeps 3 mantissa bits: a matmul's output
    is off by about 1%), yet not equal to it: the float8 layers did the work; the final weights under the same
    names, for the same readers."""
    bf16, fp8, proc = _runs(setups, tmp_path, extra)
    assert "of the denoiser's" in proc.stderr and "linear layers multiply in float8" in proc.stderr, proc.stderr
    assert fp8 == pytest.approx(bf16, rel=0.05) and fp8 != bf16, (fp8, bf16)
    written = load_file(tmp_path / "fp8" / "final" / final)
    assert written.keys() == load_file(tmp_path / "bf16" / "final" / final).keys()
