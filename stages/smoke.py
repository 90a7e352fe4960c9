"""python -m stages.smoke --config ... --gguf FILE [--gguf ...] --out DIR: the smoke stage's CLI; the stage is stages/export/smoke.py."""

from stages.export.smoke import OffloadPlan, SmokeError, SmokeFile, SmokeResult, main, run  # noqa: F401 - the stage's API where it was

if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "smoke"))
