"""python -m stages.export --config configs/default.yaml --merged DIR --out DIR: the export stage's CLI (stage.py)."""

import sys

from stages.errors import run_cli
from stages.export.stage import main

sys.exit(run_cli(main, "export"))
