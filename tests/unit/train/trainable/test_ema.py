"""stk.train.trainable.ema: the EMA's decay ramp, its shares (contiguous ranges of the trainable weights whose union is
the whole, each rank's average equal to its part of a 1-rank average), checkpoint round trips (on the ranks that saved
them and on another number) and the refusals. The runs through stk-train (ZeRO-2 ranges and ZeRO-3 partitions on 2
ranks, against an EMA computed from each step's weights, 5 + resume + 5, and 2 ranks -> 1 -> 2) are in
tests/integration/: test_train.py, test_train_lora.py and test_train_worldsize.py."""

from __future__ import annotations

import pytest
import torch

from stk.errors import InputError
from stk.train.trainable.ema import ShardedEma, ema_decay


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    module[1].requires_grad_(False)  # frozen weights are not averaged
    return module


def train_steps(module: torch.nn.Module, emas: list[ShardedEma], steps: int) -> list[dict[str, torch.Tensor]]:
    """Change the weights as an optimizer would; each EMA updated after each step. Returns each step's weights."""
    seen = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in module.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.1)
        for ema in emas:
            ema.update(step)
        seen.append({k: v.clone() for k, v in module.named_parameters() if v.requires_grad})
    return seen


def test_the_decay_ramps_like_diffusers_ema_model():
    assert [ema_decay(k, 0.9999) for k in (1, 2, 3)] == [0.0, 2 / 11, 3 / 12]
    assert ema_decay(10_000, 0.9) == 0.9


def test_one_rank_averages_the_trained_weights_as_the_formula_says():
    module = model()
    ema = ShardedEma(module, decay=0.7, every=2, rank=0, world=1)
    seen = train_steps(module, [ema], 8)
    expected = seen[1]  # the first update (after step 2) takes the weights as they are
    for t, weights in enumerate(seen[3::2], start=1):  # steps 4, 6, 8
        decay = min(0.7, (1 + t) / (10 + t))
        expected = {k: decay * expected[k] + (1 - decay) * weights[k] for k in expected}
    assert ema.updates == 4
    assert torch.allclose(ema.shadow, torch.cat([v.flatten() for v in expected.values()]), rtol=1e-6, atol=1e-8)
    ema.apply()
    for name, param in module.named_parameters():
        if param.requires_grad:
            assert torch.allclose(param, expected[name], rtol=1e-6, atol=1e-8)
    assert torch.equal(module[1].weight, model()[1].weight)  # frozen: untouched


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_shares_cut_the_weights_into_ranges_that_average_as_one_rank(world):
    module = model()
    whole = ShardedEma(module, decay=0.9, every=1, rank=0, world=1)
    shards = [ShardedEma(module, decay=0.9, every=1, rank=r, world=world) for r in range(world)]
    train_steps(module, [whole, *shards], 5)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert [len(s.shadow) for s in shards] == [
        (r + 1) * trainable // world - r * trainable // world for r in range(world)
    ]
    assert torch.equal(torch.cat([s.shadow for s in shards]), whole.shadow)  # fp32, the same arithmetic


def test_a_checkpoint_round_trip_and_what_cannot_be_resumed(tmp_path):
    module = model()
    ema = ShardedEma(module, decay=0.9, every=1, rank=1, world=2)
    train_steps(module, [ema], 3)
    ema.save(str(tmp_path))
    assert (tmp_path / "ema" / "rank-00001.pt").is_file()
    again = ShardedEma(model(seed=5), decay=0.9, every=1, rank=1, world=2)
    again.load(str(tmp_path))
    assert torch.equal(again.shadow, ema.shadow) and again.updates == 3
    with pytest.raises(InputError, match="trained without --ema-decay"):
        ShardedEma(model(), decay=0.9, every=1, rank=0, world=2).load(str(tmp_path / "elsewhere"))
    with pytest.raises(InputError, match="between 0 and 1"):
        ShardedEma(model(), decay=1.0, every=1, rank=0, world=1)


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (2, 3), (1, 2), (3, 2)])
def test_shares_saved_on_n_ranks_are_cut_again_for_m(tmp_path, saved, resumed):
    module = model()
    before = [ShardedEma(module, decay=0.9, every=1, rank=r, world=saved) for r in range(saved)]
    train_steps(module, before, 3)
    for ema in before:
        ema.save(str(tmp_path))
    whole = torch.cat([ema.shadow for ema in before])
    after = [ShardedEma(model(seed=5), decay=0.9, every=1, rank=r, world=resumed) for r in range(resumed)]
    for ema in after:
        ema.load(str(tmp_path))
    assert torch.equal(torch.cat([ema.shadow for ema in after]), whole)
    assert [ema.updates for ema in after] == [3] * resumed and len({len(ema.shadow) for ema in after}) <= 2


def test_shares_of_other_weights_are_refused(tmp_path):
    module = model()
    for r in range(2):
        ShardedEma(module, decay=0.9, every=1, rank=r, world=2).save(str(tmp_path))
    wider = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.LayerNorm(9), torch.nn.Linear(9, 3))
    with pytest.raises(InputError, match="EMA saved on 2 ranks holds other weights"):
        ShardedEma(wider, decay=0.9, every=1, rank=0, world=1).load(str(tmp_path))
