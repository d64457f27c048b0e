"""What stk-cache is asked to do (`CacheOptions`, what its options fill in) and what it reports when done
(`CacheSummary`, the command's JSON line)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stk.models import Family
from stk.shards.config import EncodeSettings

__all__ = ["CacheOptions", "CacheSummary"]


@dataclass
class CacheOptions:
    scan_dir: str
    model: str
    cache: str
    family: Family | None = None
    device: str | None = None
    batch_size: int = 16
    text_batch_size: int = 64  # captions per batch, batched by token count
    two_pass: bool = False  # captions with the text encoders alone on the device, then images with the VAE alone
    shard_size: int = 512 * 1024 * 1024
    threads: int = 4
    settings: EncodeSettings = field(default_factory=EncodeSettings)
    force: bool = False
    max_errors: str = "1%"  # as stk-scan's: a count, or a percentage of the scan's images
    validation_prompts: str | None = None  # a file of prompts to embed for stk-train's samples; None: keep the cache's


@dataclass
class CacheSummary:
    cache: str
    model: str
    family: str
    images: int  # scan rows
    captions: int  # distinct captions: the scan's, the empty caption and the validation prompts
    encoded_images: int
    encoded_captions: int
    reused_images: int
    reused_captions: int
    errors: int
    shards_written: int
    bytes_written: int
    ranks: int
    seconds: float
    images_per_second: float
    captions_per_second: float  # encoded captions over the longest rank's text pass
    text_peak_memory_gib: float  # the most any rank's text pass used, of the memory text_peak_memory_of names
    text_peak_memory_of: str  # "cuda allocated" (the device's, weights included) or "process peak RSS" (CPU)
    two_pass: bool

    def line(self) -> str:
        passes = "two passes" if self.two_pass else "one pass"
        return (
            f"{self.images} images, {self.captions} distinct captions: encoded {self.encoded_images} images and "
            f"{self.encoded_captions} captions ({self.reused_images} + {self.reused_captions} already cached), "
            f"{self.errors} errors, {self.shards_written} shards ({self.bytes_written / 2**20:.1f} MiB) in "
            f"{self.seconds:.1f} s ({self.images_per_second:.1f} images/s, {self.captions_per_second:.1f} captions/s "
            f"on {self.ranks} rank(s), {passes}; text pass peak {self.text_peak_memory_gib:.2f} GiB, "
            f"{self.text_peak_memory_of})"
        )
