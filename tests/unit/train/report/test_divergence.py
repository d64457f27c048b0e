"""stk.train.report.divergence and the agreement on a step's finiteness (stopping.agree): two real gloo ranks in forked
processes, where only one rank's loss is nan; the count of non-finite steps in a row and its one-line verdicts; the
check of the trained weights. The real run that diverges is tests/integration/test_train_divergence.py."""

from __future__ import annotations

import math
import multiprocessing
from typing import Any

import pytest
import torch

from stk.cluster.slurm import free_port
from stk.models import Family
from stk.train.checkpoint.checkpointer import Checkpointer
from stk.train.report.divergence import NonFiniteSteps, weights_finite
from stk.train.stopping import Agreement, agree

FORK = multiprocessing.get_context("fork")
CPU = torch.device("cpu")


def _rank(rank: int, port: int, losses: list[float], norms: list[float | None], results: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results.put((rank, agree(False, False, losses[rank], 7, CPU, norms[rank])))
    finally:
        dist.destroy_process_group()


def _agreed(losses: list[float], norms: list[float | None]) -> list[Agreement]:
    """What each of two ranks agreed, given each one's loss and gradient norm."""
    results = FORK.SimpleQueue()
    port = free_port()
    ranks = [FORK.Process(target=_rank, args=(rank, port, losses, norms, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        if process.is_alive():  # a hang is a failure, not a stuck test run
            process.kill()
        assert process.exitcode == 0
    return [agreed for _, agreed in sorted(results.get() for _ in ranks)]


def test_a_nan_loss_on_one_rank_is_seen_by_every_rank_naming_that_rank() -> None:
    both = _agreed([0.5, math.nan], [2.0, 2.0])
    assert repr(both[0]) == repr(both[1])  # nan == nan is false
    agreed = both[0]
    assert not agreed.finite and agreed.nonfinite_ranks == 1 and agreed.first_nonfinite == 1
    assert math.isnan(agreed.loss) and agreed.digest == 14 and not agreed.grad_norm_nonfinite


def test_an_infinite_gradient_norm_with_finite_losses_is_not_finite_either() -> None:
    both = _agreed([0.5, 0.25], [math.inf, None])  # a rank whose engine gives no norm says nothing about it
    assert both[0] == both[1]
    assert not both[0].finite and both[0].grad_norm_nonfinite and both[0].nonfinite_ranks == 0
    assert both[0].loss == 0.375 and both[0].first_nonfinite is None
    assert agree(False, False, 0.5, 1, CPU, 3.0).finite  # one process, no process group


def _step(nonfinite: bool) -> Agreement:
    return Agreement(False, False, math.nan if nonfinite else 0.1, 0, int(nonfinite), 0 if nonfinite else None)


def test_more_non_finite_steps_in_a_row_than_the_limit_stop_the_run_and_say_why(caplog) -> None:
    steps = NonFiniteSteps(limit=2, rank=0, total=4)  # 4 from before the resume
    for step, bad in enumerate([True, False, True, True], start=1):
        steps.record(step, _step(bad), world_size=2)
        assert not steps.exceeded
    assert (steps.total, steps.in_a_row) == (7, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3
    assert warnings[1] == (
        "step 3: the loss on rank 0 (1 of 2 ranks) not finite (nan or inf); not checkpointed; 1 such step(s) in a "
        "row, more than --max-nonfinite-steps 2 stop the run"
    )
    steps.record(5, Agreement(False, False, 0.1, 0, 0, None, grad_norm_nonfinite=True), world_size=2)
    assert steps.exceeded
    line = steps.diverged(5, steps.too_many(), "/run/checkpoints/step-00000002")
    assert line == (
        "training diverged at step 5: 3 steps in a row were not finite, more than --max-nonfinite-steps 2 (the "
        "first: step 3: the loss on rank 0 (1 of 2 ranks) not finite (nan or inf)); nothing from it was saved; the "
        "newest checkpoint, /run/checkpoints/step-00000002, is from before it: resume from it with a lower --lr "
        "(--resume-from /run/checkpoints/step-00000002 --override-resume), or start over with --resume none"
    )
    fresh = NonFiniteSteps(limit=0, rank=0)
    assert fresh.diverged(1, "the trained weights are not finite (nan or inf)", None) == (
        "training diverged at step 1: the trained weights are not finite (nan or inf); nothing from it was saved; "
        "no checkpoint was saved before it: rerun with a lower --lr"
    )


def test_only_rank_0_says_it() -> None:
    other = NonFiniteSteps(limit=0, rank=1)
    other.record(1, _step(True), world_size=2)
    assert other.exceeded and other.first.startswith("step 1: the loss on rank 0")


def test_a_checkpoint_postponed_by_a_non_finite_step_is_due_at_the_next_step() -> None:
    unused: Any = None  # the checkpoints and the trainable: `due` reads neither
    checkpointer = Checkpointer(unused, every=10, settings={}, seed=0, family=Family.SD, trainable=unused)
    assert not checkpointer.due(3, 100, stop=False) and checkpointer.due(10, 100, stop=False)
    checkpointer.postponed = True  # what the loop does when step 10 is not finite
    assert checkpointer.due(11, 100, stop=False)


@pytest.mark.parametrize("where", ["trained", "partition"])
def test_weights_are_finite_unless_a_trained_one_or_this_ranks_partition_of_it_is_not(where: str) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    module[0].requires_grad_(False)
    assert weights_finite(module, CPU)
    with torch.no_grad():
        module[0].weight[0, 0] = math.nan  # frozen: it cannot have changed, and is not looked at
    assert weights_finite(module, CPU)
    weight = module[1].weight
    if where == "partition":  # ZeRO-3: the parameter is an empty stand-in, the rank holds its share
        weight.ds_tensor = torch.tensor([1.0, math.inf])  # type: ignore[attr-defined]
    else:
        with torch.no_grad():
            weight[1, 2] = -math.inf
    assert not weights_finite(module, CPU)
