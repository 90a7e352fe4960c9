"""What keeps a MoE model's GPU memory alive after the preflight's probe (bench/gpu_figure/capped_grid.py pages rows M1-M4: the
train stage that followed in the same process found 3.8-13 GiB still allocated). One row's preflight, then every live
CUDA tensor of over 64 MiB and the chain of objects referring to the largest.

    python3 bench/moe_leak/run.py --rows M2 M3 --out $OUT/moe_leak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu_figure"))

import capped_grid as cg  # noqa: E402
from preflight_grid import make_checkpoint  # noqa: E402


def describe(o) -> str:
    if isinstance(o, dict):
        return f"dict keys {list(o)[:8]}"
    if isinstance(o, (list, tuple)):
        return f"{type(o).__name__} of {len(o)}"
    if hasattr(o, "f_code"):
        return f"frame {o.f_code.co_name} {o.f_code.co_filename}:{o.f_lineno}"
    return f"{type(o).__module__}.{type(o).__qualname__}"


def chain(obj, depth: int, seen: set) -> list:
    out = []
    if depth == 0:
        return out
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or ref is seen or isinstance(ref, type(sys._getframe())) and ref.f_code.co_name == "chain":
            continue
        seen.add(id(ref))
        out.append({"ref": describe(ref), "up": chain(ref, depth - 1, seen) if not hasattr(ref, "f_code") else []})
        if len(out) >= 4:
            break
    return out


def unseen(o) -> int:
    """References to `o` the collector cannot list (held from C++: an autograd node, a CUDA-side structure; or a
    running frame's local): its refcount less getrefcount's own argument and every listed referrer."""
    return sys.getrefcount(o) - 1 - len(gc.get_referrers(o))


def roots(target, max_depth: int = 14, limit: int = 12) -> list:
    """Breadth-first up the referrer graph from `target`: every chain that ends at an object with references the
    collector cannot see, a module, a class or a frame; each chain described from the target up."""
    import types

    keep = {id(target): target}
    parent = {id(target): None}
    frontier, found, held = [target], [], []
    skip = {id(keep), id(parent), id(frontier), id(found), id(held)}
    probe = object()
    keep[id(probe)] = probe
    o = probe
    del probe
    base = unseen(o)  # a plain object held as the walk holds each one: the loop variable
    del keep[id(o)], o
    for _ in range(max_depth):
        nxt = []
        skip.add(id(nxt))
        for o in frontier:
            refs = [r for r in gc.get_referrers(o) if id(r) not in skip and not (hasattr(r, "f_code") and r.f_code.co_name in ("roots", "main"))]
            skip.add(id(refs))
            held.append(refs)  # alive, so that no later object reuses its id
            hidden = unseen(o) - base  # beyond what the loop's own variables add
            terminal = isinstance(o, (types.ModuleType, type)) or hasattr(o, "f_code")
            if (hidden > 0 and o is not target) or terminal or not refs:
                path, k = [], id(o)
                while k is not None:
                    obj = keep[k]
                    d = describe(obj)
                    if callable(obj) and hasattr(obj, "__qualname__"):
                        d += f" {obj.__qualname__}"
                        code = getattr(obj, "__code__", None)
                        if code is not None:
                            d += f" {code.co_filename}:{code.co_firstlineno}"
                    if type(obj).__name__ == "cell":
                        fns = [f for f in gc.get_referrers(obj) if isinstance(f, tuple)]
                        owners = [g for t in fns for g in gc.get_referrers(t) if isinstance(g, types.FunctionType)]
                        d += " in " + ", ".join(f"{g.__qualname__} {g.__code__.co_filename}:{g.__code__.co_firstlineno}" for g in owners[:3])
                    path.append(d)
                    k = parent[k]
                found.append({"hidden_refs": hidden, "chain_top_down": path})
                if len(found) >= limit:
                    return found
                if terminal:
                    continue
            for r in refs:
                if id(r) not in keep:
                    keep[id(r)] = r
                    parent[id(r)] = id(o)
                    nxt.append(r)
        frontier = nxt
        if not frontier:
            break
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["M2"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/capped-grid"))
    a = ap.parse_args()
    from stages import memory, preflight

    result = {}
    for name in a.rows:
        shape, quant, packing, max_length, mb, r, targets = cg.ROWS[name]
        model_dir = make_checkpoint(shape, a.work / "models", cg.shapes())
        train, held = cg.make_data(a.work, max_length, mb, packing == "on")
        cfg = cg.row_config(name, model_dir, train, held, a.work / "leak" / name, False, probe=True)
        pre = preflight.run(cfg, a.work / "leak" / name / "preflight", train_only=True)
        memory.free_gpu()
        big = [o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda and o.numel() * o.element_size() > 64 * 2**20]
        big.sort(key=lambda t: -t.numel() * t.element_size())
        row = {"need_gib": pre.need_gib, "allocated_after_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
               "big_tensors": [[list(t.shape), str(t.dtype), round(t.numel() * t.element_size() / 2**20)] for t in big[:12]],
               "n_big": len(big)}
        if big:
            row["referrers_of_largest"] = chain(big[0], 5, set())
        del big
        gc.collect()
        # the outermost live objects of the model: whatever holds them is the leak
        tops = [o for o in gc.get_objects() if type(o).__name__.startswith(("PeftModel", "Trainer", "LoraModel"))
                or (isinstance(o, torch.nn.Module) and type(o).__name__.endswith("ForCausalLM"))]
        # the outermost live peft wrapper of the expert stacks, and everything that refers to it
        from peft.tuners.lora.layer import ParamWrapper

        wrappers = [o for o in gc.get_objects() if isinstance(o, ParamWrapper)]
        inner = {id(w.base_layer) for w in wrappers}
        outer = [w for w in wrappers if id(w) not in inner]
        row["live_wrappers"] = len(wrappers)
        if outer:
            row["roots_of_outer_wrapper"] = roots(outer[0])
        probe_list = [wrappers, outer]
        if outer:
            found = []
            for ref in gc.get_referrers(outer[0]):
                if any(ref is x for x in probe_list):
                    continue
                entry = {"ref": describe(ref)}
                if isinstance(ref, dict):
                    entry["owners"] = [describe(o) + (f" {getattr(o, '__qualname__', '')}" if callable(o) else "")
                                       for o in gc.get_referrers(ref) if not any(o is x for x in probe_list)][:5]
                elif type(ref).__name__ in ("method", "cell", "function"):
                    entry["what"] = repr(ref)[:200]
                    entry["owners"] = [describe(o) for o in gc.get_referrers(ref) if not any(o is x for x in probe_list)][:5]
                elif isinstance(ref, (list, tuple)):
                    entry["items"] = [describe(x) for x in ref[:6]]
                    entry["owners"] = [describe(o) + (f" {getattr(o, '__qualname__', '')}" if callable(o) else "")
                                       for o in gc.get_referrers(ref) if not any(o is x for x in probe_list)][:5]
                found.append(entry)
            row["outer_wrapper_referrers"] = found[:15]
        del wrappers, outer, probe_list
        row["tops"] = {}
        for t in tops:
            refs = []
            for ref in gc.get_referrers(t):
                if ref is tops:
                    continue
                owners = [describe(o) for o in gc.get_referrers(ref) if o is not tops and not isinstance(o, list)][:4] \
                    if isinstance(ref, (dict, list, tuple)) or type(ref).__name__ in ("cell", "method") else []
                refs.append({"ref": describe(ref) + (f" {getattr(ref, '__qualname__', '')}" if callable(ref) else ""),
                             "owners": owners})
            row["tops"][f"{type(t).__name__}@{id(t)}"] = refs[:12]
        del tops
        # C-side holders: the saved-tensor hooks left on the autograd stack, and every thread's running frames
        # (not listed by the collector)
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [o for o in gc.get_objects() if isinstance(o, GradientCheckpointingLayer)]
        row["live_layers"] = len(layers)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        row["saved_tensors_hooks_top"] = None if top is None else [repr(h)[:200] for h in top]
        frames = []
        for tid, f in sys._current_frames().items():
            while f is not None:
                held = [k for k, v in f.f_locals.items() if any(v is x for x in layers[:4])]
                frames.append(f"thread {tid} {f.f_code.co_name} {f.f_code.co_filename}:{f.f_lineno}" + (f" holds {held}" if held else ""))
                f = f.f_back
        row["thread_frames"] = frames[:60]
        row["threads"] = [repr(t) for t in __import__("threading").enumerate()]
        if layers:
            row["layer_unseen"] = unseen(layers[0]) - 2  # less `layers` and the loop's argument
        del layers
        # what frees them, tried in turn (each measured after a collection and an emptied cache)
        row["after_release"] = {}
        def pop_hooks():
            while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()

        releases = {"pop_saved_tensors_hooks": pop_hooks, "dynamo_reset": lambda: torch._dynamo.reset(),
                    "exc_info": lambda: sys.__dict__.pop("last_value", None) or sys.__dict__.pop("last_traceback", None)}
        for label, release in releases.items():
            try:
                release()
            except Exception as e:  # noqa: BLE001 - a release that fails is reported, the next one is tried
                row["after_release"][label] = f"failed: {e}"[:200]
                continue
            memory.free_gpu()
            row["after_release"][label] = round(torch.cuda.memory_allocated() / 2**30, 3)
        result[name] = row
        print(name, json.dumps(row)[:3000], flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
