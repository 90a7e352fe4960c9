"""An importance matrix from the run's own training data, in the form llama.cpp's quantizer reads.

llama.cpp's quantizer weighs each column of a weight by how large that column's input activations are (the
mean of x^2 over calibration tokens, per input feature): with it, the rounding error lands where the model
looks least. `llama-imatrix` computes it by running a GGUF over a text file; here the merged HF model (the
one the GGUF is converted from) runs over the training samples in the chat template, in torch, with a forward
hook on every linear layer. The numbers are the same statistic llama-imatrix collects (sum of x^2 and the token
count per weight); the held-out texts the fidelity gate measures on are never among them.

Routed experts (transformers' fused 3-D stacks, quantized as llama.cpp's `ffn_{gate,up,down}_exps`) get one row per
expert, over the tokens the router sends each, as llama-imatrix collects them: the up projections' rows from the
experts' inputs, the down projection's from their gated activations. An expert no calibration token reached weighs its
columns evenly (llama-imatrix stores 1 for it too) and is named in `experts_without_data`.

Written as llama.cpp's GGUF imatrix file (`imatrix.gguf`: `<tensor>.in_sum2`, `<tensor>.counts`,
`imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`), which `llama-quantize --imatrix` reads too,
and handed to `llama_model_quantize` as its `llama_model_imatrix_data` entries (sum / count).
"""

from __future__ import annotations

import ctypes
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from stages import data
from stages.errors import UserError
from stages.model.experts import structure

CHUNK = 512  # tokens per calibration chunk, as llama-imatrix's default context
BATCH_TOKENS = 4096  # padded tokens per forward pass of the calibration


class ImatrixError(UserError, ValueError):
    pass


@dataclass
class Imatrix:
    sums: dict[str, np.ndarray]        # GGUF tensor name -> sum of x^2 per input column (float32); experts: [E, columns]
    counts: dict[str, int | np.ndarray]  # GGUF tensor name -> tokens seen; experts: tokens routed to each, [E]
    tokens: int                        # calibration tokens
    chunks: int
    dataset: str                       # where the calibration text came from
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # linear layers with no tensor of that width in the GGUF

    def means(self) -> dict[str, np.ndarray]:
        """Mean x^2 per input column, as llama_model_quantize reads it: experts' rows expert-major, an expert that got
        no token all ones."""
        out = {}
        for n, s in self.sums.items():
            c = np.asarray(self.counts[n], dtype=np.float64)
            if s.ndim == 2:
                m = s / np.maximum(c, 1)[:, None]
                m[c == 0] = 1.0
            else:
                m = s / max(float(c), 1.0)
            out[n] = m.astype(np.float32)
        return out

    @property
    def experts_without_data(self) -> dict[str, list[int]]:
        """Expert tensors -> the experts no calibration token was routed to."""
        return {n: np.flatnonzero(np.asarray(c) == 0).tolist() for n, c in sorted(self.counts.items())
                if np.ndim(c) and not np.all(np.asarray(c) > 0)}

    def experts_covered(self) -> tuple[int, int]:
        """(experts that got data, experts) over every expert tensor's rows."""
        rows = [np.asarray(c) for c in self.counts.values() if np.ndim(c)]
        return sum(int((r > 0).sum()) for r in rows), sum(r.size for r in rows)

    def write(self, path: Path) -> Path:
        """llama.cpp's GGUF imatrix file (what llama-imatrix writes and llama-quantize --imatrix reads)."""
        import gguf

        w = gguf.GGUFWriter(str(path), arch="imatrix")
        w.add_type(gguf.GGUFType.IMATRIX)
        w.add_array(gguf.Keys.IMatrix.DATASETS, [self.dataset])
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, self.chunks)
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, CHUNK)
        for name in sorted(self.sums):
            rows = np.asarray(self.counts[name], dtype=np.float32).reshape(-1, 1)   # one count per matrix: [1] or [E]
            w.add_tensor(f"{name}.in_sum2", self.sums[name].astype(np.float32).reshape(rows.shape[0], -1))
            w.add_tensor(f"{name}.counts", rows)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path


def load(path: Path) -> Imatrix:
    """An imatrix.gguf (this module's or llama-imatrix's): one row per matrix of each weight (an expert tensor's E)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not there"
        raise ImatrixError(f"export.imatrix names {path.resolve()}, which is {what}; give the path of an imatrix.gguf (llama-imatrix's "
                           "or a run's bundle's), `auto` to compute one from the training data, or `off`")
    try:
        reader = gguf.GGUFReader(str(path))
        tensors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in reader.tensors}
    except Exception as e:  # gguf-py raises whatever the bytes lead it to (ValueError, struct.error, IndexError, ...)
        raise ImatrixError(f"export.imatrix: {path.resolve()} is not a GGUF file ({type(e).__name__}: {str(e)[:120]}); give an "
                           "imatrix.gguf (the legacy .dat format is not read: convert it with llama.cpp's "
                           "convert_legacy_imatrix_to_gguf.py), `auto` or `off`") from None
    sums = {n[:-len(".in_sum2")]: v for n, v in tensors.items() if n.endswith(".in_sum2")}
    counts: dict[str, int | np.ndarray] = {}
    for n in [n for n in sums if f"{n}.counts" in tensors]:
        c = tensors[f"{n}.counts"]
        if c.size > 1:  # an expert tensor: one row of sums per expert
            sums[n], counts[n] = sums[n].reshape(c.size, -1), c.astype(np.int64)
        else:
            counts[n] = int(c[0])
    if not sums or len(counts) != len(sums):
        kind = reader.fields.get("general.type")
        kind = kind.contents() if kind is not None else None
        raise ImatrixError(f"export.imatrix: {path.resolve()} is a GGUF file but no importance matrix (general.type "
                           f"{kind!r}, no `<tensor>.in_sum2` / `<tensor>.counts` pairs"
                           + ("; it is a model" if kind == "model" else "") + "); give an imatrix.gguf (llama-imatrix's, or "
                           "the imatrix.gguf of a bundle of the same base), `auto` or `off`")
    chunks, datasets = reader.fields.get("imatrix.chunk_count"), reader.fields.get("imatrix.datasets")
    dense = [c for c in counts.values() if not np.ndim(c)]
    tokens = max(dense) if dense else max(int(np.asarray(c).max()) for c in counts.values())
    return Imatrix(sums, counts, tokens, int(chunks.contents()) if chunks is not None else 0,
                   f"{path.name} ({', '.join(datasets.contents()) if datasets is not None else 'datasets not named'})")


def check_against(imat: Imatrix, widths: dict[str, int], source: Path, model: str) -> list[str]:
    """The tensors of `imat` that `model` has, by GGUF name (`widths`: name -> input width of each of its matrices).

    Raises ImatrixError when it names none of them (computed on another model: quantizing with it would change nothing,
    and shipping it would claim otherwise) or when one of them has another width (llama.cpp refuses such a file only
    while it quantizes, after training, and without naming it)."""
    matched = [n for n in imat.sums if n in widths]
    if not matched:
        raise ImatrixError(
            f"export.imatrix: {source} names none of the tensors of {model} (it has e.g. {', '.join(sorted(imat.sums)[:2])}; the "
            f"model's are e.g. {', '.join(sorted(widths)[:2])}): it was computed on another model; give the imatrix of this "
            "model (the imatrix.gguf of a bundle of the same base), `auto` to compute one from the training data, or `off`")
    wrong = {n: (imat.sums[n].shape[-1], widths[n]) for n in matched if imat.sums[n].shape[-1] != widths[n]}
    if wrong:
        n, (have, want) = next(iter(wrong.items()))
        raise ImatrixError(
            f"export.imatrix: {source} was computed on a model of other widths: {len(wrong)} of its {len(matched)} tensors "
            f"differ, e.g. {n} holds {have} values and {model}'s {n} takes {want} inputs; give the imatrix of this model, "
            "`auto` to compute one from the training data, or `off`")
    return matched


def widths_in_gguf(info: dict) -> dict[str, int]:
    """GGUF tensor name -> input width of each matrix in a converted model (llamacpp.read_gguf)."""
    return {n: int(shape[0]) for n, shape in info.get("tensor_shapes", {}).items() if len(shape) >= 2}


def widths_before_conversion(model_dir: Path, vocab_info: dict) -> dict[str, int]:
    """The same, before any GGUF of the model exists: the checkpoint's matrices named as the converter will name them
    (gguf-py's TensorNameMap for the architecture the converter chose, read off its vocabulary-only GGUF)."""
    import gguf

    from stages.model.check import read_header

    arch_name = vocab_info["fields"].get("general.architecture")
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        return {}
    tmap = gguf.get_tensor_name_map(arch, int(vocab_info["fields"].get(f"{arch_name}.block_count", 0)))
    widths = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        header, problem = read_header(f)
        for name, v in ({} if problem else header).items():
            if name == "__metadata__" or len(v["shape"]) != 2 or not name.endswith(".weight"):
                continue
            gname = tmap.get_name(name, try_suffixes=(".weight",))
            if gname:
                widths[gname if gname.endswith(".weight") else f"{gname}.weight"] = int(v["shape"][-1])
    return widths


def calibration_ids(cfg, tokenizer, max_tokens: int) -> tuple[list[list[int]], str]:
    """Training samples as training tokenized them (chat template, data.max_length, truncated), in a seeded order,
    until `max_tokens`; never a sample the fidelity gate measures on."""
    samples = data.train_samples(cfg)
    if not data.eval_samples(cfg):  # then the fidelity gate measures on the first training samples: leave them out
        samples = samples[cfg.export.fidelity.samples:]
    if not samples:
        raise ImatrixError("export.imatrix: auto needs training samples that the fidelity gate does not measure on, and there are "
                           "none left; add training data, give an imatrix file, or set export.imatrix: off")
    order = list(range(len(samples)))
    random.Random(f"imatrix/{cfg.training.seed}").shuffle(order)
    ids: list[list[int]] = []
    total = 0
    for start in range(0, len(order), 64):  # tokenized a few at a time: a large dataset is not tokenized whole for this
        for row in data.tokenize([samples[i] for i in order[start:start + 64]], tokenizer, cfg.data.max_length, "truncate").input_ids:
            ids.append(row)
            total += len(row)
            if total >= max_tokens:
                return ids, _described(cfg, ids, total)
    return ids, _described(cfg, ids, total)


def _described(cfg, ids: list[list[int]], total: int) -> str:
    files = [cfg.data.train_file] if cfg.data.train_file else [s.path for s in cfg.data.sources]
    return f"{len(ids)} training samples ({total} tokens) of {', '.join(Path(str(f)).name for f in files if f)}"


def compute(model, sequences: list[list[int]], names: dict[str, str], dataset: str, batch_tokens: int = BATCH_TOKENS,
            experts: dict[str, tuple[list[str], list[str]]] | None = None) -> Imatrix:
    """Run `model` over `sequences` with a hook on each linear layer named in `names` (module -> GGUF tensor name), and
    on each experts module in `experts` (module -> the GGUF tensors its up and its down projections feed).

    Each sequence is cut into pieces of at most CHUNK tokens; pieces of similar length go through the model together,
    right-padded, and the hooks count only the real tokens: each token's activations are the ones it has alone (it
    never attends to padding after it), without a forward call per sample (800 of them for the tiny default)."""
    t0 = time.perf_counter()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    handles = []
    real: list[torch.Tensor] = []  # the current batch's real-token rows, flattened (batch x seq)

    def hook(gname: str):
        def collect(module, args):
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])[real[0]].float()
            s = (x * x).sum(0).double()
            sums[gname] = sums[gname] + s if gname in sums else s
            counts[gname] = counts.get(gname, 0) + x.shape[0]
        return collect

    def expert_hook(ups: list[str], downs: list[str]):
        def collect(module, args, kwargs):
            from stages.model.experts import lora as expert_lora

            hidden = args[0] if args else kwargs["hidden_states"]
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            hidden = hidden.detach().reshape(-1, hidden.shape[-1])[real[0]]
            index = index.reshape(-1, index.shape[-1])[real[0]]
            groups, _, _, x, h = expert_lora.routed(module, hidden, index)
            routed = torch.bincount(groups, minlength=module.num_experts)
            for gnames, rows in ((ups, x), (downs, h)):
                s = torch.zeros(module.num_experts, rows.shape[-1], dtype=torch.float64, device=rows.device)
                s.index_add_(0, groups, rows.float().square().double())
                for gname in gnames:
                    sums[gname] = sums[gname] + s if gname in sums else s
                    counts[gname] = counts[gname] + routed if gname in counts else routed
        return collect

    pieces = [ids[start:start + CHUNK] for ids in sequences for start in range(0, len(ids), CHUNK)]
    batches, group = [], []
    for i in sorted(range(len(pieces)), key=lambda i: len(pieces[i])):  # longest last: a batch's width is its last piece's
        if group and (len(group) + 1) * len(pieces[i]) > batch_tokens:
            batches.append(group)
            group = []
        group.append(i)
    if group:
        batches.append(group)
    modules = dict(model.named_modules())
    for mod_name, gname in names.items():
        handles.append(modules[mod_name].register_forward_pre_hook(hook(gname)))
    for mod_name, (ups, downs) in (experts or {}).items():
        handles.append(modules[mod_name].register_forward_pre_hook(expert_hook(ups, downs), with_kwargs=True))
    model.eval()
    try:
        with torch.no_grad():
            for group in batches:
                width = max(len(pieces[i]) for i in group)
                mask = torch.tensor([[1] * len(pieces[i]) + [0] * (width - len(pieces[i])) for i in group], device=model.device)
                ids = torch.tensor([pieces[i] + [0] * (width - len(pieces[i])) for i in group], device=model.device)
                real[:] = [mask.reshape(-1).bool()]
                model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    tokens = sum(map(len, pieces))
    return Imatrix({n: s.cpu().numpy().astype(np.float32) for n, s in sums.items()},
                   {n: c.cpu().numpy() if torch.is_tensor(c) else c for n, c in counts.items()}, tokens, len(pieces), dataset,
                   round(time.perf_counter() - t0, 2))


def gguf_names(model, base_info: dict) -> tuple[dict[str, str], list[str]]:
    """Each linear layer of the HF model -> the GGUF tensor llama.cpp quantizes from it, by the converter's own
    name map (gguf-py's TensorNameMap); layers whose tensor is not in the GGUF, or has another input width, are
    returned apart (a tied lm_head, fused or split projections the map does not name)."""
    import gguf

    arch_name = base_info["fields"]["general.architecture"]
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    blocks = int(base_info["fields"].get(f"{arch_name}.block_count", 0))
    shapes = base_info.get("tensor_shapes", {})
    if arch is None:
        return {}, [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    tmap = gguf.get_tensor_name_map(arch, blocks)
    names, skipped = {}, []
    for mod_name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        gname = tmap.get_name(f"{mod_name}.weight", try_suffixes=(".weight",))
        gname = f"{gname}.weight" if gname and not gname.endswith(".weight") else gname
        if gname in shapes and int(shapes[gname][0]) == m.in_features:
            names[mod_name] = gname
        else:
            skipped.append(mod_name)
    return names, skipped


def expert_gguf_names(model, base_info: dict) -> dict[str, tuple[list[str], list[str]]]:
    """Each experts module of the HF model (transformers' fused stacks, stages.model.experts.structure) -> the GGUF expert tensors its up
    projection's inputs feed (`blk.N.ffn_gate_exps`, `ffn_up_exps`, or the fused `ffn_gate_up_exps`) and those its
    down projection's feed (`blk.N.ffn_down_exps`), N the decoder layer it is in; tensors of another input width are
    left out."""
    shapes = base_info.get("tensor_shapes", {})
    stacks = {s.name: s for s in structure.fused_experts(model).stacks}
    out = {}
    for name, module in model.named_modules():
        layer = re.search(r"\.(\d+)\.", f".{name}.")
        if layer is None or not structure.computable(module):
            continue
        up = stacks.get(f"{name}.{'gate_up_proj' if module.has_gate else 'up_proj'}")
        down = stacks.get(f"{name}.down_proj")
        b = layer.group(1)
        ups = [g for g in (f"blk.{b}.ffn_gate_exps.weight", f"blk.{b}.ffn_up_exps.weight", f"blk.{b}.ffn_gate_up_exps.weight")
               if up and g in shapes and int(shapes[g][0]) == up.in_features]
        downs = [g for g in (f"blk.{b}.ffn_down_exps.weight",) if down and g in shapes and int(shapes[g][0]) == down.in_features]
        if ups or downs:
            out[name] = (ups, downs)
    return out


def from_run(cfg, tokenizer, model, base_info: dict) -> Imatrix:
    """The importance matrix of `model` (the merged model the GGUF was converted from) on the run's training data."""
    names, skipped = gguf_names(model, base_info)
    experts = expert_gguf_names(model, base_info)
    if not names and not experts:
        raise ImatrixError(f"no linear layer of the merged model maps onto a tensor of the GGUF (architecture "
                           f"{base_info['fields'].get('general.architecture')}); set export.imatrix: off")
    sequences, dataset = calibration_ids(cfg, tokenizer, cfg.export.imatrix_tokens)
    imat = compute(model, sequences, names, dataset, experts=experts)
    imat.skipped = skipped
    return imat


def quantize_entries(means: dict[str, np.ndarray]):
    """`means` as the NULL-terminated llama_model_imatrix_data array llama_model_quantize reads; keep the returned
    tuple alive while it quantizes (it owns the buffers the pointers point into)."""
    import llama_cpp

    keep = [(n.encode(), np.ascontiguousarray(v, dtype=np.float32)) for n, v in means.items()]
    arr = (llama_cpp.llama_model_imatrix_data * (len(keep) + 1))()
    for i, (name, values) in enumerate(keep):
        arr[i].name = name
        arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        arr[i].size = values.size
    arr[len(keep)].name = None
    return arr, keep
