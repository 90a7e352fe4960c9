"""The embedded default is reproducible from the script in the repo."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_default_data_and_tokenizer_rebuild_identically():
    out = subprocess.run([sys.executable, "scripts/make_default_assets.py", "--check", "--skip-model"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("identical"), out.stdout + out.stderr
