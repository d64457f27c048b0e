"""Loading the denoiser tensor by tensor (stk.train.trainable.weights): the same weights diffusers' from_pretrained
gives, in the training dtype, from one file or shards; damaged or foreign files refused in one line. Under ZeRO-3:
tests/integration/test_train_weights.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

from stk.errors import InputError
from stk.models import Family, build_tiny_model
from stk.models.weightfiles import weight_files
from stk.train.objective.objectives import objective_for
from stk.train.trainable.weights import load_weights


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


def test_a_persistent_buffer_loads_from_the_file(tmp_path):
    """SD3's position table is stored beside the parameters: read from the file (not recomputed from the config), in
    the training dtype, as from_pretrained reads it."""
    model = Path(build_tiny_model(Family.SD3, str(tmp_path / "sd3")))
    stored = SD3Transformer2DModel.from_pretrained(model, subfolder="transformer")
    stored.pos_embed.pos_embed.mul_(2)
    stored.save_pretrained(tmp_path / "transformer")
    files = weight_files(tmp_path / "transformer")
    assert files is not None
    loaded = load_weights(SD3Transformer2DModel, dict(stored.config), files, torch.bfloat16)
    expected = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer", torch_dtype=torch.bfloat16)
    assert same_weights(loaded, expected)
    assert torch.equal(loaded.pos_embed.pos_embed, stored.pos_embed.pos_embed.bfloat16())


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


def test_each_linear_layer_is_quantised_as_soon_as_it_is_filled(tmp_path, monkeypatch):
    """With --base-precision int8 every linear layer is quantised the moment its tensors are in: no two layers are
    ever held unquantised at once (the base never exists whole in bf16), and the base ends at about half its bytes,
    measured from each tensor's storage (torchao's int8 data and scales included)."""
    from torchao.utils import get_model_size_in_bytes

    from stk.train.trainable.baseprecision import quantizer

    torch.manual_seed(0)  # FLUX.1's layout at a width of 512
    FluxTransformer2DModel(
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=512,
        pooled_projection_dim=512,
        axes_dims_rope=(32, 48, 48),
        guidance_embeds=True,
    ).to(torch.bfloat16).save_pretrained(tmp_path)
    config, files = FluxTransformer2DModel.load_config(tmp_path), weight_files(tmp_path)
    assert files is not None
    built: list[torch.nn.Module] = []  # the module load_weights fills, seen from the hook
    from_config = FluxTransformer2DModel.from_config
    monkeypatch.setattr(
        FluxTransformer2DModel,
        "from_config",
        classmethod(lambda cls, *a, **k: built.append(from_config(*a, **k)) or built[0]),
    )
    quantise, unquantised = quantizer("int8"), []

    def on_layer(layer: torch.nn.Module) -> None:
        linears = [m for m in built[0].modules() if isinstance(m, torch.nn.Linear)]
        unquantised.append(sum(isinstance(m.weight, torch.nn.Parameter) and not m.weight.is_meta for m in linears))
        quantise(layer)

    quantised = load_weights(FluxTransformer2DModel, config, files, torch.bfloat16, on_layer)
    assert max(unquantised) == 1 and len(unquantised) > 20
    monkeypatch.undo()
    plain = load_weights(FluxTransformer2DModel, config, files, torch.bfloat16)
    assert 0.49 < get_model_size_in_bytes(quantised) / get_model_size_in_bytes(plain) < 0.56
    linears = [m for m in quantised.modules() if isinstance(m, torch.nn.Linear)]
    assert all(type(m.weight).__name__ == "Int8Tensor" for m in linears)
