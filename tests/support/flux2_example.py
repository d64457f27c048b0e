"""diffusers' FLUX.2 training examples (examples/dreambooth/train_dreambooth_lora_flux2.py for FLUX.2-dev,
train_dreambooth_lora_flux2_klein.py for FLUX.2-klein) as the FLUX.2 families' tests compare stk with them: their
loss lines, transcribed, and their default LoRA target modules. The two examples' lines are the same but for the
guidance: dev's example always passes it, klein's where the transformer embeds it (the transcription's form; dev's
transformer does)."""

from __future__ import annotations

import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer

from stk.models import Family
from stk.models.interface import StepInputs
from stk.train.objective.objectives import objective_for
from stk.train.trainable.lora import LoraSettings, add_lora
from support.reference_steps import Reference, example_flow_loss

GUIDANCE_SCALE = 3.5  # the examples' --guidance_scale default


def example_step(pipeline_class: type, prompt_embeds: torch.Tensor, text_ids: torch.Tensor) -> Reference:
    """The examples' loss on the pipeline's own embeddings; stk's latents and noise, in the VAE's layout, are
    patchified first, as the examples patchify their latents."""

    def reference(transformer: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, sigmas: torch.Tensor):
        model_input = pipeline_class._patchify_latents(batch.latents)
        noise = pipeline_class._patchify_latents(noise)
        model_input_ids = pipeline_class._prepare_latent_ids(model_input).to(device=model_input.device)
        timesteps = sigmas * 1000  # the examples index the scheduler's timesteps; stk draws them continuously
        sigmas = sigmas.view(-1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed_noisy_model_input = pipeline_class._pack_latents(noisy_model_input)
        if transformer.config.guidance_embeds:
            guidance = torch.full([1], GUIDANCE_SCALE)
            guidance = guidance.expand(model_input.shape[0])
        else:
            guidance = None
        model_pred = transformer(
            hidden_states=packed_noisy_model_input,
            timestep=timesteps / 1000,
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=model_input_ids,
            return_dict=False,
        )[0]
        model_pred = model_pred[:, : packed_noisy_model_input.size(1) :]
        model_pred = pipeline_class._unpack_latents_with_ids(model_pred, model_input_ids)
        return example_flow_loss(model_pred, noise, model_input, sigmas)

    return reference


def assert_default_lora_targets_are_the_examples(family: Family, model: str, single_blocks: int) -> None:
    """stk's default targets adapt the layers of the example's target_modules, which list the single blocks'
    `attn.to_out` by index (up to `single_blocks`, the published model's); stk's `attn.to_out` names the same layers
    at any depth (not the double blocks' list of that name)."""
    objective = objective_for(family, model)
    ours = objective.load_denoiser(torch.float32)
    add_lora(ours, LoraSettings(rank=4), family, seed=0)
    target_modules = ["to_k", "to_q", "to_v", "to_out.0"] + [  # noqa: RUF005 (the examples' lines)
        "to_qkv_mlp_proj",
        *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(single_blocks)],
    ]
    theirs = objective.load_denoiser(torch.float32)
    theirs.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=target_modules))
    adapted = [{n for n, m in d.named_modules() if isinstance(m, LoraLayer)} for d in (ours, theirs)]
    assert adapted[0] == adapted[1]
    assert any(n.startswith("single_transformer_blocks.") and n.endswith("attn.to_out") for n in adapted[0])
