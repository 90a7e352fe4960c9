"""Is this base model directory usable? Checked before any weights load, every problem at once.

    problems = check_model_dir(Path("models/qwen"), trust_remote_code=False)

Reads config.json, the safetensors headers (8 bytes and a JSON header per file: fast even for a
70B) and the tokenizer; never the weights. Catches what otherwise surfaces as a library
traceback minutes later: a truncated or git-lfs-pointer weights file, a config that does not
parse or names an architecture transformers does not know, tensor shapes that contradict the
config, missing or broken tokenizer files, a tokenizer that turns text into almost nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import struct
from pathlib import Path

LFS_POINTER = b"version https://git-lfs"
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
PROBE_TEXT = "The quick brown fox jumps over the lazy dog, then reads 12 books about oceans."


def check_model_dir(model_dir: Path, trust_remote_code: bool = False) -> list[str]:
    """Problems of `model_dir` as a base model, each naming the file and the fix; [] when usable."""
    model_dir = Path(model_dir)
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(model_dir.iterdir()) if p.is_file())
    return list(_check(model_dir.resolve(), trust_remote_code, stamp))


@functools.lru_cache(maxsize=16)
def _check(model_dir: Path, trust_remote_code: bool, _stamp: tuple) -> tuple[str, ...]:
    problems: list[str] = []
    config = _config(model_dir, trust_remote_code, problems)
    tensors = _safetensors(model_dir, problems)
    if config and tensors:
        problems += _shapes(config, tensors)
    problems += _tokenizer(model_dir, trust_remote_code)
    return tuple(problems)


def _config(model_dir: Path, trust_remote_code: bool, problems: list[str]) -> dict | None:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{path}: not valid JSON ({e}); restore it from the model's source (a download cut short?)")
        return None
    if not isinstance(config, dict):
        problems.append(f"{path}: expected a JSON object, got {type(config).__name__}")
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type is None:
        problems.append(f"{path}: has no model_type; a Hugging Face model's config.json names its architecture family there")
    elif model_type not in CONFIG_MAPPING and not (trust_remote_code and config.get("auto_map")):
        import transformers

        problems.append(
            f"{path}: model_type {model_type!r} is not an architecture transformers {transformers.__version__} knows"
            + ("; the model ships its own code (auto_map): set model.trust_remote_code: true if you trust it" if config.get("auto_map")
               else "; use a model of a supported family (llama, qwen2, mistral, gemma, phi3, ...) or a transformers release that has it"))
    return config


def _safetensors(model_dir: Path, problems: list[str]) -> dict[str, dict]:
    """name -> {dtype, shape} over every weights file the directory names; problems for broken files."""
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"{index}: not a valid shard index ({e}); restore it from the model's source")
            shards = []
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            problems.append(f"{index} names shard(s) that are not there: {', '.join(missing[:5])}; finish the download")
    tensors: dict[str, dict] = {}
    for f in files:
        header, problem = read_header(f)
        if problem:
            problems.append(problem)
        else:
            tensors |= {k: v for k, v in header.items() if k != "__metadata__"}
    return tensors


def read_header(path: Path) -> tuple[dict, str | None]:
    """The JSON header of a safetensors file, or a problem saying why it cannot be one."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(64)
        if head.startswith(LFS_POINTER):
            return {}, (f"{path}: a git-lfs pointer ({size} bytes), not the weights; run `git lfs pull` in the model's "
                        "repository, or download it with `hf download`")
        if size < 8:
            return {}, f"{path}: {size} bytes, too short to be safetensors; download it again"
        (n,) = struct.unpack("<Q", head[:8])
        if n > size - 8:
            return {}, f"{path}: truncated ({size} bytes, its header alone says {n + 8}); download it again"
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return {}, f"{path}: the safetensors header is not valid JSON ({e}); download it again"
    try:
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError):
        return {}, f"{path}: the safetensors header has no valid data_offsets; download it again"
    if 8 + n + end > size:
        return {}, f"{path}: truncated: {size} bytes, its tensors end at byte {8 + n + end} ({(8 + n + end - size) / 2**20:.1f} MiB missing); download it again"
    return header, None


def _shapes(config: dict, tensors: dict[str, dict]) -> list[str]:
    """The 16/32-bit tensors the estimate and the converter rely on, against config.json."""
    c = config.get("text_config", config)
    problems = []

    def shape_of(suffix: str) -> tuple[str, list[int]] | None:
        for name, t in tensors.items():
            if name.endswith(suffix) and t.get("dtype") in FLOAT_DTYPES:
                return name, t["shape"]
        return None

    vocab, hidden = c.get("vocab_size"), c.get("hidden_size")
    emb = shape_of("embed_tokens.weight") or shape_of("wte.weight")
    if emb and hidden and vocab and emb[1] != [vocab, hidden]:
        problems.append(f"config.json says vocab_size {vocab} x hidden_size {hidden}, but {emb[0]} is {emb[1][0]} x {emb[1][1]}: "
                        "the config does not belong to these weights; use the config.json that came with them")
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads") or c.get("num_attention_heads")
    head_dim = c.get("head_dim") or (hidden // heads if hidden and heads else None)
    for proj, rows in (("layers.0.self_attn.q_proj.weight", heads), ("layers.0.self_attn.k_proj.weight", kv)):
        found = shape_of(proj)
        if found and rows and head_dim and hidden and found[1] != [rows * head_dim, hidden]:
            problems.append(f"config.json implies {found[0]} of {rows * head_dim} x {hidden} ({rows} heads of {head_dim}), but it is "
                            f"{found[1][0]} x {found[1][1]}: the config does not belong to these weights; use the config.json that came with them")
    layers = {int(p) for name in tensors for p in [_layer_index(name)] if p is not None}
    if layers and c.get("num_hidden_layers") and max(layers) + 1 != c["num_hidden_layers"]:
        problems.append(f"config.json says num_hidden_layers {c['num_hidden_layers']}, the weights hold {max(layers) + 1} layers: "
                        "the config does not belong to these weights; use the config.json that came with them")
    return problems


def _layer_index(name: str) -> str | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layers", "h") and parts[i + 1].isdigit():
            return parts[i + 1]
    return None


def _tokenizer(model_dir: Path, trust_remote_code: bool) -> list[str]:
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")):
        return [f"{model_dir}: no tokenizer (tokenizer.json or tokenizer.model); copy the tokenizer files from the model's source"]
    from transformers import AutoTokenizer

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a broken file makes transformers log a malformed record ("--- Logging error ---")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:  # a tokenizer file that does not parse, a missing dependency: all the user's to fix
        return [f"{model_dir}: the tokenizer does not load ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}); "
                "restore its files from the model's source"]
    finally:
        quiet.setLevel(level)
    ids = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    unknown = sum(i == tok.unk_token_id for i in ids) if tok.unk_token_id is not None else 0
    if len(ids) < 8 or unknown > len(ids) // 2:
        return [f"{model_dir}: the tokenizer turns a 15-word sentence into {len(ids)} token(s) ({unknown} unknown): its vocabulary "
                "is missing or wrong (tokenizer.model / tokenizer.json); restore the tokenizer files from the model's source"]
    return []
