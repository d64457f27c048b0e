"""The small parts of stk-train that need no DeepSpeed run: the DeepSpeed config a run gets, the
optimizer and LR schedule, metrics truncation on resume, checkpoint pruning and the `latest`
pointer, the bucket check, and what counts as a GPU error."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from support.helpers import REPO, board_scalars, board_tags

from stk.errors import BatchCheckFailed, CheckpointDamaged, ExitCode, InputError, PreflightFailed
from stk.train.checkpoint import CheckpointDir, tag_for
from stk.train.dsconfig import PRESETS, builds_own_optimizer, load_deepspeed_config, training_config, zero_stage
from stk.train.metrics import MetricsLog
from stk.train.optim import OptimizerSettings, client_optimizer, lr_schedule, optimizer_section
from stk.train.preflight import _one_view, _ranges, check_buckets
from stk.train.stopping import StopSignals, is_gpu_error, is_out_of_memory, is_peer_failure, out_of_memory, peer_failed
from stk.world import World


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_get_stks_settings(preset):
    base = load_deepspeed_config(preset)
    assert zero_stage(base) == int(preset[4])
    config = training_config(base, 4, 2, 1.0, "bf16", None)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 1.0 and config["bf16"]["enabled"] is True
    assert "train_batch_size" not in config and "scheduler" not in config
    assert builds_own_optimizer(base) == preset.endswith("offload")
    assert base == load_deepspeed_config(preset), "the preset must not be changed in place"


def test_the_etc_presets_are_the_packaged_ones():
    etc = REPO / "etc" / "deepspeed"
    for preset in PRESETS:
        assert json.loads((etc / f"{preset}.json").read_text()) == load_deepspeed_config(preset)


def test_user_config_settings_owned_by_stk_are_overridden(tmp_path, caplog):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 999,
                                "train_micro_batch_size_per_gpu": 16, "scheduler": {"type": "WarmupLR"}}))  # fmt: skip
    config = training_config(
        load_deepspeed_config(str(path)), 2, 1, 0.5, "fp32", optimizer_section(OptimizerSettings())
    )
    assert config["train_micro_batch_size_per_gpu"] == 2 and "train_batch_size" not in config
    assert config["bf16"]["enabled"] is False and config["optimizer"]["type"] == "AdamW"
    assert "scheduler" not in config
    assert "train_micro_batch_size_per_gpu=16" in caplog.text


def test_a_user_config_that_names_an_optimizer_lets_deepspeed_build_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    assert builds_own_optimizer(load_deepspeed_config(str(path)))


@pytest.mark.parametrize(
    ("content", "message"),
    [("[1, 2]", "is a JSON object, not list"), ('{"fp16": {"enabled": true}}', "fp16 is not supported"),
     ("{", "not valid JSON")],
)  # fmt: skip
def test_bad_deepspeed_files(tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        load_deepspeed_config(str(path))


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


def test_metrics_rows_past_the_resumed_step_are_dropped(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=True)
    log.start(0)
    for step in range(1, 8):
        log.write({"step": step, "loss": 1.0 / step})
    log.close()
    with open(log.path, "a") as f:
        f.write('{"step": 8, "lo')  # torn by a kill
    log.start(5)
    log.write({"step": 6, "loss": 0.5})
    log.close()
    steps = [json.loads(line)["step"] for line in Path(log.path).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    MetricsLog(str(tmp_path / "other"), enabled=False).start(0)  # rank != 0: writes nothing
    assert not (tmp_path / "other").exists()


def test_tensorboard_holds_each_step_once_across_a_resume(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=True)  # tensorboard is the default
    log.start(0)
    for step in range(1, 8):
        log.write({"step": step, "epoch": 0.1 * step, "loss": 1.0 / step, "grad_norm": None, "time": 1e9 + step})
    log.close()  # killed after step 7; the last checkpoint was step 5
    log.start(5)
    for step in (6, 7, 8):
        log.write({"step": step, "loss": 10.0 + step, "time": 2e9 + step})
    log.close()
    loss = board_scalars(tmp_path / "tensorboard", "train/loss")
    assert [step for step, _ in loss] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [value for _, value in loss][4:] == pytest.approx([0.2, 16.0, 17.0, 18.0])
    assert board_tags(tmp_path / "tensorboard") == ["train/loss"]  # not the step, epoch, time, nor a None
    (tmp_path / "quiet").mkdir()
    quiet = MetricsLog(str(tmp_path / "quiet"), enabled=True, report_to="none")
    quiet.start(0)
    quiet.write({"step": 1, "loss": 1.0})
    quiet.close()
    assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == ["metrics.jsonl"]


def test_wandb_resumes_its_own_run_and_a_missing_wandb_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for resumed in (0, 2):
        log = MetricsLog(str(tmp_path), enabled=True, report_to="wandb")
        log.start(resumed)
        log.write({"step": resumed + 1, "loss": 1.0})
        log.close()
    run_id = (tmp_path / "wandb" / "stk-run-id").read_text().strip()
    runs = list(tmp_path.glob("wandb/offline-run-*"))  # two runs in one second: the second folder ends in "-1"
    assert len(runs) == 2 and all((run / f"run-{run_id}.wandb").is_file() for run in runs)
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a package that is not installed
    with pytest.raises(InputError, match=r"wandb is not installed \(pip install 'stk\[wandb\]'\)"):
        MetricsLog(str(tmp_path / "other"), enabled=True, report_to="wandb")


def test_prune_keeps_the_newest_complete_and_drops_torn_newer_ones(tmp_path):
    checkpoints = CheckpointDir(str(tmp_path), keep=2, rank=0)
    for step in (1, 2, 3, 9):
        (tmp_path / "checkpoints" / tag_for(step)).mkdir(parents=True)
    checkpoints._prune(keep_tag=tag_for(3))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [tag_for(2), tag_for(3)]


def test_resume_resolution(tmp_path):
    checkpoints = CheckpointDir(str(tmp_path), keep=1, rank=0)
    assert checkpoints.resolve("auto", World()) is None and checkpoints.resolve("none", World()) is None
    (tmp_path / "checkpoints" / tag_for(4)).mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text(tag_for(4))
    resume = checkpoints.resolve("auto", World())  # saved without digests: resumed as it is (with a warning)
    assert resume is not None and resume.tag == tag_for(4) and resume.directory == checkpoints.path
    assert checkpoints.resolve(str(tmp_path / "checkpoints" / tag_for(4)), World()) == resume
    (tmp_path / "checkpoints" / "latest").write_text(tag_for(5))
    with pytest.raises(CheckpointDamaged, match="not there, and no other checkpoint lists its files"):
        checkpoints.resolve("auto", World())
    with pytest.raises(InputError, match="keep at least 1"):
        CheckpointDir(str(tmp_path), keep=0, rank=0)


def test_short_buckets_fail_or_get_their_minimum_repeats():
    buckets = {(8, 8): ["a", "b", "c"], (8, 16): ["d"] * 10}
    with pytest.raises(BatchCheckFailed) as failed:
        check_buckets(buckets, {(8, 8): 1, (8, 16): 1}, 8, 8, oversubscribe=False)
    message = str(failed.value)
    assert "1 bucket(s)" in message and "(64x64): 3 images, 3 samples; needs --repeats >= 3" in message
    assert check_buckets(buckets, {(8, 8): 1, (8, 16): 1}, 8, 8, oversubscribe=True) == {(8, 8): 3, (8, 16): 1}
    assert check_buckets(buckets, {(8, 8): 3, (8, 16): 1}, 8, 8, oversubscribe=False) == {(8, 8): 3, (8, 16): 1}


def test_rank_ranges_read_well():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and _ranges([3]) == "3"


def test_gpu_errors_are_told_from_code_errors():
    assert is_gpu_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_gpu_error(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error"))
    assert not is_gpu_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_gpu_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_gpu_error(ValueError("CUDA error"))


def test_out_of_memory_on_the_gpu_or_the_host_is_one_line_about_the_batch():
    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.25 GiB "
        "is free.\nIncluding non-PyTorch memory, this process has 77.8 GiB memory in use."
    )
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # the CPU allocator refuses 1 PiB with a RuntimeError
    except RuntimeError as exc:
        host = exc
    for exc, where, detail in ((cuda, "GPU", "CUDA out of memory. Tried to allocate 2.00 GiB"),
                               (host, "host", "DefaultCPUAllocator: can't allocate memory")):  # fmt: skip
        assert is_out_of_memory(exc) and not is_gpu_error(exc)
        error = out_of_memory(exc, 16)
        message = str(error)
        assert error.exit_code == 3 and "\n" not in message
        assert message.startswith(f"out of {where} memory at --batch-size 16: {detail}"), message
        assert "--grad-accum" in message and "--lora-rank" in message
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37091: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def test_a_peer_that_went_away_is_infra_in_one_line_not_a_gpu_fault_or_a_bug():
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation")
    assert is_peer_failure(RuntimeError(GLOO_RESET)) and is_peer_failure(timeout)
    nccl = torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error")
    assert is_peer_failure(nccl)
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    error = peer_failed(RuntimeError(GLOO_RESET), 0, "node1", 15)
    assert error.exit_code == ExitCode.INFRA
    assert str(error).startswith("rank 0 on node1: a peer rank failed, stopped answering or was cut off: Read error ")
    assert "Connection reset by peer;" in str(error) and "GLHF" not in str(error) and "\n" not in str(error)
    assert "(no answer within --collective-timeout 15 s)" in str(peer_failed(timeout, 1, "node2", 15))


def test_stop_signals_in_the_step_loop_are_recorded_not_fatal():
    signals = StopSignals().install()
    signals.defer()  # the step loop runs (before it a signal ends the run: test_train_opbuilds.py)
    try:
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGTERM)
        assert signals.received == "SIGUSR2"  # the first one names the reason
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_ranks_that_see_other_output_dirs_are_grouped_by_node_the_odd_ones_last():
    """What four nodes see when node c mounts a copy of the directory and node d cannot list it."""
    reports = [(0, "a", (0, 1, 2)), (1, "a", (0, 1, 2)), (2, "b", (0, 1, 2)), (3, "c", (3,)), (4, "d", ())]
    with pytest.raises(PreflightFailed) as caught:
        _one_view("/shared/run", reports, 5)
    assert str(caught.value).splitlines()[:4] == [
        "--output-dir /shared/run is not one directory shared by every rank:",
        "  a, b, rank(s) 0-2: see the files of rank(s) 0-2 only",
        "  c, rank(s) 3: see the files of rank(s) 3 only",
        "  d, rank(s) 4: see no rank's files",
    ]
    _one_view("/shared/run", [(0, "a", (0, 1)), (1, "b", (0, 1))], 2)  # every rank saw every token
