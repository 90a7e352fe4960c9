"""bench/peers/run.py runs at HEAD: its checkpoint, the stage's and plain peft's rows on a tiny Llama on the CPU, and
the merge into results rows with their ratios (Unsloth and Liger need a GPU here; the same code paths run there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

RUN = [sys.executable, str(REPO / "bench" / "peers" / "run.py")]


def test_the_peers_bench_runs_its_cpu_rows(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    model = tmp_path / "tiny"
    subprocess.run([*RUN, "make", "--shape", "tiny-llama", "--dir", str(model)], check=True, env=env, cwd=tmp_path)
    common = ["--shape", "tiny-llama", "--dir", str(model), "--data", "full", "longtail", "--cap-scale", "0.01", "--steps", "3"]
    subprocess.run([*RUN, "stage", *common, "--variants", "fused-off", "--out", str(tmp_path / "stage.json")], check=True,
                   env=env, cwd=tmp_path)
    subprocess.run([*RUN, "peft", *common, "--out", str(tmp_path / "peft.json")], check=True, env=env, cwd=tmp_path)
    # attention.sh's baseline: the stage with every packed row through the varlen path (on a CPU its per-sample loop);
    # moe.sh's: the loss in memory-first chunks
    subprocess.run([*RUN, "stage", *common[:5], "full", *common[7:], "--varlen-only", "--loss", "narrow", "--name", "stage-varlen",
                    "--out", str(tmp_path / "varlen.json")], check=True, env=env, cwd=tmp_path)
    subprocess.run([*RUN, "merge", str(tmp_path / "results.json"), str(tmp_path / "stage.json"), str(tmp_path / "peft.json")],
                   check=True, env=env, cwd=tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["name"], r["data"]) for r in rows} == {(n, d) for n in ("stage", "stage-fused-off", "peft") for d in ("full", "longtail")}
    for r in rows:
        assert r["kind"] == "dense" and r["quant"] == "nf4" and r["tokens_per_s"] > 0 and len(r["losses"]) == 3
        assert r["loss_tokens_per_s"] <= r["tokens_per_s"]
        assert (r["name"] == "peft") == ("vs_peft" not in r)
    stage = next(r for r in rows if r["name"] == "stage" and r["data"] == "longtail")
    assert stage["fit"]["fit"] == "memory"   # fit: auto on a CPU
    # the same samples trained (the stage orders its steps by its own plan): the mean loss over the steps agrees
    for data in ("full", "longtail"):
        stage_row, peft = (next(r for r in rows if r["name"] == n and r["data"] == data) for n in ("stage", "peft"))
        assert abs(stage_row["mean_loss"] - peft["mean_loss"]) < 0.01, (stage_row["losses"], peft["losses"])
    # full rows are equal-length samples: the stage's causal-rows attention trains what the varlen path trains
    varlen = json.loads((tmp_path / "varlen.json").read_text())["result"]
    assert varlen["varlen_only"] and list(varlen["runs"]) == ["full"]
    full = next(r for r in rows if r["name"] == "stage" and r["data"] == "full")
    assert max(abs(a - b) for a, b in zip(varlen["runs"]["full"]["losses"], full["losses"], strict=True)) < 1e-3
