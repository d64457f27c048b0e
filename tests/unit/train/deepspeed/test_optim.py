"""stk.train.deepspeed.optim: the optimizers with their DeepSpeed sections, and the LR schedule."""

from __future__ import annotations

import pytest
import torch

from stk.train.deepspeed.optim import OptimizerSettings, client_optimizer, lr_schedule, optimizer_section


def test_optimizers_and_their_deepspeed_sections():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2), requires_grad=False)]
    adamw = client_optimizer(params, OptimizerSettings(lr=0.1))
    assert isinstance(adamw, torch.optim.AdamW) and len(adamw.param_groups[0]["params"]) == 1
    lion = client_optimizer(params, OptimizerSettings("lion", lr=0.1, betas=(0.9, 0.99)))
    assert type(lion).__name__ == "Lion" and lion.param_groups[0]["betas"] == (0.9, 0.99)
    assert optimizer_section(OptimizerSettings("lion"))["type"] == "Lion"
    with pytest.raises(ValueError, match="adamw, lion"):
        client_optimizer(params, OptimizerSettings("sgd"))


@pytest.mark.parametrize(
    ("kind", "expected"), [("constant", [0.0, 0.5, 1.0, 1.0, 1.0]), ("cosine", [0.0, 0.5, 1.0, 0.5, 0.0])]
)
def test_lr_schedule_warms_up_then_holds_or_decays(kind, expected):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    schedule = lr_schedule(kind, warmup_steps=2, total_steps=4)(optimizer)
    used = []
    for _ in range(5):
        used.append(round(schedule.get_last_lr()[0], 6))
        optimizer.step()
        schedule.step()
    assert used == expected
