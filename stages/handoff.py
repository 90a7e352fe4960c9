"""Publish the bundle the serving team picks up: GGUFs, checksums and a manifest.

    artifacts/handoff/<model_name>/<version>/
        model-Q4_K_M.gguf, model-Q5_K_S.gguf
        SHA256SUMS        `sha256sum -c SHA256SUMS` verifies every other file
        manifest.json     base model + hash, adapter hash, data fingerprint, config, quant
                          types (with llama.cpp's fallback tensors per file), merge choice,
                          fidelity, smoke results, per-stage memory peaks, stop tokens,
                          versions, Prefect flow-run id
        Modelfile         Ollama: FROM the first GGUF, TEMPLATE (with the default system
                          turn, if the chat template has one), stop tokens
        README.md         the model card
        comparison.md     the champion/challenger table against the bundle `latest` pointed at (.json too)
        adapter_config.json, adapter_model.safetensors, adapter-f16.gguf
                          the LoRA adapter (PEFT, and llama.cpp's adapter GGUF) for servers that hot-swap it, where
                          llama.cpp proved the base GGUF with it is the merged model (handoff.adapter: auto,
                          stages/export/adapter.py); manifest.json's adapter.hot_swap has the figures, or why not
    artifacts/handoff/<model_name>/latest -> <version>, when the bundle is no worse than what it pointed at
                                             (stages/champion.py); a worse one stays a candidate

Publishing is atomic: the bundle is built in a hidden temporary directory next to its
final place and renamed into place, then `latest` is switched with a rename. The GGUFs are
reflinked or hard-linked from the run (read-only) where they share a filesystem, copied where
they do not (`place`): a 7B's ~10 GB are not written twice. A failure at
any point leaves every published version, and `latest`, as they were. Versions are
never overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from stages import champion, checksums, errors, paths, quants
from stages.artifact import Artifact
from stages.checksums import sha256_dir, sha256_file
from stages.config import RunConfig
from stages.errors import DiskFull, RunError
from stages.export import adapter, modelcard, quant_types
from stages.memory import MemoryReport, track
from stages.model.directory import resolve_model_dir

if TYPE_CHECKING:
    from stages.export.stage import ExportResult
    from stages.merge import MergeResult
    from stages.preflight import PreflightResult
    from stages.smoke import SmokeResult
    from stages.train.stage import TrainResult

PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "llama_cpp_python", "gguf", "prefect")


@dataclass
class HandoffResult:
    bundle_dir: Path
    manifest: Path
    version: str
    files: list[str]
    memory: MemoryReport | None
    promoted: bool = True        # `latest` points at this bundle (champion.compare found it no worse)
    comparison: str = ""         # the champion/challenger table (Markdown), also comparison.md in the bundle

    def artifacts(self) -> list[Artifact]:
        return [Artifact("champion-challenger", f"{self.version} against the bundle `latest` pointed at", markdown=self.comparison)]


def run(
    cfg: RunConfig,
    version: str,
    gguf_files: list[tuple[str, Path]],
    out_dir: Path,
    *,
    adapter_dir: Path,
    data_fingerprint: str,
    smoke: dict,
    memory: dict[str, MemoryReport | None],
    fidelity: list | None = None,
    merge: dict | None = None,
    extra: dict | None = None,
    extra_files: list[Path] = (),
    merged_gguf: Path | None = None,
) -> HandoffResult:
    """Publish <handoff.dir>/<model_name>/<version>/ atomically and point `latest` at it.

    Args:
        version: the bundle's name; the run id. An existing version is an error.
        gguf_files: (quant type, path) of the files that passed export and smoke.
        out_dir: the run's handoff stage directory (memory.json goes there).
        smoke: per-file smoke figures, stored in the manifest.
        memory: per-stage memory reports, stored in the manifest.
        fidelity: per-file fidelity.Fidelity figures (dicts), stored in the manifest and model card.
        merge: what the adapter was merged into and the KL of each choice.
        extra: anything else for the manifest (e.g. the Prefect flow-run id).
        extra_files: other files for the bundle, placed and checksummed as the GGUFs are (the importance matrix).
        merged_gguf: the merged model in export.outtype, what the adapter is proven against (handoff.adapter: auto,
            stages/export/adapter.py); without it the bundle holds no adapter and the manifest says so.
    """
    root = Path(cfg.handoff.dir) / cfg.handoff.model_name
    final = root / paths.check_run_id(version)
    in_the_way = paths.bundle_in_the_way(final)
    if in_the_way:
        raise in_the_way
    if champion.latest_problem(root):  # found before the bundle is built: nothing is published half-way
        raise RunError(champion.latest_problem(root))
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{version}.*"):  # what a killed earlier attempt of this version left
        shutil.rmtree(stale, ignore_errors=True)
    with track("handoff", out_dir, gpu=False) as meter:
        proof = hot_swap(cfg, adapter_dir, merged_gguf, Path(out_dir) / "adapter", meter)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=root))
        try:
            placed = place_all([Path(p) for _quant, p in gguf_files] + [Path(p) for p in extra_files], proof.files, tmp)
            names = list(placed)
            sums = {n: sha256_file(tmp / n) for n in names}
            serving = _serving(cfg, gguf_files[0][1])
            manifest = _manifest(cfg, version, gguf_files, sums, adapter_dir, data_fingerprint, smoke, memory,
                                 {"fidelity": fidelity or [], "merge": merge or {}, "stop_tokens": serving["stops"], "placed": placed,
                                  "held_out_fingerprint": champion.held_out_fingerprint(cfg)} | (extra or {}))
            manifest["adapter"]["hot_swap"] = proof.record
            verdict = (champion.compare(cfg, json.loads(json.dumps(manifest, default=str)), champion.champion_of(root))
                       if cfg.handoff.promotion.compare else champion.Verdict(None, True))
            manifest["promotion"] = {"promoted": verdict.promote, "champion": verdict.champion, "worse": verdict.reason}
            (tmp / "comparison.md").write_text(verdict.markdown())
            (tmp / "comparison.json").write_text(json.dumps(verdict.to_json(), indent=2))
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
            ggufs = [Path(p).name for _q, p in gguf_files]
            text, template = modelcard.modelfile(ggufs[0], ggufs[1:], n_ctx=cfg.smoke.n_ctx, **serving)
            (tmp / "Modelfile").write_text(text)
            (tmp / "README.md").write_text(modelcard.readme(json.loads((tmp / "manifest.json").read_text()), template))
            listed = [*names, "manifest.json", "Modelfile", "README.md", "comparison.md", "comparison.json"]
            (tmp / checksums.SUMS).write_text(checksums.render({n: sums.get(n) or sha256_file(tmp / n) for n in listed}))
            _fsync_dir(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the serving team must read it
            os.rename(tmp, final)  # atomic on one filesystem; fails if `final` appeared meanwhile
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                need = sum(Path(p).stat().st_size for _q, p in gguf_files) + sum(p.stat().st_size for _n, p in proof.files)
                fs = errors.Filesystem.of(root)
                raise DiskFull(errno.ENOSPC, f"disk full while writing the bundle under {root.resolve()} (it needs {errors.gib(need)}; "
                               f"the filesystem mounted at {fs.mount} has {fs.describe()}); nothing was published and `latest` "
                               "is unchanged; free space there and run again, or point handoff.dir at a larger disk") from e
            raise
        if verdict.promote:
            _point_latest(root, version)
    return HandoffResult(final, final / "manifest.json", version, names, meter.report, verdict.promote, verdict.markdown())


def place_all(files: list[Path], named: list[tuple[str, Path]], bundle: Path) -> dict[str, str]:
    """`files` under their own names and `named` (name in the bundle, file) placed into `bundle`: name -> how (`place`)."""
    placed = {}
    for name, src in [(f.name, f) for f in files] + named:
        placed[name] = place(src, bundle / name)
        errors.inject("handoff-copy", bundle / name)
    return placed


def hot_swap(cfg: RunConfig, adapter_dir: Path, merged_gguf: Path | None, work_dir: Path, meter) -> adapter.Proof:
    """The adapter's files for the bundle, proven (handoff.adapter: auto), or why there are none."""
    if cfg.handoff.adapter == "off":
        return adapter.Proof({"shipped": False, "reason": "handoff.adapter: off"})
    if merged_gguf is None or not Path(merged_gguf).is_file():
        return adapter.Proof.not_shipped(f"the hand-off was given no merged GGUF in export.outtype ({merged_gguf or 'none'}) to prove "
                                         "the adapter against")
    return adapter.prove(cfg, adapter_dir, Path(merged_gguf), work_dir, meter)


def from_stages(cfg: RunConfig, run_id: str, data_fingerprint: str, flow_run_id: str | None, pre: PreflightResult,
                tr: TrainResult, mg: MergeResult, ex: ExportResult, sm: SmokeResult, out_dir: Path) -> HandoffResult:
    """Publish the bundle of one pipeline run (`run`) from what its stages returned.

    The manifest records the adapter, each GGUF's smoke and fidelity figures, every stage's memory, the merge, the
    importance matrix (shipped in the bundle only where a kept file was quantized with it) and the training figures.

    Args:
        run_id: the run's id, the bundle's version.
        data_fingerprint: the train and eval files' content (data.fingerprint), what retraining compares.
        flow_run_id: the Prefect flow run's id, recorded in the manifest; None outside one.
        pre, tr, mg, ex, sm: the Results of preflight, train, merge, export and smoke.
        out_dir: the run's handoff stage directory.
    """
    imat = ex.imatrix
    return run(cfg, run_id, ex.gguf_files(), out_dir, adapter_dir=tr.adapter_dir, data_fingerprint=data_fingerprint,
               smoke=smoke_figures(sm), memory=stage_memory(pre, tr, mg, ex, sm), fidelity=ex.fidelity_table(),
               merge={"base": mg.base, "save_dtype": mg.save_dtype, "kl": mg.kl},
               extra_files=[Path(imat["file"])] if imat and imat.get("used_by") else [], merged_gguf=ex.base_gguf,
               extra={"prefect_flow_run_id": flow_run_id, "imatrix": imat and {**imat, "file": Path(imat["file"]).name},
                      "train": {"steps": tr.steps, "first_loss": tr.first_loss, "final_loss": tr.final_loss, "fit": tr.fit,
                                "best_eval_loss": tr.best_eval_loss}})


def smoke_figures(sm: SmokeResult) -> dict:
    """Per GGUF what the smoke test measured, under llama.cpp and through its server (without the example answers)."""
    return {f.quant: {"accuracy": f.accuracy, "passed": f.passed, "n_prompts": f.n_prompts, "gen_tokens_per_s": f.gen_tokens_per_s,
                      "n_gpu_layers": f.plan.n_gpu_layers,
                      "served": {k: v for k, v in (f.served or {}).items() if k != "examples"} or None} for f in sm.files}


def stage_memory(pre: PreflightResult, tr: TrainResult, mg: MergeResult, ex: ExportResult, sm: SmokeResult) -> dict:
    return {"preflight": pre.memory, "train": tr.memory, "merge": mg.memory, "export": ex.memory, "smoke": sm.memory}


FICLONE = 0x40049409  # linux/fs.h: share the source's blocks, copy-on-write (btrfs, XFS, bcachefs, overlayfs on those)


def place(src: Path, dst: Path) -> str:
    """Put a GGUF into the bundle without copying its bytes where the filesystem allows; returns how.

    reflink   the file's blocks shared copy-on-write: the bundle's file is independent of the run's
    hardlink  the same inode, both names made read-only first, so neither the run nor anything else can
              rewrite a published file in place (a rewrite must make a new file, which the link does not follow)
    copy      another filesystem, or one that links nothing (the bundle then holds its own bytes)
    The bundle's SHA256SUMS are computed from the placed file either way.
    """
    import fcntl

    try:
        with src.open("rb") as s, dst.open("wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        shutil.copystat(src, dst)
        dst.chmod(0o444)
        return "reflink"
    except OSError:
        dst.unlink(missing_ok=True)
    try:
        src.chmod(0o444)
        os.link(src, dst)
        return "hardlink"
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
    shutil.copy2(src, dst)
    dst.chmod(0o444)
    return "copy"


def _manifest(cfg, version, gguf_files, sums, adapter_dir, data_fingerprint, smoke, memory, extra) -> dict:
    base_dir = resolve_model_dir(cfg.model.name_or_path)
    return {
        "model_name": cfg.handoff.model_name,
        "version": version,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base_model": {"name_or_path": cfg.model.name_or_path, "sha256": sha256_dir(base_dir)},
        "adapter": {"sha256": sha256_dir(adapter_dir), "method": "qlora" if cfg.quantization.load_in_4bit else "lora"}
        | _adapted(adapter_dir),
        "data_fingerprint": data_fingerprint,
        "files": [
            {"file": Path(p).name, "quant": q, "sha256": sums[Path(p).name], "bytes": Path(p).stat().st_size} | _fallbacks(q, p)
            for q, p in gguf_files
        ],
        "smoke": smoke,
        "memory_peaks": {k: (v.to_json() if v is not None else None) for k, v in memory.items()},
        "versions": _versions(),
        "config": json.loads(cfg.model_dump_json()),
    } | extra


def _adapted(adapter_dir: Path) -> dict:
    """What the adapter trained, as peft saved it: its rank, the modules, and the fused expert stacks (one rank-r
    pair per expert) that the serving team's card names."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():   # an adapter handed in from elsewhere: its hash is all the manifest can say
        return {}
    saved = json.loads(path.read_text())
    return {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"),
            "target_modules": sorted(saved.get("target_modules") or []),
            "target_parameters": sorted(saved.get("target_parameters") or [])}


def _fallbacks(quant: str, gguf: Path) -> dict:
    """Tensors llama.cpp gave its fallback type because their rows are not a multiple of 256 (export checked each)."""
    from stages.export import llamacpp

    if quant not in quants.TYPES:
        return {}
    counts = quant_types.fallbacks(quant_types.expected(llamacpp.read_gguf(gguf), quant))
    return {"n_fallback": sum(counts.values()), "fallbacks": counts}


def _serving(cfg: RunConfig, gguf: Path) -> dict:
    """Chat template, BOS/EOS and stop strings, as the GGUF holds them (export checked they equal the HF tokenizer's)."""
    from stages.export import llamacpp
    from stages.export.llamacpp_process import LlamaProcess
    from stages.model.load import load_tokenizer

    tok = load_tokenizer(cfg.model)
    f = llamacpp.read_gguf(gguf)["fields"]
    template = f.get("tokenizer.chat_template") or tok.chat_template
    with LlamaProcess(gguf.name) as vocab:
        vocab.call("load", str(gguf), vocab_only=True)
        stops = stop_tokens(vocab, tok, template, resolve_model_dir(cfg.model.name_or_path))
        add_bos = f.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default depends on the tokenizer (SentencePiece yes, SmolLM's BPE no): ask it
            add_bos = vocab.call("add_bos")
    return {"template": template, "bos_token": tok.bos_token or "", "eos_token": tok.eos_token or "", "stops": stops,
            "add_bos": bool(add_bos)}


def stop_tokens(vocab, tok, template: str, model_dir: Path) -> list[str]:
    """The model's end-of-generation tokens, end of turn first: the special token the chat template closes an
    assistant turn with ("<|im_end|>", Gemma's "<end_of_turn>", "</s>"), the tokenizer's EOS and generation_config.json's
    eos_token_id(s); each only if the GGUF's vocabulary (`vocab`, loaded in a llama.cpp process) has it as one token.

    Not llama.cpp's own end-of-generation set: it takes any token whose text is "</s>", "<|endoftext|>", a FIM marker...
    and Qwen's byte-level vocabulary has "</s>" as plain text (token 128247), which a stop string would then cut out of
    any answer that writes HTML's strike-through end tag."""
    turn_end = modelcard.assistant_turn_end(template, tok.bos_token or "", tok.eos_token or "")
    end_of_turn = vocab.call("special_tokens", [turn_end])[0][:1] if turn_end else []
    try:
        gen = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError):
        gen = None
    eos_ids = [gen] if isinstance(gen, int) else [i for i in gen or [] if isinstance(i, int)]
    declared = [tok.eos_token, *(tok.convert_ids_to_tokens(i) for i in eos_ids if i < len(tok))]
    candidates = list(dict.fromkeys(t for t in [*end_of_turn, *declared] if t))
    pieces = vocab.call("tokenize", candidates)
    return [t for t, ids in zip(candidates, pieces, strict=True) if len(ids) == 1]


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def _fsync_dir(d: Path) -> None:
    for f in d.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())


def _point_latest(root: Path, version: str) -> None:
    tmp = root / f".{champion.LATEST}.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(version)
    try:
        os.replace(tmp, root / champion.LATEST)  # rename over the old link: readers see old or new, never none
    finally:
        if tmp.is_symlink():  # the rename failed: no stray link left beside the versions
            tmp.unlink()
