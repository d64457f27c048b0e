"""stk.shards: shards roll over and round-trip bit for bit, only closed shards are listed, a
killed writer leaves nothing listed, several writers make one cache, verify finds damage, and
an s3:// cache is written, listed and read back through a real S3 server."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.helpers import S3_ENV, s3_client
from support.shard_records import Rank0, make_latent, make_text

from stk import storage
from stk.errors import CacheIncomplete, ExitCode, InputError
from stk.preprocess import CropMode
from stk.shards import (
    CacheReader,
    LatentRecord,
    Manifest,
    ShardInfo,
    ShardWriter,
    TextRecord,
    shard_location,
    verify,
)
from stk.shards.config import CacheConfig, EncodeSettings
from stk.shards.keys import latent_key, text_key
from stk.shards.manifest import ManifestDamaged, shard_entry
from stk.shards.rebuild import rebuild_manifest

SHAPES = [(4, 8, 8), (4, 8, 16), (4, 16, 8)]


def write(
    cache: str,
    latents: list[LatentRecord],
    texts: list[TextRecord] = (),  # type: ignore[assignment]
    prefix: str = "r0",
    shard_size: int = 4000,
    work_dir: str | None = None,
) -> Rank0:
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, work_dir or storage.join(cache, "shards"), prefix, shard_size, rank0)
    for text in texts:
        writer.add_text(text)
    for sample in latents:
        writer.add_latent(sample)
    writer.close()
    return rank0


def assert_same_latent(got: LatentRecord, want: LatentRecord) -> None:
    assert got.mean.dtype == want.mean.dtype and got.mean.shape == want.mean.shape
    assert got.mean.tobytes() == want.mean.tobytes()
    if want.logvar is None:
        assert got.logvar is None
    else:
        assert got.logvar is not None and got.logvar.dtype == want.logvar.dtype
        assert got.logvar.tobytes() == want.logvar.tobytes()
    assert (got.key, got.text_key, got.path) == (want.key, want.text_key, want.path)
    assert (got.original_size, got.crop_top_left) == (want.original_size, want.crop_top_left)


def assert_same_text(got: TextRecord, want: TextRecord) -> None:
    assert (got.key, got.length, sorted(got.arrays)) == (want.key, want.length, sorted(want.arrays))
    for name, array in want.arrays.items():
        assert got.arrays[name].dtype == array.dtype and got.arrays[name].shape == array.shape
        assert got.arrays[name].tobytes() == array.tobytes()


@pytest.fixture
def cache(tmp_path: Path) -> str:
    return str(tmp_path / "cache")


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


def test_reader_threads_and_forked_processes(cache: str) -> None:
    latents = [make_latent(i, SHAPES[i % 3]) for i in range(60)]
    write(cache, latents, shard_size=8000)
    reader = CacheReader(cache, max_open_files=2)  # files closed and reopened as threads go round
    failures: list[BaseException] = []

    def read_all(offset: int) -> None:
        try:
            for sample in latents[offset:] + latents[:offset]:
                assert_same_latent(reader.latent(sample.key), sample)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=read_all, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]

    queue = multiprocessing.get_context("fork").SimpleQueue()

    def child() -> None:  # inherits the reader with files open, as a DataLoader worker does
        queue.put(sum(float(reader.latent(s.key).mean.astype(np.float64).sum()) for s in latents))

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert queue.get() == pytest.approx(sum(float(s.mean.astype(np.float64).sum()) for s in latents))
    reader.close()


def test_file_locking_is_off_even_when_h5py_was_imported_first(cache: str) -> None:
    """HDF5 reads HDF5_USE_FILE_LOCKING once, at h5py's import: stk passes it to every open."""
    rank0 = write(cache, [make_latent(0)])
    holder = h5py.File(shard_location(cache, rank0.infos[0].name), "r+", locking=True)  # an exclusive lock
    try:
        code = "import sys, h5py\nfrom stk.shards import CacheReader\nprint(CacheReader(sys.argv[1]).latent_keys())"
        env = {k: v for k, v in os.environ.items() if k != "HDF5_USE_FILE_LOCKING"}
        proc = subprocess.run([sys.executable, "-c", code, cache], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        assert make_latent(0).key in proc.stdout
    finally:
        holder.close()


# --- listing and crashes ------------------------------------------------------------------------


def test_manifest_lists_only_closed_shards(cache: str) -> None:
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, storage.join(cache, "shards"), "r0", 3000, rank0)
    for i in range(20):
        writer.add_latent(make_latent(i))
        listed = {s["name"] for s in Manifest.load(cache).shards} if rank0.infos else set()  # type: ignore[union-attr]
        on_disk = set(os.listdir(storage.join(cache, "shards")))
        assert listed == {n for n in on_disk if n.endswith(".h5")}
        assert len([n for n in on_disk if n.endswith(".h5.tmp")]) <= 1
    assert rank0.infos
    writer.close()
    manifest = Manifest.load(cache)
    assert manifest is not None and manifest.scaling_factor == 0.18215
    assert [s["name"] for s in manifest.shards] == sorted(os.listdir(storage.join(cache, "shards")))
    for entry, info in zip(manifest.shards, rank0.infos, strict=True):
        assert entry == {k: getattr(info, k) for k in ("name", "latents", "texts", "bytes", "sha256")}
        assert info.bytes == os.path.getsize(shard_location(cache, info.name))


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


def test_merge_lists_each_shard_once() -> None:
    first, second = ShardInfo("r0-00000.h5", 3, 1, 100, "ab" * 32), ShardInfo("r1-00000.h5", 2, 0, 80, "cd" * 32)
    manifest = Manifest(config={})
    manifest.merge([shard_entry(first)])
    manifest.merge([shard_entry(first), shard_entry(second), shard_entry(second)])
    assert manifest.shards == [
        {"name": "r0-00000.h5", "latents": 3, "texts": 1, "bytes": 100, "sha256": "ab" * 32},
        {"name": "r1-00000.h5", "latents": 2, "texts": 0, "bytes": 80, "sha256": "cd" * 32},
    ]


def test_manifest_round_trip_and_refusals(cache: str) -> None:
    assert Manifest.load(cache) is None
    manifest = Manifest(config={"family": "sdxl"}, scaling_factor=0.13025, extra={"created_by": "test"})
    manifest.merge([shard_entry(ShardInfo("r0-00000.h5", 3, 1, 100, "ab" * 32))])
    manifest.save(cache)
    assert Manifest.load(cache) == manifest
    manifest_bytes = storage.read_bytes(storage.join(cache, "manifest.json"))
    storage.write_atomic(storage.join(cache, "manifest.json"), b'{"version": 99, "config": {}, "shards": []}')
    with pytest.raises(InputError, match="version 99"):
        Manifest.load(cache)
    storage.write_atomic(storage.join(cache, "manifest.json"), b"[1, 2]")
    with pytest.raises(ManifestDamaged, match="not a cache manifest") as damaged:
        Manifest.load(cache)
    assert damaged.value.exit_code == ExitCode.INCOMPLETE and f"stk-cache verify {cache} --repair" in str(damaged.value)
    storage.write_atomic(storage.join(cache, "manifest.json"), manifest_bytes[: len(manifest_bytes) // 2])
    with pytest.raises(ManifestDamaged, match="is damaged \\(not JSON"):
        Manifest.load(cache)
    with pytest.raises(InputError, match=r"no manifest\.json"):
        CacheReader(str(Path(cache) / "elsewhere"))


# a cache config as stk-cache has always written it (trimmed encoders): what every older cache holds
RECORDED_CONFIG = """{
 "family": "flux",
 "model": {"family": "flux", "model": "/models/flux",
  "vae": {"class": "AutoencoderKL", "scaling_factor": 0.3611, "shift_factor": 0.1159, "dtype": "bfloat16"},
  "text": {"outputs": ["prompt_embeds"], "dtype": "bfloat16", "encoders": []}},
 "latents": {"crop": "center", "store_logvar": false, "dtype": "float16"},
 "text": {"trim_padding": true, "dtype": "float16"},
 "buckets": {"resolution": 1024, "resolution_type": "side", "alignment": 16},
 "scaling_factor": 0.3611,
 "shift_factor": 0.1159
}"""


def test_a_recorded_cache_config_reads_back_to_the_same_json_and_the_same_keys() -> None:
    recorded = json.loads(RECORDED_CONFIG)
    config = CacheConfig.from_json(recorded, "cache/manifest.json")
    assert config.settings == EncodeSettings(CropMode.CENTER, store_logvar=False, dtype="float16", trim_padding=True)
    assert (config.family, config.norm.scaling_factor, config.norm.shift_factor) == ("flux", 0.3611, 0.1159)
    assert json.dumps(config.to_json(), indent=1) == json.dumps(recorded, indent=1)  # key order included
    assert Manifest.new(config).header() == {"version": 1, "config": recorded, "scaling_factor": 0.3611,
                                             "validation_prompts": []}  # fmt: skip
    # the keys the recipes give, pinned: a change here would orphan every cache made so far
    row = {"path": "a/b.jpg", "bytes": 1000, "mtime": 1.5, "bucket_width": 64, "bucket_height": 48}
    assert latent_key(row, config.latent_recipe()) == "66282d140925c1f94a1e0923c1285fbaa50d0f50"
    assert text_key("a cat", config.text_recipe()) == "038dc3d08f823dc62787e50fa1bce457e71a604f"
    assert config.differences({**recorded, "model": {**recorded["model"], "model": "/elsewhere"}}) == []
    assert config.differences({**recorded, "latents": {"crop": "random"}, "shift_factor": None}) == [
        "latents",
        "shift_factor",
    ]


@pytest.mark.parametrize("broken", ["family", "latents", "buckets", "scaling_factor", "model"])
def test_a_config_stk_cache_did_not_make_is_one_input_error_naming_the_manifest(broken: str) -> None:
    recorded = json.loads(RECORDED_CONFIG)
    if broken == "model":
        recorded["model"] = "tiny"
    else:
        del recorded[broken]
    with pytest.raises(InputError, match=r"^cache/manifest\.json: no usable .* \(not made by stk-cache\)$"):
        CacheConfig.from_json(recorded, "cache/manifest.json")


def test_shards_move_from_another_work_dir(cache: str, tmp_path: Path) -> None:
    work = tmp_path / "node-local"
    latents = [make_latent(i) for i in range(10)]
    rank0 = write(cache, latents, work_dir=str(work))
    assert os.listdir(work) == []
    assert sorted(os.listdir(Path(cache) / "shards")) == [info.name for info in rank0.infos]
    with CacheReader(cache) as reader:
        assert reader.latent_keys() == sorted(s.key for s in latents)


def test_local_upload_and_download_copy_atomically(tmp_path: Path) -> None:
    source = tmp_path / "a.bin"
    source.write_bytes(os.urandom(100_000))
    storage.upload_file(str(source), str(tmp_path / "sub" / "b.bin"))
    storage.download_file(str(tmp_path / "sub" / "b.bin"), str(tmp_path / "c" / "c.bin"))
    assert (tmp_path / "c" / "c.bin").read_bytes() == source.read_bytes()
    assert sorted(os.listdir(tmp_path / "sub")) == ["b.bin"]  # no temp file left behind
    with pytest.raises(FileNotFoundError):
        storage.download_file(str(tmp_path / "missing"), str(tmp_path / "d.bin"))


# --- verify -------------------------------------------------------------------------------------


def test_verify_finds_missing_and_damaged_shards_and_missing_keys(cache: str) -> None:
    latents = [make_latent(i) for i in range(24)]
    texts = [make_text(i, 5) for i in range(3)]
    rank0 = write(cache, latents, texts, shard_size=3000)
    all_keys = [s.key for s in latents]
    report = verify(cache, all_keys, [t.key for t in texts])
    assert report.ok and (report.shards, report.latents, report.texts) == (len(rank0.infos), 24, 3)

    deleted, flipped = rank0.infos[1], rank0.infos[2]
    os.unlink(shard_location(cache, deleted.name))
    path = shard_location(cache, flipped.name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    report = verify(cache, [*all_keys, "beef" * 8], [t.key for t in texts])
    assert not report.ok
    assert report.missing_shards == [deleted.name]
    assert len(report.damaged_shards) == 1 and report.damaged_shards[0].startswith(f"{flipped.name}: sha256")
    expected_missing = sorted({*deleted.latent_keys, *flipped.latent_keys, "beef" * 8})
    assert report.missing_latent_keys == expected_missing
    assert report.missing_text_keys == sorted({*deleted.text_keys, *flipped.text_keys})
    with pytest.raises(CacheIncomplete, match=f"{deleted.name} is damaged \\(missing\\).*verify {cache} --repair"):
        CacheReader(cache)


@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_a_missing_or_empty_shard_is_exit_6_naming_it_and_the_repair(cache: str, damage: str) -> None:
    rank0 = write(cache, [make_latent(i) for i in range(12)], shard_size=3000)
    path = shard_location(cache, rank0.infos[1].name)
    if damage == "missing":
        os.unlink(path)
    else:
        open(path, "wb").close()
    with pytest.raises(CacheIncomplete) as raised:
        CacheReader(cache)
    message = str(raised.value)
    assert raised.value.exit_code == ExitCode.INCOMPLETE and "\n" not in message
    assert path in message and f"`stk-cache verify {cache} --repair`" in message
    assert ("(missing)" if damage == "missing" else "(0 bytes, the manifest lists") in message


def test_a_damaged_manifest_is_rebuilt_from_the_intact_shards(cache: str) -> None:
    """Each shard carries the manifest's header: a truncated manifest.json is rebuilt from the shards that
    read back whole, listing every one of their samples; a truncated shard and an older stk's shard (no
    header) are dropped and deleted."""
    header = Manifest(config={"family": "sd", "model": {"vae": "v1"}}, scaling_factor=0.18215,
                      validation_prompts=["a cat"], extra={"created_by": "test"}).header()  # fmt: skip
    latents = [make_latent(i) for i in range(20)]
    texts = [make_text(i, 3 + i) for i in range(4)]
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, storage.join(cache, "shards"), "r0", 3000, rank0, header)
    for text in texts:
        writer.add_text(text)
    for sample in latents:
        writer.add_latent(sample)
    writer.close()
    legacy = write(cache, [make_latent(100)], prefix="old")  # an older stk's shard: no header in it
    cut = rank0.infos[-1]
    with open(shard_location(cache, cut.name), "r+b") as f:
        f.truncate(cut.bytes // 2)
    manifest_path = storage.join(cache, "manifest.json")
    whole = storage.read_bytes(manifest_path)
    storage.write_atomic(manifest_path, whole[: len(whole) // 3])

    rebuilt = rebuild_manifest(cache)
    kept = {info.name for info in rank0.infos[:-1]}
    assert {s["name"] for s in rebuilt.manifest.shards} == kept
    assert sorted(why.split(":", 1)[0] for why in rebuilt.dropped) == sorted([cut.name, legacy.infos[0].name])
    assert not os.path.exists(shard_location(cache, cut.name))
    loaded = Manifest.load(cache)
    assert loaded is not None and loaded.header() == header and loaded.shards == rebuilt.manifest.shards
    assert verify(cache).ok
    with CacheReader(cache) as reader:
        for sample in latents:
            if sample.key not in cut.latent_keys:
                assert_same_latent(reader.latent(sample.key), sample)
        for text in texts:
            if text.key not in cut.text_keys:
                assert_same_text(reader.text(text.key), text)


def test_a_manifest_without_a_described_shard_cannot_be_rebuilt(cache: str) -> None:
    write(cache, [make_latent(i) for i in range(3)])  # no header in the shards
    storage.write_atomic(storage.join(cache, "manifest.json"), b"{")
    with pytest.raises(CacheIncomplete, match=r"cannot be rebuilt.*--force"):
        rebuild_manifest(cache)


# --- S3 -----------------------------------------------------------------------------------------


@pytest.fixture
def s3_cache(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    storage.configure_s3(s3_server)
    bucket = f"stk-{uuid.uuid4().hex[:12]}"
    s3_client(s3_server).create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/caches/run1"
    storage.configure_s3(None)


@pytest.mark.integration
def test_s3_cache_upload_list_download_and_read(s3_cache: str, tmp_path: Path) -> None:
    latents = [make_latent(i, SHAPES[i % 3], logvar=i % 2 == 0) for i in range(0, 40, 2)]
    latents += [make_latent(i, SHAPES[i % 3], "float16", True) for i in range(1, 40, 2)]
    texts = [make_text(i, 2 + i) for i in range(6)]
    work = tmp_path / "work"
    rank0 = write(s3_cache, latents, texts, shard_size=6000, work_dir=str(work))
    assert len(rank0.infos) >= 3
    assert os.listdir(work) == [], "uploaded shards are not kept in the work dir"
    listed = {info.key for info in storage.list_files(s3_cache)}
    assert listed == {"manifest.json"} | {f"shards/{info.name}" for info in rank0.infos}
    manifest = Manifest.load(s3_cache)
    assert manifest is not None and [s["name"] for s in manifest.shards] == [i.name for i in rank0.infos]

    local = tmp_path / "local"
    biggest = max(info.bytes for info in rank0.infos)
    with CacheReader(s3_cache, local_dir=str(local), max_local_bytes=biggest + 1) as reader:
        assert os.listdir(local) == [], "keys are read with ranged GETs, no shard is fetched on open"
        assert reader.latent_keys() == sorted(s.key for s in latents)
        assert reader.text_keys() == sorted(t.key for t in texts)
        for sample in latents:
            assert_same_latent(reader.latent(sample.key), sample)
            assert sum(p.stat().st_size for p in local.iterdir()) <= biggest + 1, "LRU eviction keeps the limit"
        for text in texts:
            assert_same_text(reader.text(text.key), text)
        assert reader.buckets()[(8, 16)] == sorted(s.key for s in latents if s.mean.shape == (4, 8, 16))

    with CacheReader(s3_cache, local_dir=str(local)) as reader:  # no limit: every shard fetched once, then kept
        for sample in latents:
            reader.latent(sample.key)
        fetched = {p.name: p.stat().st_ino for p in local.iterdir()}
        assert len(fetched) == len(rank0.infos)
    with CacheReader(s3_cache, local_dir=str(local)) as reader:  # a later job reuses the copies
        for sample in latents:
            reader.latent(sample.key)
        assert {p.name: p.stat().st_ino for p in local.iterdir()} == fetched
    with CacheReader(s3_cache) as reader:  # no local_dir: a temp dir, removed on close
        assert_same_latent(reader.latent(latents[0].key), latents[0])
        assert reader._copies is not None
        temp = reader._copies.directory
    assert not os.path.exists(temp)

    assert verify(s3_cache, [s.key for s in latents], [t.key for t in texts]).ok
    with pytest.raises(InputError, match="s3://stk-missing-"):  # one line for people, not boto3's wrapper
        storage.upload_file(str(local / os.listdir(local)[0]), f"s3://stk-missing-{uuid.uuid4().hex[:8]}/x.h5")
    bucket, prefix = storage.s3.split_url(s3_cache)
    storage.s3.client().delete_object(Bucket=bucket, Key=f"{prefix}/shards/{rank0.infos[0].name}")
    report = verify(s3_cache, [s.key for s in latents])
    assert report.missing_shards == [rank0.infos[0].name]
    assert report.missing_latent_keys == sorted(rank0.infos[0].latent_keys)
