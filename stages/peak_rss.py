"""Run a command and record its own peak resident memory.

    python stages/peak_rss.py OUT_FILE -- command args...

A tiny launcher (no imports beyond the standard library, ~10 MB resident) between the
stage and its child: Linux's ru_maxrss of a child also counts the pages it shared with
the process that forked it, so measured from a 0.7 GiB torch process a 0.4 GiB child
reads 0.7 GiB. Forked from this launcher instead, wait4 gives the child's own peak.
The exit status is passed through; OUT_FILE gets the peak in KiB.
"""

import os
import subprocess
import sys


def main() -> int:
    out, sep, *cmd = sys.argv[1:]
    assert sep == "--" and cmd, __doc__
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    with open(out, "w") as f:
        f.write(str(usage.ru_maxrss))
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
