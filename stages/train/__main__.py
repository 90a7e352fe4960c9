"""python -m stages.train --config configs/default.yaml [--out DIR]: the train stage's CLI (stage.py);
also what every process of a multi-process run starts (launch.py)."""

import sys

from stages.errors import run_cli
from stages.train.stage import main

sys.exit(run_cli(main, "train"))
