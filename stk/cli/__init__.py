"""The commands: click wiring over the library.

A command reports its own progress and errors: the model libraries' notices are silenced before any module
imports them (transformers warns while diffusers imports it, before `quiet_model_libraries` can run).
"""

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
