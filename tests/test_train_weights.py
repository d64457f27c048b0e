"""Loading the denoiser tensor by tensor (stk.train.weights): the same weights diffusers' from_pretrained gives, in
the training dtype, from one file or shards; damaged or foreign files refused in one line; and under ZeRO-3, two
real MPI ranks that each hold half of every weight, filled from rank 0's reads."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel
from support.helpers import MPIEXEC, train_env

from stk.errors import InputError
from stk.models import Family, build_tiny_model
from stk.train.objectives import objective_for
from stk.train.weights import load_weights, weight_files


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build_tiny_model(Family.SDXL, str(tmp_path_factory.mktemp("weights") / "sdxl")))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-from-an-fp32-file"])
def test_the_same_weights_as_from_pretrained_in_the_training_dtype(sdxl, dtype):
    expected = UNet2DConditionModel.from_pretrained(sdxl, subfolder="unet", torch_dtype=dtype)
    files = weight_files(sdxl / "unet")
    assert files is not None
    loaded = load_weights(UNet2DConditionModel, dict(expected.config), files, dtype)
    assert same_weights(loaded, expected)
    denoiser = objective_for(Family.SDXL, str(sdxl)).load_denoiser(dtype)  # the path stk-train takes
    assert same_weights(denoiser, expected) and all(p.requires_grad for p in denoiser.parameters())


def test_sharded_weights_load_from_their_index(tmp_path):
    model = Path(build_tiny_model(Family.FLUX, str(tmp_path / "flux")))
    whole = FluxTransformer2DModel.from_pretrained(model, subfolder="transformer")
    whole.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    files = weight_files(tmp_path / "sharded")
    assert files is not None and len(files) > 1
    assert same_weights(load_weights(FluxTransformer2DModel, dict(whole.config), files, torch.float32), whole)


def test_a_folder_without_safetensors_has_no_weight_files(tmp_path):
    assert weight_files(tmp_path) is None


def test_a_damaged_file_is_one_line_naming_it(sdxl, tmp_path):
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    files = weight_files(tmp_path)
    assert files is not None
    with pytest.raises(InputError, match=r"cannot load .*diffusion_pytorch_model.safetensors: ") as error:
        load_weights(UNet2DConditionModel, UNet2DConditionModel.load_config(sdxl / "unet"), files, torch.float32)
    assert "\n" not in str(error.value)


def test_weights_of_another_config_are_refused_naming_what_differs(sdxl, tmp_path):
    config = UNet2DConditionModel.load_config(sdxl, subfolder="unet")
    files = weight_files(sdxl / "unet")
    assert files is not None
    wider = {**config, "block_out_channels": [c * 2 for c in config["block_out_channels"]]}
    fewer = {**config, "layers_per_block": config["layers_per_block"] + 1}
    with pytest.raises(InputError, match=r"unet: the weights do not fit the config \(\d+ missing, e.g. down_blocks"):
        load_weights(UNet2DConditionModel, fewer, files, torch.float32)
    with pytest.raises(InputError, match=r"\(\d+ of another shape, e.g. \w"):
        load_weights(UNet2DConditionModel, wider, files, torch.float32)


PARTITIONED = textwrap.dedent(
    """
    import json, os, sys
    import deepspeed, torch
    from stk.world import get_world
    from stk.train.distributed import init_distributed, resolve_dist_env
    from stk.train.engine import engine_config
    from stk.train.dsconfig import load_deepspeed_config
    from stk.train.options import TrainOptions
    from stk.models import Family
    from stk.train.objectives import objective_for

    model, out, precision = sys.argv[1:]
    world = get_world()
    init_distributed(resolve_dist_env(world, os.environ), backend="gloo")
    config = engine_config(TrainOptions(model=model, output_dir=out), load_deepspeed_config("zero3"), precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    unet = objective_for(Family.SDXL, model).load_denoiser(dtype, world, config)
    held = sum(p.ds_tensor.numel() for p in unet.parameters())
    total = sum(p.ds_numel for p in unet.parameters())
    weights = {}
    for name, p in unet.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            weights[name] = p.detach().clone()
    if world.rank == 0:
        torch.save(weights, os.path.join(out, "gathered.pt"))
    with open(os.path.join(out, f"rank{world.rank}.json"), "w") as f:
        json.dump({"held": held, "total": total, "dtypes": sorted({str(p.dtype) for p in unet.parameters()})}, f)
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.integration
def test_under_zero3_each_rank_holds_half_and_the_gathered_weights_are_the_files(sdxl, tmp_path):
    precision = "bf16"  # from an fp32 file: the cast happens as rank 0 reads
    script = tmp_path / "partitioned.py"
    script.write_text(PARTITIONED)
    command = [str(MPIEXEC), "-n", "2", sys.executable, str(script), str(sdxl), str(tmp_path), precision]
    proc = subprocess.run(command, capture_output=True, text=True, env=train_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    total = ranks[0]["total"]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert all(r["dtypes"] == [str(dtype)] for r in ranks)
    assert all(r["held"] <= total / 2 + 64 * 1024 for r in ranks), ranks  # half, plus each tensor's padding
    gathered = torch.load(tmp_path / "gathered.pt")
    expected = UNet2DConditionModel.from_pretrained(sdxl, subfolder="unet", torch_dtype=dtype).state_dict()
    assert gathered.keys() == expected.keys()
    assert all(torch.equal(gathered[k], expected[k]) for k in expected)
