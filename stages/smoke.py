"""Run each exported GGUF under llama.cpp the way the serving team will, and check it.

    python -m stages.smoke --config configs/default.yaml --gguf model-Q4_K_M.gguf [--gguf ...] --out DIR

For each file: plan how many layers fit on the smaller serving card
(`smoke.gpu_memory_gib`: GGUF weights per layer + the f16 KV cache for `smoke.n_ctx` +
llama.cpp's compute buffer, with a margin), load it with llama-cpp-python, answer the
held-out prompts greedily through the GGUF's own chat template, and measure prompt and
generation speed and memory (NVML on a GPU, RSS otherwise). Then (`smoke.serve`) the same prompts the
serving team's way: llama.cpp's OpenAI-compatible server on loopback, asked with the `openai` client
(stages/export/serving.py); both must pass.

`smoke.check: exact` requires the answer to equal the held-out completion: for the
default's deterministic skill that proves the fine-tune reached the quantized file.
`stops` (for real models) requires a non-empty answer that ends at EOS within
`smoke.max_tokens`. A file whose pass rate is below `smoke.min_accuracy` fails the stage,
so nothing is handed off.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path

from stages import data, inputs, memory, result_files
from stages.artifact import Artifact
from stages.config import RunConfig, SmokeSection
from stages.errors import MissingInput, UserError
from stages.export import llamacpp, serving
from stages.export.llamacpp_process import LlamaCrashed, LlamaProcess
from stages.memory import GIB, MemoryReport
from stages.model.load import load_tokenizer

COMPUTE_BUFFER_GIB = 0.35   # llama.cpp's scratch for a batch of 512 on a 7B; small models use less
MARGIN = 0.10               # of the card, kept free for the driver and fragmentation


class SmokeError(UserError, RuntimeError):
    """A GGUF file failed the smoke test."""


@dataclass
class OffloadPlan:
    n_gpu_layers: int
    n_layers: int
    layer_gib: float        # mean GGUF bytes per repeating layer
    other_gib: float        # embeddings, output head, norms
    kv_cache_gib: float     # f16 K and V for n_ctx
    budget_gib: float | None
    reason: str


@dataclass
class SmokeFile:
    quant: str
    path: Path
    plan: OffloadPlan
    n_prompts: int
    passed: int
    accuracy: float
    stopped_at_eos: int
    prompt_tokens_per_s: float
    gen_tokens_per_s: float
    load_s: float
    device_used_gib: float | None   # NVML, after load and generation, whole device
    examples: list[dict]            # a few prompts with expected and actual answers
    device_used_before_load_gib: float | None = None
    device_used_after_load_gib: float | None = None
    llama_peak_rss_gib: float | None = None  # the llama.cpp process's own peak RSS (host memory the server needs)
    served: dict | None = None  # the same prompts through llama.cpp's OpenAI-compatible server (serving.Served), smoke.serve: true


@dataclass
class SmokeResult:
    files: list[SmokeFile]
    memory: MemoryReport | None
    passed: bool

    def artifacts(self) -> list[Artifact]:
        rows = [{"quant": f.quant, "accuracy": f.accuracy, "passed": f.passed, "prompts": f.n_prompts, "gen_tok_s": f.gen_tokens_per_s,
                 "n_gpu_layers": f.plan.n_gpu_layers} for f in self.files]
        return [Artifact("smoke-results", "llama.cpp smoke test per GGUF", table=rows)]


def run(cfg: RunConfig, gguf_files: list[tuple[str, Path]], out_dir: Path) -> SmokeResult:
    """Smoke-test each (quant, path) GGUF; raise SmokeError naming every file that failed."""
    out_dir = Path(out_dir)
    missing = [str(p) for _q, p in gguf_files if not Path(p).is_file()]
    if missing:
        raise MissingInput(f"GGUF file(s) not found: {', '.join(missing)}; point --gguf at the export stage's model-*.gguf files")
    check_context(cfg, load_tokenizer(cfg.model))
    prompts = load_prompts(cfg)
    results = []
    with memory.track("smoke", out_dir, gpu=False) as meter:  # llama.cpp: its own process, NVML figures in extra
        for quant, path in gguf_files:
            results.append(smoke_file(cfg.smoke, quant, Path(path), prompts))
            r = results[-1]
            if cfg.smoke.serve:  # the serving team's path: the server applies the GGUF's template and stops server-side
                r.served = serving.ask(Path(path), cfg.smoke, prompts, n_gpu_layers=r.plan.n_gpu_layers,
                                       log=out_dir / f"server-{quant}.log").to_json()
                v = r.served
                print(f"smoke: {quant} served (OpenAI chat completions): {v['passed']}/{v['n_prompts']} passed, "
                      f"{v['stopped_at_eot']} stopped at end of turn, {v['mean_latency_s'] * 1000:.0f} ms per request, "
                      f"{v['completion_tokens_per_s']:.0f} tok/s")
            meter.child_peak_gib = max(meter.child_peak_gib or 0.0, r.llama_peak_rss_gib or 0.0) or None
            print(f"smoke: {quant} {r.passed}/{r.n_prompts} passed ({r.accuracy:.0%}), "
                  f"{r.gen_tokens_per_s:.0f} gen tok/s, n_gpu_layers={r.plan.n_gpu_layers}/{r.plan.n_layers}")
        meter.extra["files"] = {r.quant: {"accuracy": r.accuracy, "device_used_gib": r.device_used_gib} for r in results}
    failed = [r for r in results if min(r.accuracy, (r.served or {}).get("accuracy", 1.0)) < cfg.smoke.min_accuracy]

    result = SmokeResult(results, meter.report, passed=not failed)
    saved = result_files.save(out_dir, "smoke", result)
    if failed:
        raise SmokeError("; ".join(_failure(r, cfg.smoke.min_accuracy) for r in failed) + f"; details in {saved}")
    return result


def _failure(r: SmokeFile, least: float) -> str:
    """What failed for one file: in process, or through the server (the in-process check passed)."""
    served = r.accuracy >= least
    passed, n, acc, examples = ((r.served["passed"], r.served["n_prompts"], r.served["accuracy"], r.served["examples"]) if served
                                else (r.passed, r.n_prompts, r.accuracy, r.examples))
    miss = next((e for e in examples if not e["ok"]), examples[0])
    return (f"{r.path.name}{' through the OpenAI-compatible server' if served else ''}: {passed}/{n} prompts passed ({acc:.0%} < "
            f"smoke.min_accuracy {least:.0%}), e.g. expected {miss['expected']!r}, got {miss['got']!r} (finish_reason "
            f"{miss['finish_reason']!r})")


def load_prompts(cfg: RunConfig) -> list[data.Sample]:
    return data.held_out(cfg, cfg.smoke.max_prompts)


def check_context(cfg: RunConfig, tokenizer) -> None:
    """SmokeError, before any training, if a held-out prompt plus the answer cannot fit smoke.n_ctx."""
    s = cfg.smoke
    def n_tokens(sample) -> int:
        text = tokenizer.apply_chat_template(sample.prompt_messages, add_generation_prompt=True, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    longest = max((n_tokens(p), p.id) for p in load_prompts(cfg))
    if longest[0] + s.max_tokens > s.n_ctx:
        raise SmokeError(f"smoke.n_ctx {s.n_ctx} cannot hold the longest held-out prompt ({longest[1]}: {longest[0]} tokens) plus "
                         f"smoke.max_tokens {s.max_tokens}: raise smoke.n_ctx to at least {longest[0] + s.max_tokens}, "
                         "or lower smoke.max_tokens")


def _per_layer(value, n_layers: int) -> list[int]:
    """A GGUF attention setting, one number for every layer or one per layer (hybrid models), as a list per layer."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n_layers


def plan_offload(info: dict, n_ctx: int, gpu_memory_gib: float | None, gpu_offload: bool) -> OffloadPlan:
    """How many repeating layers fit on the serving card, from the GGUF's own tensor sizes."""
    f = info["fields"]
    arch = f["general.architecture"]
    n_layers = int(f[f"{arch}.block_count"])
    n_embd = int(f[f"{arch}.embedding_length"])
    n_head = _per_layer(f[f"{arch}.attention.head_count"], n_layers)
    n_kv = _per_layer(f.get(f"{arch}.attention.head_count_kv", n_head), n_layers)   # 0 on a hybrid's recurrent layers
    head_dim = int(f.get(f"{arch}.attention.key_length", n_embd // max(n_head) if max(n_head) else 0))
    layer_bytes = sum(b for n, b in info["tensor_bytes"].items() if re.match(r"blk\.\d+\.", n))
    other = sum(info["tensor_bytes"].values()) - layer_bytes
    kv_layer = 2 * n_ctx * sum(n_kv) / n_layers * head_dim * 2  # K and V, f16, the layers' mean
    layer_gib, kv_gib = layer_bytes / n_layers / GIB, kv_layer * n_layers / GIB
    plan = OffloadPlan(0, n_layers, round(layer_gib, 6), round(other / GIB, 6), round(kv_gib, 6), gpu_memory_gib, "")
    if gpu_memory_gib is None:
        plan.reason = "smoke.gpu_memory_gib is null: CPU only"
        return plan
    if not gpu_offload:
        plan.reason = "this llama-cpp-python build has no GPU offload (CPU build): CPU only"
        return plan
    usable = gpu_memory_gib * (1 - MARGIN) - COMPUTE_BUFFER_GIB - other / GIB
    per_layer = layer_gib + kv_layer / GIB
    plan.n_gpu_layers = max(0, min(n_layers, int(usable // per_layer))) if per_layer > 0 else n_layers
    plan.reason = (f"{usable:.2f} GiB usable after margin, compute buffer and non-layer tensors; "
                   f"{per_layer:.3f} GiB per layer incl. KV cache")
    return plan


def smoke_file(s: SmokeSection, quant: str, path: Path, prompts: list[data.Sample]) -> SmokeFile:
    try:
        info = llamacpp.read_gguf(path)
    except ValueError as e:
        raise SmokeError(f"{e}; nothing was handed off") from None
    # llama.cpp in a process of its own (see llamacpp_process): what it holds is what the serving card must hold.
    with LlamaProcess(path.name) as llm:
        plan = plan_offload(info, s.n_ctx, s.gpu_memory_gib, llm.call("gpu_offload"))
        before = memory.nvml_used_gib()
        t0 = time.perf_counter()
        try:
            llm.call("load", str(path), n_ctx=s.n_ctx, n_gpu_layers=plan.n_gpu_layers, seed=0)
        except LlamaCrashed:
            raise
        except (ValueError, RuntimeError) as e:
            raise SmokeError(f"{path.name} does not load under llama.cpp (llama-cpp-python {llamacpp.runtime_version()}): "
                             f"{e}; nothing was handed off") from None
        load_s = time.perf_counter() - t0
        loaded = memory.nvml_used_gib()
        passed = stopped = 0
        examples = []
        p_tok = p_ms = g_tok = g_ms = 0.0
        for sample in prompts:
            out = llm.call("chat", sample.prompt_messages, s.max_tokens)
            p_tok, p_ms, g_tok, g_ms = p_tok + out["n_p_eval"], p_ms + out["t_p_eval_ms"], g_tok + out["n_eval"], g_ms + out["t_eval_ms"]
            got = out["content"].strip()
            ends = out["finish_reason"] == "stop"
            ok = got == sample.answer.strip() if s.check == "exact" else (bool(got) and ends)
            passed += ok
            stopped += ends
            if len(examples) < 5 or (not ok and len(examples) < 10):
                examples.append({"id": sample.id, "expected": sample.answer, "got": got, "finish_reason": out["finish_reason"], "ok": ok})
        used = memory.nvml_used_gib()
    n = len(prompts)
    return SmokeFile(
        quant=quant, path=path, plan=plan, n_prompts=n, passed=passed, accuracy=passed / n if n else 0.0,
        stopped_at_eos=stopped,
        prompt_tokens_per_s=round(p_tok / (p_ms / 1000), 1) if p_ms else 0.0,
        gen_tokens_per_s=round(g_tok / (g_ms / 1000), 1) if g_ms else 0.0,
        load_s=round(load_s, 3), device_used_gib=used[0] if used else None, examples=examples,
        device_used_before_load_gib=before[0] if before else None, device_used_after_load_gib=loaded[0] if loaded else None,
        llama_peak_rss_gib=round(llm.peak_rss_gib, 3) if llm.peak_rss_gib else None,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Smoke-test GGUF files under llama.cpp (a stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--gguf", type=Path, action="append", required=True, help="a GGUF file; repeat for several")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    files = [(p.stem.removeprefix("model-"), p) for p in a.gguf]
    for f in run(inputs.load(a.config), files, a.out).files:
        print(f"{f.path.name}: {f.passed}/{f.n_prompts} passed, {f.gen_tokens_per_s} gen tok/s")


if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "smoke"))
