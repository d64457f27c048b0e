"""stk.shards.verify: missing and damaged shards and missing keys found, exit 6 naming the shard and the repair."""

from __future__ import annotations

import os

import pytest
from support.shard_records import make_latent, make_text, write

from stk.errors import CacheIncomplete, ExitCode
from stk.shards import (
    CacheReader,
    shard_location,
    verify,
)

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
    assert report.missing_latent_keys.astype(str).tolist() == expected_missing
    assert report.missing_text_keys.astype(str).tolist() == sorted({*deleted.text_keys, *flipped.text_keys})
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
