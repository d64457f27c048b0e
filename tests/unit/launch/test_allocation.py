"""stk.launch.allocation: the hosts and slots of a run, from Slurm's variables or given by hand."""

from __future__ import annotations

import pytest

from stk.cluster.slurm import hostnames
from stk.errors import InputError
from stk.launch.allocation import Allocation, read_allocation

# --- the allocation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slurm", "slots"),
    [
        ({"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "4"}, 8),
        ({"SLURM_GPUS_PER_NODE": "h100:8"}, 8),
        ({"SLURM_GPUS_PER_NODE": "gpu:h100:4,gpu:a100:2"}, 6),
        ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
    ],
)
def test_slots_per_node_come_from_the_gpus_slurm_gives(slurm, slots):
    allocation = read_allocation({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "7", **slurm})
    assert allocation == Allocation(("gpu01", "gpu02"), slots, "7")
    assert allocation.hostfile() == f"gpu01 slots={slots}\ngpu02 slots={slots}\n"
    assert read_allocation({"SLURM_JOB_NODELIST": "gpu01", **slurm}, slots=2).slots == 2  # the option wins


def test_outside_an_allocation_hosts_and_slots_must_be_given():
    assert read_allocation({}, "a,b", 2) == Allocation(("a", "b"), 2, None)
    with pytest.raises(InputError, match="not inside a Slurm allocation"):
        read_allocation({})
    with pytest.raises(InputError, match="give --slots-per-node"):
        read_allocation({}, "a,b")
    with pytest.raises(InputError, match="names a host twice"):
        read_allocation({}, "a,a", 1)


def test_node_list_is_expanded_without_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol needed
    assert hostnames("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
