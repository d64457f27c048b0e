"""stk-export: a trained model or adapter from stk-train's OUTPUT/final (or a checkpoint) in the file formats other
tools load: the diffusers/peft LoRA file, kohya/ComfyUI's LoRA keys, one single-file checkpoint of the whole model.

`source.py` tells what a folder holds, `formats.py` which format can hold what, `adapters.py` writes an adapter,
`single.py` a full fine-tune; `run.py` puts them together."""

from stk.export.formats import FORMATS, Format
from stk.export.run import ExportOptions, export

__all__ = ["FORMATS", "ExportOptions", "Format", "export"]
