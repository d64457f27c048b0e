"""The commands: click wiring over the library.

A command reports its own progress and errors: the model libraries' notices are silenced before any module
imports them (transformers warns while diffusers imports it, before `quiet_model_libraries` can run; diffusers and
peft import torchao, which reports the optional GPU kernels it cannot load on this machine, and diffusers then warns
about torchao classes it looks for in other releases).
"""

import logging
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
for _name in ("torchao", "torch.utils._pytree"):  # the latter: torchao registers enums torch now handles itself
    logging.getLogger(_name).setLevel(logging.ERROR)
