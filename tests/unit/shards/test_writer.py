"""stk.shards' writer: shards roll over and round-trip bit for bit, latents and texts together, a killed or failed
writer leaves nothing listed, bad samples refused, several writers make one cache, shards moved from another work
directory."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.shard_records import SHAPES, Rank0, assert_same_latent, assert_same_text, make_latent, make_text, write

from stk import storage
from stk.shards import (
    CacheReader,
    LatentRecord,
    Manifest,
    ShardWriter,
    TextRecord,
    shard_location,
    verify,
)

# --- writing and reading ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("logvar", [False, True])
def test_shards_roll_over_and_latents_round_trip_bit_for_bit(cache: str, dtype: str, logvar: bool) -> None:
    latents = [make_latent(i, SHAPES[i % 3], dtype, logvar) for i in range(40)]
    rank0 = write(cache, latents)
    assert len(rank0.infos) >= 4, "a tiny shard_size must roll over"
    assert [info.name for info in rank0.infos] == [f"r0-{n:05d}.h5" for n in range(len(rank0.infos))]
    assert sorted(k for info in rank0.infos for k in info.latent_keys) == sorted(s.key for s in latents)
    with CacheReader(cache) as reader:
        assert reader.latent_keys() == sorted(s.key for s in latents)
        for sample in reversed(latents):
            got = reader.latent(sample.key)
            assert_same_latent(got, sample)
            assert got.mean.flags.writeable
        with pytest.raises(KeyError, match="not in the cache"):
            reader.latent("f" * 40)


def test_plain_h5py_reads_a_shard(cache: str) -> None:
    """Chunks written by stk are what HDF5's Zstd filter reads: any h5py + hdf5plugin reads them."""
    import hdf5plugin  # noqa: F401  (registers the Zstd filter)

    latents = [make_latent(i, logvar=True) for i in range(5)]
    rank0 = write(cache, latents, [make_text(0, 3)], shard_size=1 << 30)
    with h5py.File(shard_location(cache, rank0.infos[0].name), "r") as f:
        group = f["latents/4x8x8"]
        assert group.attrs["dtype"] == "<f2"
        for row, sample in enumerate(latents):
            assert group["key"][row].decode() == sample.key
            assert np.array_equal(group["mean"][row], sample.mean)
            assert np.array_equal(group["logvar"][row], sample.logvar)
            assert group["path"].asstr()[row] == sample.path
            assert tuple(group["original_size"][row]) == sample.original_size
        assert group["mean"].id.get_create_plist().get_filter(0)[0] == 32015  # hdf5plugin's Zstd
        assert list(f["text"].attrs["arrays"]) == ["pooled_prompt_embeds", "prompt_embeds"]
        assert f["text/prompt_embeds/shape"][0].tolist() == [3, 32]


def test_text_round_trip_with_different_lengths(cache: str) -> None:
    texts = [make_text(i, length) for i, length in enumerate([1, 7, 77, 12, 3, 40, 77, 5, 19, 2])]
    rank0 = write(cache, [], texts, shard_size=6000)
    assert len(rank0.infos) >= 3
    assert all(info.latents == 0 for info in rank0.infos)
    with CacheReader(cache) as reader:
        assert reader.text_keys() == sorted(t.key for t in texts)
        assert reader.latent_keys() == [] and reader.buckets() == {}
        for text in texts:
            assert_same_text(reader.text(text.key), text)


def test_latents_and_texts_in_the_same_shards(cache: str) -> None:
    latents = [make_latent(i, logvar=True) for i in range(12)]
    texts = [make_text(i, 4 + i) for i in range(7)]
    rank0 = write(cache, latents, texts, shard_size=5000)
    assert sum(info.texts for info in rank0.infos) == 7 and sum(info.latents for info in rank0.infos) == 12
    with CacheReader(cache) as reader:
        for sample in latents:
            assert_same_text(reader.text(reader.latent(sample.key).text_key), texts[int(sample.text_key, 16)])


def test_buckets_group_keys_by_latent_shape(cache: str) -> None:
    latents = [make_latent(i, SHAPES[i % 3]) for i in range(30)]
    write(cache, latents[:15], prefix="r0")
    write(cache, latents[15:], prefix="r1")
    with CacheReader(cache) as reader:
        buckets = reader.buckets()
    assert list(buckets) == [(8, 8), (8, 16), (16, 8)]
    for shape in SHAPES:
        assert buckets[shape[1:]] == sorted(s.key for s in latents if s.mean.shape == shape)


def test_two_writers_make_one_cache(cache: str) -> None:
    latents = [make_latent(i) for i in range(30)]
    texts = [make_text(i, 3 + i % 4) for i in range(8)]
    rank0 = Rank0(cache)
    writers = [ShardWriter(cache, storage.join(cache, "shards"), f"r{r}", 3000, rank0) for r in range(2)]
    for i, sample in enumerate(latents):  # interleaved, as two ranks run side by side
        writers[i % 2].add_latent(sample)
    for i, text in enumerate(texts):
        writers[i % 2].add_text(text)
    for writer in writers:
        writer.close()
    names = [s["name"] for s in Manifest.load(cache).shards]  # type: ignore[union-attr]
    assert any(n.startswith("r0-") for n in names) and any(n.startswith("r1-") for n in names)
    with CacheReader(cache) as reader:
        assert reader.latent_keys() == sorted(s.key for s in latents)
        assert reader.text_keys() == sorted(t.key for t in texts)
        for sample in latents:
            assert_same_latent(reader.latent(sample.key), sample)


def test_killed_writer_leaves_an_unlisted_tmp_that_readers_ignore(cache: str) -> None:
    latents = [make_latent(i) for i in range(22)]  # 5 to a shard: the last 2 are in the unfinished one
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, storage.join(cache, "shards"), "r0", 3000, rank0)
    for sample in latents:
        writer.add_latent(sample)
    writer.add_text(make_text(0, 5))
    del writer  # killed: close() never runs
    gc.collect()
    shards_dir = Path(cache) / "shards"
    tmp = [p.name for p in shards_dir.iterdir() if p.name.endswith(".tmp")]
    assert len(tmp) == 1
    listed = [info.name for info in rank0.infos]
    assert tmp[0].removesuffix(".tmp") not in listed
    done = {k for info in rank0.infos for k in info.latent_keys}
    assert 0 < len(done) < len(latents)
    with CacheReader(cache) as reader:
        assert set(reader.latent_keys()) == done
        assert reader.text_keys() == []
        lost = next(s.key for s in latents if s.key not in done)
        with pytest.raises(KeyError):
            reader.latent(lost)
    assert verify(cache, expected_latent_keys=done).ok

    # a rerun with the same prefix removes the leftover and never reuses a listed shard's name
    rerun = write(cache, [s for s in latents if s.key not in done], prefix="r0")
    assert not any(p.name.endswith(".tmp") for p in shards_dir.iterdir())
    assert not set(listed) & {info.name for info in rerun.infos}
    with CacheReader(cache) as reader:
        assert reader.latent_keys() == sorted(s.key for s in latents)


def test_a_shard_whose_write_failed_is_never_listed(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, storage.join(cache, "shards"), "r0", 1 << 30, rank0)
    writer.add_latent(make_latent(0))
    monkeypatch.setattr(h5py.Dataset, "resize", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        writer.add_latent(make_latent(1))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="failed"):
        writer.add_latent(make_latent(2))
    with pytest.raises(RuntimeError, match="abandoned"):
        writer.close()
    assert rank0.infos == [] and Manifest.load(cache) is None


def test_bad_samples_are_refused_and_the_writer_goes_on(cache: str) -> None:
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, storage.join(cache, "shards"), "r0", 1 << 30, rank0)
    writer.add_latent(make_latent(0))
    writer.add_text(make_text(0, 4))
    bad_latents = [
        make_latent(1, dtype="float32"),  # same shape, another dtype
        make_latent(2, logvar=True),  # logvar where the others have none
        LatentRecord("k" * 65, "t", np.zeros((4, 8, 8), np.float16), None, (1, 1), (0, 0), "p"),
        LatentRecord("é", "t", np.zeros((4, 8, 8), np.float16), None, (1, 1), (0, 0), "p"),
        LatentRecord("k", "t", np.zeros((8, 8), np.float16), None, (1, 1), (0, 0), "p"),
        LatentRecord("k", "t", np.zeros((4, 8, 8), np.float16), None, (1, 2, 3), (0, 0), "p"),  # type: ignore[arg-type]
    ]
    for sample in bad_latents:
        with pytest.raises(ValueError):
            writer.add_latent(sample)
    bad_texts = [
        TextRecord("t1", {"prompt_embeds": np.zeros((3, 32), np.float16)}, 3),  # an array missing
        TextRecord("t2", {"prompt_embeds": np.zeros((3, 32), np.float32), "pooled_prompt_embeds": np.zeros(24)}, 3),
        TextRecord("t3", {}, 0),
        TextRecord("t4", {"a/b": np.zeros(3)}, 3),
    ]
    for text in bad_texts:
        with pytest.raises(ValueError):
            writer.add_text(text)
    writer.add_latent(make_latent(3))
    writer.close()
    with CacheReader(cache) as reader:
        assert reader.latent_keys() == sorted([make_latent(0).key, make_latent(3).key])
        assert reader.text_keys() == [make_text(0, 4).key]


def test_shards_move_from_another_work_dir(cache: str, tmp_path: Path) -> None:
    work = tmp_path / "node-local"
    latents = [make_latent(i) for i in range(10)]
    rank0 = write(cache, latents, work_dir=str(work))
    assert os.listdir(work) == []
    assert sorted(os.listdir(Path(cache) / "shards")) == [info.name for info in rank0.infos]
    with CacheReader(cache) as reader:
        assert reader.latent_keys() == sorted(s.key for s in latents)
