"""`mm.tokenizer_files` under its earlier name (the built-in model belongs to mm/, the layer that loads checkpoints)."""

import sys

from mm import tokenizer_files

sys.modules[__name__] = tokenizer_files
