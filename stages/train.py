"""Train a LoRA (or, with quantization.load_in_4bit, QLoRA) adapter on the run's dataset.

    python -m stages.train --config configs/default.yaml [--out artifacts/runs/x/train]

The base model is frozen: 16-bit, or NF4 through bitsandbytes for QLoRA. Settings that
silently lose memory savings are set explicitly here, not left to defaults:

- `model.train()` before gradient checkpointing: `from_pretrained` returns eval mode, in
  which checkpointing silently does nothing.
- non-reentrant checkpointing with input grads enabled, so a frozen embedding still lets
  gradients reach the first adapted layer.
- no `prepare_model_for_kbit_training`: it upcasts embeddings, lm_head and norms to fp32
  (+2 GiB and 3.5x slower steps on a 7B, measured in ../shared/anchors).

Checkpoints go to <out>/checkpoints every `training.save_steps`; running again after a
crash resumes from the last one. Per-step memory goes to <out>/memory_steps.jsonl, the
loss curve to <out>/loss.jsonl and <out>/loss.png.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback

from stages import autofit, data, memory
from stages.config import ConfigError, RunConfig, load_config
from stages.errors import UserError
from stages.memory import MemoryReport
from stages.modelio import compute_dtype, device, load_base, load_tokenizer
from stages.offload import OffloadActivations, embeddings_to_host


@dataclass
class TrainResult:
    adapter_dir: Path
    steps: int
    first_loss: float
    final_loss: float
    train_tokens: int          # non-padding tokens trained on by this process
    tokens_per_s: float
    trainable_params: int
    resumed_from: str | None   # checkpoint the run continued from, if any
    loss_png: Path
    memory: MemoryReport | None
    skipped: bool = False      # the adapter was already there
    oom_recoveries: list = field(default_factory=list)  # each: step, post-mortem, new micro-batch
    memory_png: Path | None = None
    fit: dict = field(default_factory=dict)  # checkpointed layers, offload, and why (autofit.FitChoice)


MAX_OOM_RETRIES = 2  # each halves the micro-batch and doubles accumulation
LAUNCHED = "TAE_LAUNCHED"  # set in the processes `accelerate launch` starts for this stage


class TrainOOMError(UserError, RuntimeError):
    """CUDA ran out of memory and halving the micro-batch did not help (or cannot)."""


def run_launched(cfg: RunConfig, out_dir: Path) -> TrainResult:
    """Training as `accelerate launch` in a subprocess (launcher: accelerate), output streamed
    line by line. If this call is interrupted (a cancelled flow run: SIGTERM, or an exception)
    the launcher's process group is stopped, and if this process is killed outright the
    launcher gets SIGTERM from the kernel: no orphan keeps the GPUs."""
    import signal
    import subprocess
    import sys

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = out_dir / "launch_config.yaml"
    resolved.write_text(cfg.to_yaml())
    n = cfg.training.num_processes
    if torch.cuda.is_available() and n > torch.cuda.device_count():
        raise ConfigError(f"training.num_processes: {n}, but this machine shows {torch.cuda.device_count()} GPU(s) "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); one process per GPU: "
                          f"set it to at most {torch.cuda.device_count()}")
    if torch.cuda.is_available():
        launcher = ["accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no", *(["--multi_gpu"] if n > 1 else [])]
    else:  # accelerate's multi-CPU path needs MPI; torchrun (what it wraps on GPUs) does CPU with gloo
        launcher = ["torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
    cmd = [sys.executable, "-m", *launcher, "-m", "stages.train", "--config", str(resolved), "--out", str(out_dir)]
    print("train: " + " ".join(cmd))
    with memory.track("train", out_dir / "launcher") as meter:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=os.environ | {LAUNCHED: "1", "PYTHONUNBUFFERED": "1"}, preexec_fn=die_with_parent)
        # A cancelled flow run gets SIGTERM: stop the launcher first, then let Prefect's own handler act.
        installed, previous = _stop_on_sigterm(proc)
        try:
            for line in proc.stdout:
                print(line.rstrip())
            rc = proc.wait()
        except BaseException:
            _stop(proc)
            raise
        finally:
            if installed:
                signal.signal(signal.SIGTERM, previous)
    if rc != 0 or not (out_dir / "train_result.json").is_file():
        raise RuntimeError(f"accelerate launch of stages.train exited with {rc}; its output is above")
    result = _load_result(out_dir / "train_result.json")
    result.memory, result.skipped = result.memory or meter.report, False
    return result


try:  # loaded before any fork: only the prctl call itself runs between fork and exec
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux
    _LIBC = None


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG).
    Set in the launcher (whose parent is the flow run) and in each rank (whose parent is the launcher)."""
    import signal

    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)


def _stop_on_sigterm(proc):
    """Install a SIGTERM handler that stops `proc`'s group and then defers to the previous handler."""
    import signal

    def handler(signum, frame):
        _stop(proc)
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(f"train: stopped by signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the launcher still dies with this process (PDEATHSIG)
        return False, None
    return True, signal.SIG_DFL if previous is None else previous


def _stop(proc, grace_s: float = 10) -> None:
    """SIGTERM to the launcher's process group (torchrun forwards it to the ranks), SIGKILL after `grace_s`."""
    import signal
    import subprocess

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(cfg: RunConfig, out_dir: Path, *, inject_oom_at: int | None = None) -> TrainResult:
    """Train the adapter into <out_dir>/adapter; resume from <out_dir>/checkpoints if present.

    On a CUDA out-of-memory error: write <out_dir>/oom-postmortem-<n>.json, then resume from
    the last checkpoint with half the micro-batch and twice the accumulation (the same
    effective batch and optimizer step), up to MAX_OOM_RETRIES times.

    Args:
        inject_oom_at: test hook; raise torch.OutOfMemoryError when optimizer step N begins
            (first attempt only).
    """
    out_dir = Path(out_dir)
    done = out_dir / "train_result.json"
    if done.is_file() and (out_dir / "adapter" / "adapter_config.json").is_file():
        print(f"train: adapter already trained in {out_dir / 'adapter'}; skipping")
        return _load_result(done)
    if cfg.training.launcher == "accelerate" and not os.environ.get(LAUNCHED):
        return run_launched(cfg, out_dir)

    tokenizer = load_tokenizer(cfg.model)
    samples = data.read_jsonl(cfg.data.train_file)
    tok = data.tokenize(samples, tokenizer, cfg.data.max_length, cfg.data.long_sample_policy)
    train_rows = rows(tok)
    attempt_cfg, recoveries = cfg, []
    with memory.track("train", out_dir) as meter:
        while True:
            model = build_model(attempt_cfg)
            fit = choose_fit(attempt_cfg, model, train_rows, tokenizer.pad_token_id, out_dir)
            collator = Collator(tokenizer.pad_token_id)
            hooks = [InjectOOM(inject_oom_at)] if inject_oom_at and not recoveries else []
            if attempt_cfg.training.memory_snapshot_steps and torch.cuda.is_available() and not recoveries:
                hooks.append(MemorySnapshot(attempt_cfg.training.memory_snapshot_steps, out_dir / "memory_snapshot.pickle"))
            trainer = make_trainer(attempt_cfg, model, train_rows, collator, out_dir, callbacks=hooks)
            resume = last_checkpoint(out_dir / "checkpoints")
            if resume:
                print(f"train: resuming from {resume}")
            t0 = time.perf_counter()
            try:
                trainer.train(resume_from_checkpoint=str(resume) if resume else None)
                break
            except torch.OutOfMemoryError as e:
                report = postmortem(e, attempt_cfg, trainer, model, collator, out_dir / f"oom-postmortem-{len(recoveries) + 1}.json")
                release(trainer)
                del trainer, model
                memory.free_gpu()
                b = attempt_cfg.training.per_device_train_batch_size
                if attempt_cfg.training.fit == "speed":
                    # the measured fit was too tight: checkpoint every layer before touching the batch
                    attempt_cfg = attempt_cfg.model_copy(update={"training": attempt_cfg.training.model_copy(update={"fit": "memory"})})
                    recoveries.append({"step": report["step"], "postmortem": report["path"], "fit": "memory"})
                    print(f"train: CUDA OOM at step {report['step']} with fit: speed; post-mortem {report['path']}; resuming with fit: memory")
                    continue
                if len(recoveries) >= MAX_OOM_RETRIES or b == 1:
                    raise TrainOOMError(
                        f"CUDA out of memory at step {report['step']} with micro-batch {b} (rows {report['batch']['ids'][:4]}); "
                        f"{'no smaller micro-batch is possible' if b == 1 else f'{MAX_OOM_RETRIES} retries used'}. "
                        f"Post-mortem: {report['path']}. Run the preflight with this budget to get a change that fits."
                    ) from e
                attempt_cfg = halve_micro_batch(attempt_cfg)
                t = attempt_cfg.training
                recoveries.append({"step": report["step"], "postmortem": report["path"], "resumed_from": str(last_checkpoint(out_dir / "checkpoints")),
                                   "per_device_train_batch_size": t.per_device_train_batch_size, "gradient_accumulation_steps": t.gradient_accumulation_steps})
                print(f"train: CUDA OOM at step {report['step']}; post-mortem {report['path']}; resuming with micro-batch "
                      f"{t.per_device_train_batch_size} x accumulation {t.gradient_accumulation_steps}")
            except RuntimeError as e:
                if is_dataloader_shm_error(e):
                    raise RuntimeError(
                        f"not a GPU out-of-memory: a DataLoader worker ran out of shared memory (/dev/shm) ({e}); "
                        "keep dataloader workers at 0 or give the container more /dev/shm (docker --shm-size)"
                    ) from e
                raise
        wall = time.perf_counter() - t0
        release(trainer)
        if trainer.is_world_process_zero():  # DDP: rank 0 writes the adapter and the results
            model.save_pretrained(out_dir / "adapter", safe_serialization=True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # Trainer and model hold each other through cycles (callbacks, hooks, Liger's bound forward):
        # collected here, inside the stage, or the next stage would start with this model still allocated.
        del model
        memory.free_gpu()
        meter.extra["steps_this_process"] = trainer.state.global_step - (_step_of(resume) if resume else 0)
        meter.extra["oom_recoveries"] = recoveries
        meter.extra["fit"] = memory.jsonable(fit)
    if not trainer.is_world_process_zero():
        return None
    losses = [e for e in trainer.state.log_history if "loss" in e]
    tokens = collator.tokens(trainer.micro_batches) * trainer.args.world_size  # each DDP rank trains its own share
    result = TrainResult(
        adapter_dir=out_dir / "adapter",
        steps=trainer.state.global_step,
        first_loss=losses[0]["loss"] if losses else float("nan"),
        final_loss=losses[-1]["loss"] if losses else float("nan"),
        train_tokens=tokens,
        tokens_per_s=round(tokens / wall, 1) if wall > 0 else 0.0,
        trainable_params=trainable,
        resumed_from=str(resume) if resume else None,
        loss_png=plot_loss(losses, out_dir),
        memory=meter.report,
        oom_recoveries=recoveries,
        memory_png=plot_memory(out_dir, _budget_gib(cfg)),
        fit=memory.jsonable(fit),
    )
    done.write_text(json.dumps(memory.jsonable(result), indent=2))
    return result


def choose_fit(cfg: RunConfig, model, train_rows: list[dict], pad_id: int, out_dir: Path) -> autofit.FitChoice:
    """Checkpoint every layer, or (fit: speed) as few as the budget allows, measured on the longest rows."""
    b = cfg.training.per_device_train_batch_size
    longest = sorted(train_rows, key=lambda r: len(r["input_ids"]))[-b:]
    batch = {k: v.to(device()) for k, v in Collator(pad_id)(longest).items()}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fit = autofit.choose(cfg, model, batch, trainable, optimizer(cfg))
    fit.attention = attention_kernel(model)
    print(f"train: {fit.checkpointed_layers}/{fit.total_layers} layers checkpointed; {fit.reason}; attention: {fit.attention}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fit.json").write_text(json.dumps(memory.jsonable(fit), indent=2))
    return fit


def attention_kernel(model) -> str:
    """Which SDPA kernel the model's attention shapes get on this device, checked once here.

    Checked on a same-shaped call, never by wrapping the forward in `sdpa_kernel`: that
    context is gone when checkpointing recomputes the layer in backward, which then picks
    another kernel and fails the recompute's metadata check.
    """
    impl = model.config._attn_implementation
    if device().type != "cuda" or impl != "sdpa":
        return f"{impl} ({device().type})"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q = torch.randn(1, c.num_attention_heads, 256, head_dim, device="cuda", dtype=compute_dtype("auto"))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            return f"sdpa: {name}"
        except RuntimeError:
            continue
    print("train: WARNING: neither flash nor memory-efficient SDPA runs here: attention falls back to the math kernel "
          "(memory quadratic in sequence length)")
    return "sdpa: math (quadratic memory)"


def halve_micro_batch(cfg: RunConfig) -> RunConfig:
    return cfg.model_copy(update={"training": cfg.training.halved()})


def postmortem(err: BaseException, cfg: RunConfig, trainer, model, collator: Collator, path: Path) -> dict:
    """What was in memory when it ran out: the batch, the allocator, what requires grad."""
    stats = memory.stats()
    leaked = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    report = {
        "path": str(path),
        "error": str(err).split("\n")[0][:500],
        "step": trainer.state.global_step + 1,
        "batch": collator.batch(trainer.micro_batches - 1),  # the one training when memory ran out
        "per_device_train_batch_size": cfg.training.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
        "memory_gib": stats,
        "fragmentation_gib": (stats["reserved_gib"] - stats["alloc_gib"]) if "reserved_gib" in stats else None,
        "non_lora_params_requiring_grad": leaked[:20],
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    if torch.cuda.is_available():
        report["memory_summary"] = torch.cuda.memory_summary()
        if MemorySnapshot.recording:
            snap = path.with_suffix(".pickle")
            torch.cuda.memory._dump_snapshot(str(snap))
            report["snapshot"] = str(snap)
    path.write_text(json.dumps(report, indent=2))
    return report


def is_dataloader_shm_error(e: BaseException) -> bool:
    text = str(e).lower()
    return "dataloader worker" in text and ("shared memory" in text or "bus error" in text or "shm" in text)


class MemorySnapshot(TrainerCallback):
    """Every CUDA allocation (with its stack) of the first `steps` optimizer steps, for PyTorch's memory viewer."""

    recording = False

    def __init__(self, steps: int, path: Path) -> None:
        self.steps, self.path = steps, path

    def on_train_begin(self, args, state, control, **kwargs):
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        MemorySnapshot.recording = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if MemorySnapshot.recording and state.global_step >= self.steps:
            torch.cuda.memory._dump_snapshot(str(self.path))
            torch.cuda.memory._record_memory_history(enabled=None)
            MemorySnapshot.recording = False
        return control


class InjectOOM(TrainerCallback):
    """Test hook: a CUDA out-of-memory error at the start of optimizer step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise torch.OutOfMemoryError(f"injected CUDA out of memory at step {self.step} (test hook)")
        return control


def build_model(cfg: RunConfig):
    """Frozen base + LoRA adapter, in train mode, checkpointing set up the way that works."""
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    model = load_base(cfg.model, cfg.quantization)
    use_liger(model, loss=cross_entropy(cfg) == "chunked", kernels=fused_kernels(cfg),
              forced=cfg.training.cross_entropy == "chunked" or cfg.training.fused_kernels == "on")
    if tiled_mlp(cfg):
        tile_mlp(model)
    if offload_embeddings(cfg):
        embeddings_to_host(model)
    model.config.use_cache = False  # the KV cache is useless in training and costs memory
    model.train()  # from_pretrained returns eval mode; checkpointing is a no-op there
    if cfg.training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    # The adapter's random init draws from the global RNG: seed it here, not only in the
    # Trainer (created later), or two runs of one config start from different adapters.
    set_seed(cfg.training.seed)
    try:
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **cfg.lora.model_dump()))
    except ValueError as e:
        if "not found in the base model" not in str(e) and "Target modules" not in str(e):
            raise
        raise ConfigError(
            f"lora.target_modules {cfg.lora.target_modules} match no module of {type(model).__name__}; "
            f"its linear modules are: {sorted(linear_module_names(model))} (or use all-linear)"
        ) from None
    check_only_lora_trains(model)
    return model


def linear_module_names(model) -> set[str]:
    """Leaf names of the linear layers LoRA can adapt (16-bit or bitsandbytes 4-bit)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(name.rsplit(".", 1)[-1])
    return names


TILE_FROM_TOKENS = 32768


def resolve_auto(cfg: RunConfig, *, on_gpu: bool, liger: bool = True, bnb: bool = True) -> dict:
    """What the `auto` training settings become on a GPU (`on_gpu`) or a CPU.

    The one place they are decided: training passes what this machine has, the preflight
    estimate the device it estimates for.
    """
    t = cfg.training
    memory_first = on_gpu and t.fit == "memory"
    long_batches = cfg.data.max_length * t.per_device_train_batch_size >= TILE_FROM_TOKENS
    return {
        "fused_kernels": t.fused_kernels == "on" or (t.fused_kernels == "auto" and on_gpu and liger),
        "offload_activations": t.offload_activations == "on"
        or (t.offload_activations == "auto" and memory_first and t.gradient_checkpointing),
        "offload_embeddings": t.offload_embeddings == "on" or (t.offload_embeddings == "auto" and memory_first),
        "tiled_mlp": t.tiled_mlp == "on" or (t.tiled_mlp == "auto" and on_gpu and liger and long_batches),
        # 8-bit paged AdamW when memory comes first (-0.24 GiB, -1.5% tokens/s on R7), fused AdamW when speed does
        "optim": t.optim if t.optim != "auto" else
        "paged_adamw_8bit" if memory_first and bnb else "adamw_torch_fused" if on_gpu else "adamw_torch",
    }


def _resolved(cfg: RunConfig, key: str) -> bool | str:
    """`key` of resolve_auto on this machine; a GPU-only setting forced `on` without a GPU is an error."""
    import importlib.util

    on_gpu = device().type == "cuda"
    needs = {"fused_kernels": "a CUDA GPU and liger-kernel (`pip install -e .[gpu]`)",
             "tiled_mlp": "a CUDA GPU and liger-kernel (`pip install -e .[gpu]`)",
             "offload_activations": "a CUDA GPU (pinned host memory, copy streams)",
             "offload_embeddings": "a CUDA GPU (the table is already in host memory on CPU)"}
    if key in needs and getattr(cfg.training, key) == "on" and not (on_gpu and (_has_liger() or "liger" not in needs[key])):
        raise ConfigError(f"training.{key}: on needs {needs[key]}; set it to auto or off")
    return resolve_auto(cfg, on_gpu=on_gpu, liger=_has_liger(), bnb=importlib.util.find_spec("bitsandbytes") is not None)[key]


def fused_kernels(cfg: RunConfig) -> bool:
    return _resolved(cfg, "fused_kernels")


def offload_activations(cfg: RunConfig) -> bool:
    return _resolved(cfg, "offload_activations")


def offload_embeddings(cfg: RunConfig) -> bool:
    return _resolved(cfg, "offload_embeddings")


def optimizer(cfg: RunConfig) -> str:
    return _resolved(cfg, "optim")


def tiled_mlp(cfg: RunConfig) -> bool:
    return _resolved(cfg, "tiled_mlp")


def tile_mlp(model, on: bool = True) -> int:
    """Wrap (or unwrap) every decoder MLP in Liger's tiled MLP; returns how many are tiled.

    At 80k tokens one Qwen2-7B MLP's gate/up/product activations and their grads are
    ~7 x 2.9 GiB; in tiles of hidden_size tokens they are ~7 x 0.13 GiB.
    """
    from liger_kernel.ops.tiled_mlp import apply_tiled_mlp

    n = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "down_proj"):
            continue
        if "_untiled_forward" in mlp.__dict__:
            mlp.forward = mlp.__dict__.pop("_untiled_forward")
        if on:
            inner = mlp.forward
            mlp._untiled_forward = inner
            mlp.forward = lambda x, _m=mlp, _f=inner: apply_tiled_mlp(fn=lambda m, xs: _f(xs), mlp_module=_m, x=x)
            n += 1
    return n


def cross_entropy(cfg: RunConfig) -> str:
    """plain or chunked: `auto` is chunked (Liger's fused linear cross-entropy) on a GPU."""
    choice = cfg.training.cross_entropy
    if choice == "auto":
        return "chunked" if device().type == "cuda" and _has_liger() else "plain"
    if choice == "chunked" and not (device().type == "cuda" and _has_liger()):
        raise ConfigError(
            "training.cross_entropy: chunked needs a CUDA GPU and liger-kernel (`pip install -e .[gpu]`, Triton-based); "
            "set training.cross_entropy: plain (or auto) on this machine"
        )
    return choice


def _has_liger() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def use_liger(model, *, loss: bool, kernels: bool, forced: bool = True) -> None:
    """Liger Kernel on this model instance: the fused linear cross-entropy never materialises
    the vocab x tokens logits; RMSNorm, SwiGLU and RoPE kernels save activations and time.

    The loss and the norm/MLP kernels are bound to this instance's modules; Liger also swaps
    the RoPE function and the RMSNorm/MLP classes in the model's transformers module, so a
    model of the same family built later in this process (merge) gets them too (same maths).
    """
    if not (loss or kernels):
        return
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model.config.model_type)
    if apply is None:
        if not forced:  # `auto`: the stock modules and loss, and the probe measures what that costs
            print(f"train: liger-kernel has no kernels for model_type {model.config.model_type!r}: stock modules and loss")
            return
        raise ConfigError(
            f"liger-kernel has no kernels for model_type {model.config.model_type!r}; "
            "set training.cross_entropy and training.fused_kernels to auto (stock modules) or plain/off"
        )
    apply(model=model, fused_linear_cross_entropy=loss, cross_entropy=False, rope=kernels, rms_norm=kernels, swiglu=kernels)


def _decoder_layers(model) -> list:
    """The repeated blocks transformers can checkpoint, in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_only(model, n: int) -> None:
    """Checkpoint the first `n` decoder layers, keep the activations of the others (faster)."""
    for i, layer in enumerate(_decoder_layers(model)):
        layer.gradient_checkpointing = i < n


def checkpointed_layers(model) -> tuple[int, int]:
    """(checkpointed, total) decoder layers."""
    layers = _decoder_layers(model)
    return sum(bool(m.gradient_checkpointing) for m in layers), len(layers)


def check_only_lora_trains(model) -> None:
    """Frozen means frozen: a base weight with requires_grad would add grads and optimizer state."""
    leaked = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if leaked:
        raise RuntimeError(f"{len(leaked)} non-LoRA parameters require grad (e.g. {leaked[:3]}); only adapters may train")


def rows(tok: data.Tokenized) -> list[dict]:
    return [{"input_ids": i, "labels": l, "id": sid} for i, l, sid in zip(tok.input_ids, tok.labels, tok.ids, strict=True)]


class Collator:
    """Dynamic padding to the longest row (the batch holding the longest sample is the worst
    step); remembers recent batches' shapes and sample ids for an OOM post-mortem.

    The Trainer collates ahead of training (a whole optimizer step's micro-batches, plus one
    that accelerate prefetches), so the i-th micro-batch trained on is the i-th collated one,
    but the latest collated one is not the one running.
    """

    RECENT = 64  # more than one optimizer step's micro-batches plus the prefetched one

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.batch_tokens: list[int] = []  # non-padding tokens per micro-batch, counted on the host (no GPU sync)
        self.recent: collections.deque = collections.deque(maxlen=self.RECENT)  # (index, shape and ids)

    def tokens(self, consumed: int) -> int:
        """Tokens in the first `consumed` micro-batches."""
        return sum(self.batch_tokens[:consumed])

    def batch(self, index: int) -> dict:
        """Shape and sample ids of the `index`-th micro-batch (0-based), or the latest one known."""
        return next((b for i, b in self.recent if i == index), self.recent[-1][1] if self.recent else {})

    def __call__(self, batch: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in batch)
        pad = [width - len(r["input_ids"]) for r in batch]
        self.recent.append((len(self.batch_tokens), {"shape": [len(batch), width], "ids": [r.get("id") for r in batch]}))
        self.batch_tokens.append(sum(len(r["input_ids"]) for r in batch))
        return {
            "input_ids": torch.tensor([r["input_ids"] + [self.pad_id] * n for r, n in zip(batch, pad, strict=True)]),
            "labels": torch.tensor([r["labels"] + [-100] * n for r, n in zip(batch, pad, strict=True)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * n for r, n in zip(batch, pad, strict=True)]),
        }


def make_trainer(cfg: RunConfig, model, train_rows: list[dict], collator: Collator, out_dir: Path,
                 callbacks: list | None = None, **overrides):
    """The HF Trainer exactly as training uses it; `overrides` change TrainingArguments (the probe's 2 steps)."""
    from transformers import Trainer, TrainingArguments

    t = cfg.training
    on_gpu = device().type == "cuda"
    dtype = compute_dtype(cfg.model.torch_dtype)
    kwargs = dict(
        output_dir=str(out_dir / "checkpoints"),
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        max_steps=t.max_steps,
        optim=optimizer(cfg),
        train_sampling_strategy=t.train_sampling_strategy,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        seed=t.seed,
        data_seed=t.seed,
        gradient_checkpointing=False,  # set up in build_model, in the order that works
        bf16=on_gpu and dtype == torch.bfloat16,
        fp16=on_gpu and dtype == torch.float16,
        use_cpu=not on_gpu,
        dataloader_pin_memory=on_gpu,
        dataloader_num_workers=0,  # workers fork the dataset; /dev/shm errors are not worth it here
        remove_unused_columns=False,
        include_num_input_tokens_seen="no",  # its count calls .item() every micro-batch: the Collator counts instead
        report_to=[],
        ddp_find_unused_parameters=False,  # every adapter gets a gradient; the search would cost a pass
        disable_tqdm=False,
        logging_first_step=True,
    )
    args = TrainingArguments(**(kwargs | overrides))
    if args.n_gpu > 1:
        # One process and several visible GPUs: the Trainer would wrap nn.DataParallel, which copies the
        # model to every GPU each step and puts Liger's loss terms on two devices. One process trains on
        # its own GPU; several GPUs are `launcher: accelerate` (DDP).
        args._n_gpu = 1

    offload = offload_activations(cfg)

    class OffloadingTrainer(Trainer):
        """The forward runs with saved activations offloaded to pinned CPU memory (when on), and
        the micro-batches trained on are counted (tokens/s, the OOM post-mortem's batch)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            # self.model, not the enclosing `model`: a closure would keep the model alive as long as
            # this class, i.e. as long as the trainer, after release() has dropped every other reference
            self.offload = OffloadActivations(self.model) if offload else None
            self.micro_batches = 0  # trained on in this process (an epoch's last step can have fewer than the accumulation)

        def training_step(self, *args, **kwargs):
            self.micro_batches += 1
            return super().training_step(*args, **kwargs)

        def compute_loss_context_manager(self):
            stack = super().compute_loss_context_manager()
            if self.offload is not None:
                self.offload.reset()  # the previous micro-batch's backward is done
                stack.enter_context(self.offload)
            return stack

    return OffloadingTrainer(
        model=model, args=args, train_dataset=train_rows,
        data_collator=collator,
        callbacks=[MemoryCallback(out_dir / "memory_steps.jsonl"), *(callbacks or [])],
    )


def release(trainer) -> None:
    """Drop every reference a Trainer (finished or failed) holds to the model, its optimizer
    states and the offloaded activations, so that freeing the model returns all its memory.
    Keeps what the results need (state, args, the micro-batch count)."""
    if trainer.model is not None:
        forget_optimizer_overrides(trainer.model)
    if trainer.offload is not None:
        trainer.offload.reset()
        trainer.offload = None
    trainer.accelerator.free_memory()  # accelerate's lists of prepared models, optimizers and dataloaders
    trainer.model = trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None
    handler = trainer.callback_handler
    handler.model = handler.optimizer = handler.lr_scheduler = handler.train_dataloader = handler.eval_dataloader = None


def forget_optimizer_overrides(model) -> None:
    """Unregister the model's modules from bitsandbytes' process-wide GlobalOptimManager.

    With an 8-bit bitsandbytes optimizer the HF Trainer registers every nn.Embedding there for
    32-bit states, and nothing ever unregisters it: the table outlived its model, one more per
    build in a process (measured: +445 MiB per build of a tied Qwen2.5-1.5B; the probe's table
    was still allocated during training). A table in host memory (HostEmbedding) is no
    nn.Embedding, so only tied models, whose table stays on the GPU, leaked by default.
    """
    bnb_optim = sys.modules.get("bitsandbytes.optim")
    if bnb_optim is None:  # never imported: nothing registered
        return
    manager = bnb_optim.GlobalOptimManager.get_instance()
    mine = {id(m) for m in model.modules()}
    manager.module_weight_config_triple = [t for t in manager.module_weight_config_triple if id(t[0]) not in mine]


class MemoryCallback(TrainerCallback):
    """Appends memory.stats() at every optimizer step to a JSON-lines file.

    Only reads state; the CUDA figures come from the allocator's counters, not a sync.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return control
        row = {"step": state.global_step, "time": round(time.time(), 3)} | {
            k: round(v, 4) for k, v in memory.stats().items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return control


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint (trainer_state.json is written last)."""
    done = [p for p in ckpt_dir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=_step_of, default=None)


def _step_of(p: Path) -> int:
    return int(p.name.rsplit("-", 1)[1])


def _budget_gib(cfg: RunConfig) -> float | None:
    if cfg.preflight.gpu_memory_gib:
        return cfg.preflight.gpu_memory_gib
    return torch.cuda.get_device_properties(0).total_memory / memory.GIB if torch.cuda.is_available() else None


def plot_memory(out_dir: Path, budget_gib: float | None) -> Path | None:
    """memory_steps.jsonl as a timeline: what torch allocated/reserved (GPU) or RSS (CPU), and the budget."""
    path = out_dir / "memory_steps.jsonl"
    if not path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [k for k in ("alloc_gib", "reserved_gib", "peak_reserved_gib", "nvml_used_gib") if k in steps[0]] or ["rss_gib", "peak_rss_gib"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k in keys:
        ax.plot([r["step"] for r in steps], [r.get(k) for r in steps], label=k.removesuffix("_gib"))
    if budget_gib:
        ax.axhline(budget_gib, color="red", linestyle="--", label=f"budget {budget_gib:.1f} GiB")
    ax.set(xlabel="optimizer step", ylabel="GiB", title="train memory per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=100)
    plt.close(fig)
    return out_dir / "memory.png"


def plot_loss(losses: list[dict], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out_dir / "loss.jsonl").open("w") as f:
        for e in losses:
            f.write(json.dumps({"step": e["step"], "loss": e["loss"], "learning_rate": e.get("learning_rate")}) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["step"] for e in losses], [e["loss"] for e in losses], marker=".")
    ax.set(xlabel="optimizer step", ylabel="training loss", title="train loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)
    return out_dir / "loss.png"


def _load_result(path: Path) -> TrainResult:
    d = json.loads(path.read_text())
    mem = d.pop("memory")
    mem.pop("peak_gib", None)
    return TrainResult(
        **{k: Path(v) if k in ("adapter_dir", "loss_png", "memory_png") and v else v for k, v in d.items() if k != "skipped"},
        memory=MemoryReport(**mem) if mem else None,
        skipped=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train a LoRA/QLoRA adapter (one stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. training.max_steps=20")
    ap.add_argument("--out", type=Path, help="stage directory (default: artifacts/runs/<new id>/train)")
    a = ap.parse_args(argv)
    if os.environ.get(LAUNCHED):  # a rank started by run_launched: never outlive the launcher
        die_with_parent()
        if os.getppid() == 1:
            raise SystemExit("train: the launcher is already gone")
        if torch.cuda.is_available():  # streams, peak counters and the CUDA context of rank k belong on GPU k, not cuda:0
            torch.cuda.set_device(device())
    cfg = load_config(a.config, a.set)
    from stages.paths import RunPaths

    out = a.out or RunPaths.for_run(cfg).stage("train")
    r = run(cfg, out)
    if r is None:  # a DDP rank other than 0
        return
    print(f"adapter: {r.adapter_dir}  steps {r.steps}  loss {r.first_loss:.3f} -> {r.final_loss:.3f}  {r.tokens_per_s:.0f} tok/s")


if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "train"))
