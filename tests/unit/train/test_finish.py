"""stk.train.finish: the summary line."""

from __future__ import annotations

from stk.train.finish import TrainSummary
from stk.train.loop import Outcome


def test_the_summary_names_the_samples_of_each_dataset_only_in_a_run_of_several() -> None:
    one = TrainSummary("out", Outcome.FINISHED, 4, 4, None, None, "out/final", 0.1, 1.0, 16.0, None, 1, {"h": 1})
    assert "samples_per_dataset" not in one.to_dict() and one.to_dict()["outcome"] == "finished"
    several = TrainSummary(**{**one.__dict__, "samples_per_dataset": {"photos": 8, "style": 8}})
    assert several.to_dict()["samples_per_dataset"] == {"photos": 8, "style": 8}
