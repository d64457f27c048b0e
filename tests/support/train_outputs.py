"""What a training run wrote, read back: TensorBoard events, an offline W&B run, metrics.jsonl and the
validation samples (with the prompts that made them)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any


def board_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard shows for `tag`: every events file of the run read back, purges applied."""
    return [(e.step, e.value) for e in _board(directory).Scalars(tag)]


def board_images(directory: Path, tag: str) -> list[tuple[int, bytes]]:
    """The images TensorBoard shows for `tag`: (step, PNG bytes), purges applied."""
    return [(e.step, e.encoded_image_string) for e in _board(directory).Images(tag)]


def wandb_history(output_dir: Path) -> list[dict[str, Any]]:
    """The rows an offline W&B run logged (OUTPUT/wandb/offline-run-*/run-*.wandb), each {key: value, "_step": n}.
    The file is a LevelDB-style log of protobuf Records: a 7-byte file header, then 32 KiB blocks of records, each
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); wandb's own reader is in Go."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = output_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, position = path.read_bytes(), 32768, 7
    rows, pending = [], b""
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # the block's tail is padding
            position += room
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def board_tags(directory: Path) -> list[str]:
    return sorted(_board(directory).Tags()["scalars"])


def _board(directory: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def metrics(out: Path) -> list[dict[str, Any]]:
    """The rows of OUTPUT/metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


PROMPTS = ["a red square", "two blue circles", "x"]  # 3 over 2 ranks: under ZeRO-3 one rank makes a spare
SAMPLING = [arg for prompt in PROMPTS for arg in ("--validation-prompt", prompt)] + ["--validation-steps", "2"]


def sample_pngs(out: Path, step: int) -> dict[str, bytes]:
    """OUTPUT/samples/step-N/'s files by name."""
    return {p.name: p.read_bytes() for p in sorted((out / "samples" / f"step-{step:08d}").iterdir())}


def samples_match(pipe: Any, pngs: dict[str, bytes], guidance: float, steps: int = 2) -> bool:
    """Whether `pipe` (a diffusers pipeline, encoding each prompt itself) makes the sample images `pngs` of PROMPTS
    with their seeds (0, 1, ...) at 64x64: every pixel within one level, under 1% of them off at all."""
    import numpy as np
    import torch
    from PIL import Image

    torch.set_num_threads(1)  # as each rank runs
    for k, prompt in enumerate(PROMPTS):
        image = pipe(
            prompt,
            num_inference_steps=steps,
            guidance_scale=guidance,
            width=64,
            height=64,
            generator=torch.Generator().manual_seed(k),
        ).images[0]
        sample = next(png for name, png in pngs.items() if name.startswith(f"{k}-"))
        difference = np.abs(np.asarray(image, dtype=int) - np.asarray(Image.open(io.BytesIO(sample)), dtype=int))
        if difference.max() > 1 or (difference > 0).mean() >= 0.01:
            return False
    return True
