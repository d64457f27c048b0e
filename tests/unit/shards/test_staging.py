"""stk.shards.staging: a later writer removes the .h5.tmp files of runs that died or failed, never one a live writer
holds."""

from __future__ import annotations

from pathlib import Path

from support.shard_records import Rank0, make_latent, make_text, staged

from stk.shards import ShardWriter


def test_a_new_writer_removes_dead_runs_staging_files_but_not_a_live_writers(tmp_path: Path) -> None:
    cache, work = str(tmp_path / "cache"), tmp_path / "work"
    live_rank0 = Rank0(cache)
    live = ShardWriter(cache, str(work), "live-r00000", 1 << 30, live_rank0)
    live.add_text(make_text(0, 5))  # its shard is open: live-r00000-00000.h5.tmp, locked
    dead = work / "dead-r00000-00003.h5.tmp"  # what a killed run leaves: nobody holds it
    dead.write_bytes(b"\0" * 4096)
    other = work / "notes.txt"
    other.write_text("not a staging file")
    assert [p.name for p in staged(work)] == [dead.name, "live-r00000-00000.h5.tmp"]

    ShardWriter(cache, str(work), "next-r00000", 1 << 30, Rank0(cache))
    assert [p.name for p in staged(work)] == ["live-r00000-00000.h5.tmp"]
    assert other.exists()

    live.add_latent(make_latent(1))  # the live writer goes on and publishes its shard
    live.close()
    assert [info.name for info in live_rank0.infos] == ["live-r00000-00000.h5"]
    assert staged(work) == []
