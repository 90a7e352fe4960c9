"""The LoRA adapter for servers that hot-swap it, proven before it ships.

Serving teams that keep one base and many fine-tunes load adapters: `llama-server -m base.gguf --lora adapter.gguf`
(swapped per request), vLLM's multi-LoRA and peft (the PEFT files). The bundle holds both forms beside the merged
GGUFs, and only once llama.cpp has shown that the base with the adapter is the merged model:

    proof = adapter.prove(cfg, adapter_dir, merged_gguf, work_dir, meter)   # the hand-off stage calls it
    proof.files     [(name in the bundle, file)]: adapter_config.json, adapter_model.safetensors (the bundle's folder
                    is then a PEFT adapter directory, as vLLM's --lora-modules and peft load one), adapter-<outtype>.gguf;
                    none when it was not proven
    proof.record    manifest.json's adapter.hot_swap: the figures, or `shipped: false` and why

1. What convert_lora_to_gguf.py cannot map is refused by reading adapter_config.json (`unmappable`): it writes
   lora_A/lora_B pairs of linear modules and one `adapter.lora.alpha`, which llama.cpp applies as alpha / rank of
   each tensor. Fused MoE expert stacks (peft's target_parameters), rsLoRA (alpha / sqrt(r)), per-module alpha
   (alpha_pattern), DoRA's magnitudes, trained biases, modules_to_save and trained token rows are not that.
2. The base GGUF: convert_hf_to_gguf.py on the base model's own directory, in export.outtype, as a serving team
   that keeps the base makes it (no names of this run: the file is theirs to reproduce; its sha256 is recorded).
3. The adapter GGUF: convert_lora_to_gguf.py from the same llama-cpp-python sdist as the runtime and the converter,
   named like the merged files (stages/export/naming.py).
4. Parity: on the held-out texts the fidelity gate measures, llama.cpp's next-token distribution of the base GGUF with
   the adapter applied against that of the merged GGUF of the same type: mean KL, p99 KL and top-1, held to
   export.fidelity's thresholds for that type, as the merged files are.
5. Served: llama.cpp's OpenAI-compatible server on the base GGUF with `--lora_path` the adapter GGUF, asked the smoke
   prompts (stages/export/serving.py), held to smoke.min_accuracy.

Any step that fails leaves the adapter out of the bundle (the merged GGUFs ship as before) and the manifest says
which and why. The base GGUF is deleted once measured: it is as large as the merged model.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from stages import errors
from stages.export import convert, llamacpp, naming

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # in the bundle's own folder: SHA256SUMS lists plain names
OUTTYPES = {"f16", "bf16", "f32", "auto"}  # export.outtype values convert_lora_to_gguf.py also takes


@dataclass
class Proof:
    record: dict                                           # manifest.json's adapter.hot_swap
    files: list[tuple[str, Path]] = field(default_factory=list)  # (name in the bundle, file) when shipped

    @classmethod
    def not_shipped(cls, reason: str, **figures) -> Proof:
        print(f"handoff: the adapter is not in the bundle (the merged GGUFs are): {reason}")
        return cls({"shipped": False, "reason": reason, **figures})


def unmappable(config: dict) -> str | None:
    """Why convert_lora_to_gguf.py (or llama.cpp applying its output) would not reproduce this PEFT adapter; None when
    it maps."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"a {config.get('peft_type')} adapter, not LoRA: convert_lora_to_gguf.py converts LoRA only"
    if config.get("target_parameters"):
        return (f"it adapts fused MoE expert stacks ({', '.join(config['target_parameters'])}: peft's target_parameters, one rank-r "
                "pair per expert); convert_lora_to_gguf.py maps lora_A/lora_B pairs of linear modules only")
    if config.get("use_rslora"):
        return ("rsLoRA: peft scales it by lora_alpha / sqrt(r), llama.cpp applies an adapter GGUF's lora_alpha / r: every "
                f"update would be sqrt({config.get('r')}) times too small; train with use_rslora off to ship the adapter")
    alphas = {v for v in (config.get("alpha_pattern") or {}).values()}
    if alphas - {config.get("lora_alpha")}:
        return (f"per-module alpha (alpha_pattern {config['alpha_pattern']}): the adapter GGUF holds one lora_alpha "
                f"({config.get('lora_alpha')}), so those modules would be scaled wrongly")
    if config.get("use_dora"):
        return "DoRA: its magnitude vectors have no place in an adapter GGUF (convert_lora_to_gguf.py maps lora_A/lora_B only)"
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        return "it trained biases, which an adapter GGUF cannot carry (lora_A/lora_B pairs only)"
    if config.get("modules_to_save") or config.get("trainable_token_indices"):
        return "it holds fully trained modules or token rows (modules_to_save, trainable_token_indices), not LoRA pairs"
    return None


def prove(cfg, adapter_dir: Path, merged_gguf: Path, work_dir: Path, meter) -> Proof:
    """The adapter's bundle files and manifest record, proven against `merged_gguf` (the merged model in
    export.outtype), or the reason it is left out. Intermediates go to `work_dir`; `meter` measures the converters."""
    adapter_dir, work_dir = Path(adapter_dir), Path(work_dir)
    missing = [n for n in PEFT_FILES if not (adapter_dir / n).is_file()]
    if missing:
        return Proof.not_shipped(f"{adapter_dir} has no {', '.join(missing)}: there is no PEFT adapter to hand off")
    why = unmappable(json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8")))
    if why:
        return Proof.not_shipped(why)
    if cfg.export.outtype not in OUTTYPES:
        return Proof.not_shipped(f"export.outtype {cfg.export.outtype} is not a type convert_lora_to_gguf.py writes")
    work_dir.mkdir(parents=True, exist_ok=True)
    base = work_dir / f"base-{cfg.export.outtype}.gguf"
    room = errors.Filesystem.of(work_dir)
    if room.free < Path(merged_gguf).stat().st_size * 1.05:  # the base GGUF is the merged one's size (same tensors, same type)
        return Proof.not_shipped(f"the proof converts the base model to a GGUF as large as {Path(merged_gguf).name} "
                                 f"({errors.gib(Path(merged_gguf).stat().st_size)}), and the filesystem mounted at {room.mount} "
                                 f"has {room.describe()}; free space there to ship the adapter")
    try:
        return _prove(cfg, adapter_dir, Path(merged_gguf), work_dir, base, meter)
    except Exception as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or isinstance(e, errors.DiskFull):
            raise  # a full disk is the stage's error, not the adapter's
        (work_dir / "error.log").write_text(traceback.format_exc())
        for p in work_dir.glob("*.partial"):
            p.unlink(missing_ok=True)
        return Proof.not_shipped(f"{type(e).__name__}: {str(e)[:500]} (the whole trace: {work_dir / 'error.log'})")
    finally:
        base.unlink(missing_ok=True)  # as large as the merged model: nothing needs it once measured


def _prove(cfg, adapter_dir: Path, merged_gguf: Path, work_dir: Path, base: Path, meter) -> Proof:
    from stages.checksums import sha256_file
    from stages.model.directory import resolve_model_dir

    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 2)
        clock = now

    from stages.model.load import load_tokenizer

    converter = llamacpp.converter_dir()
    base_dir = resolve_model_dir(cfg.model.name_or_path)
    # named as the merged GGUFs are: the name decides how llama.cpp reads some vocabularies (vocab.served_name)
    names = naming.override(cfg.handoff.model_name, cfg.model.name_or_path, base_dir, load_tokenizer(cfg.model))
    (work_dir / "base-names.json").write_text(json.dumps(names, indent=2))
    gguf = work_dir / f"adapter-{cfg.export.outtype}.gguf"
    # peft's card beside the adapter tags it with the training machine's base path: those tags are not the serving team's
    (work_dir / "gguf-names.json").write_text(json.dumps(names | {"general.tags": ["lora"]}, indent=2))
    # The two converters read different inputs (the base's weights; the adapter and the base's config) and each spends
    # most of a small model's conversion importing torch: side by side, in two processes
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(convert.convert, meter, converter, base_dir, base, cfg.export.outtype, source=base_dir,
                            stage="handoff", metadata=work_dir / "base-names.json"),
                pool.submit(convert_adapter, meter, converter, adapter_dir, base_dir, gguf, cfg.export.outtype,
                            work_dir / "gguf-names.json")]
        for job in jobs:
            job.result()   # the first failure raises, as one after the other would
    base_record = {"bytes": base.stat().st_size, "sha256": sha256_file(base), "outtype": cfg.export.outtype,
                   "made_by": f"llama-cpp-python {llamacpp.runtime_version()}'s convert_hf_to_gguf.py"}
    info = llamacpp.read_gguf(gguf)
    lap("convert_base_and_adapter")
    parity = measure(cfg, merged_gguf, base, gguf)
    lap("parity")
    figures = {"base_gguf": base_record, "parity": parity, "seconds": seconds}
    print(f"handoff: adapter parity, {base.name} + {gguf.name} against {merged_gguf.name}: mean KL {parity['mean_kl']:.6f}, "
          f"top-1 {parity['top1_agreement']:.1%} over {parity['positions']} positions{'' if parity['passed'] else '  FAILED'}")
    if not parity["passed"]:
        return Proof.not_shipped(
            f"llama.cpp with {gguf.name} on the base GGUF is not the merged model: mean KL {parity['mean_kl']:.4f} (max "
            f"{parity['max_mean_kl']}), top-1 {parity['top1_agreement']:.1%} (min {parity['min_top1']:.0%}) against "
            f"{merged_gguf.name}" + _merged_elsewhere(cfg), **figures)
    served = serve(cfg, base, gguf, work_dir)
    lap("served")
    figures["served"] = {k: v for k, v in served.items() if k != "examples"}
    print(f"handoff: adapter served (OpenAI chat completions, {base.name} --lora_path {gguf.name}): {served['passed']}/"
          f"{served['n_prompts']} passed, {served['stopped_at_eot']} stopped at end of turn")
    if served["accuracy"] < cfg.smoke.min_accuracy:
        miss = next((e for e in served["examples"] if not e["ok"]), served["examples"][0])
        return Proof.not_shipped(
            f"served with the adapter, {served['passed']}/{served['n_prompts']} prompts passed ({served['accuracy']:.0%} < "
            f"smoke.min_accuracy {cfg.smoke.min_accuracy:.0%}), e.g. expected {miss['expected']!r}, got {miss['got']!r}", **figures)
    record = {"shipped": True, "peft": list(PEFT_FILES), "gguf": gguf.name,
              "gguf_lora_alpha": info["fields"].get("adapter.lora.alpha"), "gguf_tensors": len(info["tensor_types"]), **figures}
    files = [(n, adapter_dir / n) for n in PEFT_FILES] + [(gguf.name, gguf)]
    return Proof(record, files)


def _merged_elsewhere(cfg) -> str:
    if cfg.quantization.load_in_4bit:
        return ("; a QLoRA adapter merged into the dequantized NF4 weights (merge.base) is not the original base plus the "
                "adapter by design")
    return ""


def convert_adapter(meter, converter: Path, adapter_dir: Path, base_dir: Path, dst: Path, outtype: str, names: Path) -> None:
    """convert_lora_to_gguf.py on the PEFT adapter (the base's config.json gives the architecture), through the same
    launcher as the model converter; its output in <dst>.convert.log."""
    import subprocess

    script = lora_script(converter)
    tmp = dst.with_suffix(".gguf.partial")
    cmd, env, _pre = convert.command(converter, adapter_dir, tmp, "--base", str(base_dir), "--outtype", outtype,
                                     "--metadata", str(names), script=script.name)
    proc = meter.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log = dst.with_suffix(".convert.log")
    log.write_text(proc.stdout or "")
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        if "No space left on device" in (proc.stdout or ""):
            raise errors.no_space(OSError(errno.ENOSPC, "No space left on device", str(tmp)))
        last = next((line.strip() for line in reversed((proc.stdout or "").splitlines()) if line.strip()), "no output")
        raise RuntimeError(f"convert_lora_to_gguf.py cannot convert {adapter_dir} (exit {proc.returncode}): {last[:300]}; "
                           f"its output: {log}")
    tmp.rename(dst)


def lora_script(converter: Path) -> Path:
    """convert_lora_to_gguf.py beside the model converter, taken from the same verified llama-cpp-python sdist that
    scripts/install.sh extracted the converter from (an install before the adapter was handed off lacks it)."""
    script = converter / convert.LORA_SCRIPT
    if script.is_file():
        return script
    version = llamacpp.runtime_version()
    sdist = llamacpp.CACHE / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        raise llamacpp.ConverterMismatch(f"{script} is missing and so is the sdist it comes from ({sdist}); run "
                                         "`bash scripts/install.sh` to fetch the llama-cpp-python sdist")
    member = f"llama_cpp_python-{version}/vendor/llama.cpp/{convert.LORA_SCRIPT}"
    with tarfile.open(sdist) as tar:
        data = tar.extractfile(member).read()
    tmp = script.with_suffix(f".{time.time_ns()}.partial")
    tmp.write_bytes(data)
    tmp.rename(script)  # atomic: two runs extracting at once write the same bytes
    return script


def measure(cfg, merged_gguf: Path, base: Path, adapter_gguf: Path) -> dict:
    """Next-token KL(merged || base + adapter) and top-1 agreement under llama.cpp on the held-out texts, both files
    loaded in one llama.cpp process of their own; thresholds those of export.fidelity for export.outtype."""
    import torch

    from stages.export import fidelity
    from stages.export.llamacpp_process import LlamaProcess
    from stages.model.load import load_tokenizer

    sequences = fidelity.held_out_ids(cfg, load_tokenizer(cfg.model), cfg.export.fidelity.samples)
    n_ctx = max(len(s) for s in sequences)
    with LlamaProcess(merged_gguf.name) as llm:
        llm.call("load", str(merged_gguf), n_ctx=n_ctx, logits_all=True, n_gpu_layers="all")
        ref = [torch.log_softmax(torch.from_numpy(llm.call("scores", ids)).float(), dim=-1) for ids in sequences]
        llm.what = f"{base.name} with {adapter_gguf.name}"
        llm.call("load", str(base), n_ctx=n_ctx, logits_all=True, n_gpu_layers="all", lora_path=str(adapter_gguf))
        got = [torch.from_numpy(llm.call("scores", ids)).float() for ids in sequences]
    kl, top1 = fidelity.compare(ref, got)
    max_kl, min_top1 = cfg.export.fidelity.thresholds(cfg.export.outtype)
    mean = float(kl.mean())
    return {"against": merged_gguf.name, "positions": kl.numel(), "mean_kl": round(mean, 6), "p99_kl": round(float(kl.quantile(0.99)), 6),
            "top1_agreement": round(top1, 4), "max_mean_kl": max_kl, "min_top1": min_top1,
            "passed": mean <= max_kl and top1 >= min_top1}


def serve(cfg, base: Path, adapter_gguf: Path, work_dir: Path) -> dict:
    """The smoke prompts through llama.cpp's OpenAI-compatible server on the base GGUF with the adapter applied, with
    as many layers on the GPU as smoke.gpu_memory_gib holds (the plan the smoke stage makes)."""
    from stages import smoke
    from stages.export import serving
    from stages.export.llamacpp_process import LlamaProcess

    with LlamaProcess(base.name) as llm:
        offload = llm.call("gpu_offload")
    plan = smoke.plan_offload(llamacpp.read_gguf(base), cfg.smoke.n_ctx, cfg.smoke.gpu_memory_gib, offload)
    return serving.ask(base, cfg.smoke, smoke.load_prompts(cfg), n_gpu_layers=plan.n_gpu_layers, log=work_dir / "server-adapter.log",
                       lora=adapter_gguf).to_json()
