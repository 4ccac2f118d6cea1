"""preprocess/ may import only torch, numpy, PIL, av and the standard library."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess


def test_preprocess_does_not_import_transformers():
    code = ("import sys, preprocess; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'transformers', 'torchvision', 'cv2'}); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
