"""python -m stages.merge --config ... --adapter DIR --out DIR: the merge stage's CLI; the stage is stages/export/merge.py."""

from stages.export.merge import MergeResult, main, run  # noqa: F401 - the stage's API where it was

if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "merge"))
