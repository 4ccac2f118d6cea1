"""`mm.default_model` under its earlier name (the built-in model belongs to mm/, the layer that loads checkpoints)."""

import sys

from mm import default_model

sys.modules[__name__] = default_model
