"""What the cache reader holds of each shard: its groups (a latent shape, or the text), each group's metadata
read whole on first use and kept, and an open shard with the datasets looked up in it once."""

from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np

from stk.shards.layout import open_h5

__all__ = ["Group", "LatentMeta", "OpenShard", "TextArray", "TextMeta"]


@dataclass
class LatentMeta:
    """A latent group's metadata for every row (what a LatentRecord holds besides its arrays), read in one go."""

    dtype: np.dtype
    payloads: tuple[str, ...]  # ("mean",) or ("mean", "logvar")
    text_key: np.ndarray
    original_size: np.ndarray
    crop_top_left: np.ndarray
    path: np.ndarray

    @staticmethod
    def read(group: h5py.Group) -> LatentMeta:
        return LatentMeta(
            dtype=np.dtype(str(group.attrs["dtype"])),
            payloads=("mean", "logvar") if "logvar" in group else ("mean",),
            text_key=group["text_key"][()].astype(str),
            original_size=group["original_size"][()],
            crop_top_left=group["crop_top_left"][()],
            path=group["path"].asstr()[()],
        )


@dataclass
class TextArray:
    """One array of the text group: its dtype, where each row's compressed bytes end, each row's shape."""

    dtype: np.dtype
    end: np.ndarray
    shape: np.ndarray


@dataclass
class TextMeta:
    """The text group's metadata for every row: its token count and its arrays."""

    length: np.ndarray
    arrays: dict[str, TextArray]

    @staticmethod
    def read(group: h5py.Group) -> TextMeta:
        arrays = {}
        for name in (str(n) for n in group.attrs["arrays"]):
            sub = group[name]
            arrays[name] = TextArray(np.dtype(str(sub.attrs["dtype"])), sub["end"][()], sub["shape"][()])
        return TextMeta(group["length"][()], arrays)


@dataclass
class Group:
    """A latent shape of one shard (with its shape), or its /text group; metadata read on first use."""

    shard: int
    path: str  # "latents/4x64x64" or "text"
    shape: tuple[int, ...] = ()
    latent_meta: LatentMeta | None = None
    text_meta: TextMeta | None = None


class OpenShard:
    """An open shard and the datasets looked up in it (a lookup by path costs more than a read)."""

    def __init__(self, path: str) -> None:
        self.file = open_h5(path, "r", rdcc_nbytes=0)  # chunks are read whole or by exact range: no cache
        self._datasets: dict[str, h5py.Dataset] = {}

    def dataset(self, path: str) -> h5py.Dataset:
        found = self._datasets.get(path)
        if found is None:
            found = self._datasets[path] = self.file[path]
        return found
