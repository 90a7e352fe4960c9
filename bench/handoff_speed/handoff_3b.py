"""Hand-off of a 3B-sized bundle on one filesystem: the GGUFs linked into the bundle against copied (issue 24, item 4).

    python bench/handoff_speed/handoff_3b.py --out bench/handoff_speed/results/handoff_3b.json [--dir /var/tmp/handoff-bench]

Two files of a 3B model's Q4_K_M and Q5_K_S sizes (1.93 and 2.21 GiB: Llama-3.2-3B's), random bytes, on the disk the
artifacts would be on; each placed into a bundle directory the way stages.handoff.place does it, then by a plain copy
(what the hand-off did before), each followed by the sha256 the bundle's SHA256SUMS needs. Page cache dropped
between the two where the kernel allows (echo 3 > /proc/sys/vm/drop_caches), so both hash from the disk alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SIZES = {"model-Q4_K_M.gguf": int(1.93 * 2**30), "model-Q5_K_S.gguf": int(2.21 * 2**30)}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def main() -> None:
    from stages import checksums, handoff

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/handoff-bench"))
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    run = a.dir / "run"
    run.mkdir(parents=True)
    for name, size in SIZES.items():
        with (run / name).open("wb") as f:
            left = size
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
    rows = {}
    for how in ("place", "copy"):
        bundle = a.dir / f"bundle-{how}"
        bundle.mkdir()
        cold = drop_caches()
        t0 = time.perf_counter()
        ways = {}
        for name in SIZES:
            if how == "place":
                ways[name] = handoff.place(run / name, bundle / name)
            else:
                shutil.copy2(run / name, bundle / name)
                ways[name] = "copy"
        placed = time.perf_counter() - t0
        sums = {name: checksums.sha256_file(bundle / name) for name in SIZES}
        rows[how] = {"placed_s": round(placed, 3), "placed_and_hashed_s": round(time.perf_counter() - t0, 3), "ways": ways,
                     "page_cache_dropped": cold, "sha256": sums}
    assert rows["place"]["sha256"] == rows["copy"]["sha256"]
    result = {"bytes": sum(SIZES.values()), "filesystem": os.statvfs(a.dir).f_fsid, "rows": rows,
              "speedup": round(rows["copy"]["placed_and_hashed_s"] / rows["place"]["placed_and_hashed_s"], 2)}
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"} | {k: {x: y for x, y in r.items() if x != "sha256"}
                                                                           for k, r in rows.items()}, indent=1))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
