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
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from stages.model.directory import config_text

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
    weights: list[str] = []
    tensors = _safetensors(model_dir, weights)
    problems += weights
    # weights that are missing or unreadable (a shard not there, a truncated file) leave tensors out: compared with
    # config.json, the config would be blamed for what the download lacks
    if config and tensors and not weights:
        head = _task_head(config, tensors, model_dir)
        if head:  # a classifier's weights lack the output layer a causal LM has: the config is right, the model is not one
            problems.append(head)
        else:
            sizes = _shapes(config, tensors)
            # sizes that contradict the config are already the clearest message; a tensor-by-tensor comparison would repeat it
            problems += sizes or _architecture(config, tensors, model_dir, trust_remote_code)
    problems += _tokenizer(model_dir, trust_remote_code)
    return tuple(problems)


# Architecture name endings of checkpoints whose output layer answers another task than the next token: what the model is, what that layer gives
TASK_HEADS = {"ForSequenceClassification": ("a sequence classifier", "labels"), "ForTokenClassification": ("a token classifier", "labels"),
              "ForQuestionAnswering": ("an extractive question-answering model", "answer-span positions")}
HEAD_LAYERS = ("score", "classifier", "qa_outputs")


def _task_head(config: dict, tensors: dict[str, dict], model_dir: Path) -> str | None:
    """A checkpoint of a classification (or question-answering) model: the causal LM transformers would build from its
    model_type gets a random output layer in place of its head, and trains and exports a model that writes noise."""
    named = next((a for a in config.get("architectures") or [] for suffix in TASK_HEADS if a.endswith(suffix)), None)
    head = next((n for n in tensors if n.count(".") == 1 and n.split(".")[0] in HEAD_LAYERS), None)
    has_lm_head = any(n.endswith("lm_head.weight") for n in tensors)
    if not named and not (head and not has_lm_head):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    what, outputs = next((v for k, v in TASK_HEADS.items() if named and named.endswith(k)), ("a classifier", "labels"))
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), "...ForCausalLM")
    c = config.get("text_config", config)
    shape = tensors[head].get("shape") if head else None
    layer = (f"its output layer {head} ({shape[0]} x {shape[1]}) gives {shape[0]} {outputs}, not the {c.get('vocab_size')}-token "
             "vocabulary" if shape and len(shape) == 2 else "it has no lm_head (the output layer over the vocabulary)")
    return ((f"{model_dir / 'config.json'}: the architecture is {named}, {what}: " if named else f"{model_dir}: the weights are {what}'s: ")
            + f"{layer}; it is not a causal language model, which this pipeline fine-tunes (next-token LoRA) and llama.cpp serves; "
            f"set model.name_or_path to the causal LM checkpoint it was made from (a {causal} with its lm_head, e.g. the base model "
            "the classifier was fine-tuned from)")


def _config(model_dir: Path, trust_remote_code: bool, problems: list[str]) -> dict | None:
    path = model_dir / "config.json"
    try:
        config = json.loads(config_text(model_dir))
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
    # The attention's projections are judged by the architecture's own expected tensors (_architecture): a formula of
    # heads x head_dim refused DeepSeek's latent attention, whose queries are heads x (nope + rope) wide.
    layers = {int(p) for name in tensors for p in [_layer_index(name)] if p is not None}
    if layers and c.get("num_hidden_layers") and max(layers) + 1 != c["num_hidden_layers"]:
        problems.append(f"config.json says num_hidden_layers {c['num_hidden_layers']}, the weights hold {max(layers) + 1} layers: "
                        "the config does not belong to these weights; use the config.json that came with them")
    return problems


# model_types tried, on a mismatch, for one whose architecture expects exactly these tensors (the families
# people fine-tune most; only built on that error path)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "olmo2", "granite", "stablelm", "starcoder2")
SHOWN = 3  # example tensor names per kind of mismatch


@dataclass
class Gap:
    """How the tensors of the weights differ from those an architecture expects (names as the model has them)."""

    missing: list[str] = field(default_factory=list)                        # expected, in no weights file
    shapes: list[tuple[str, tuple, tuple]] = field(default_factory=list)    # (name, expected, in the file)
    unexpected: list[str] = field(default_factory=list)                     # in the files, with no place in the model
    compared: int = 0                                                        # expected tensors found and compared

    def __bool__(self) -> bool:
        return bool(self.missing or self.shapes or self.unexpected)

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} tensor(s) it expects are in no weights file (e.g. {', '.join(self.missing[:SHOWN])})")
        if self.shapes:
            parts.append(f"{len(self.shapes)} tensor(s) have another shape (e.g. "
                         + ", ".join(f"{n} is {list(got)}, expected {list(want)}" for n, want, got in self.shapes[:SHOWN]) + ")")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} tensor(s) in the weights have no place in it (e.g. {', '.join(self.unexpected[:SHOWN])})")
        return "; ".join(parts)


def _architecture(config: dict, tensors: dict[str, dict], model_dir: Path, trust_remote_code: bool) -> list[str]:
    """The tensors the architecture config.json names expects (built on the meta device) against those the
    safetensors headers hold: a model_type of another family loads with tensors missing (initialised at random,
    with only a warning) or ignored, and the run trains on a broken model, or dies in a library traceback."""
    from stages.model import architecture

    arch = architecture.from_config(config, trust_remote_code, str(model_dir))
    if arch is None or not arch.parameters:  # not buildable here: the size checks above are all there is
        return []
    gap = compare(arch, tensors, quantized=bool(config.get("quantization_config")))
    if not gap:
        return []
    fits = None if trust_remote_code and config.get("auto_map") else _family_that_fits(config, tensors, arch.model_type)
    fix = (f"set model_type to {fits[0]!r} (and architectures to [{fits[1]!r}]) in config.json, or use the config.json that came "
           "with these weights" if fits else "use the config.json that came with these weights")
    return [f"{model_dir / 'config.json'}: model_type {arch.model_type!r} ({arch.model_class}) does not match the weights: {gap.describe()}; "
            f"the config does not belong to these weights: {fix}"]


def compare(arch, tensors: dict[str, dict], quantized: bool = False) -> Gap:
    """`tensors` (safetensors header entries by checkpoint name) against `arch.parameters`, each checkpoint name
    renamed as transformers renames it on load (its conversion mapping, a missing or extra base-model prefix).

    What is not a mismatch: a tied output layer absent from the checkpoint; parameters the model class lets
    be missing; tensors transformers fuses on load (MoE experts: their parts are not compared); buffers and
    tensors outside the model's layers (rotary inv_freq, multi-token-prediction layers, a vision tower).
    Quantized checkpoints hold packed weights and extra tensors: there, a module counts as present when any
    tensor under its name is, and only 16/32-bit tensors are compared or counted as unexpected."""
    expected = arch.parameters
    rename = _renamer(arch)
    ignored = _ignored(arch, "_keys_to_ignore_on_load_unexpected")
    found: dict[str, dict] = {}
    fused: set[str] = set()
    unexpected = []
    modules = set()  # quantized: the modules any tensor is stored under (GPTQ's q_proj.qweight counts for q_proj.weight)
    for key, t in tensors.items():
        name, converted = rename(key)
        if quantized:
            modules.add(name.rsplit(".", 1)[0])
        if converted:
            fused.add(name)
        elif name in expected:
            found[name] = t
        elif _has_place(name, expected) and t.get("dtype") in FLOAT_DTYPES and not quantized and not any(p.search(name) for p in ignored):
            unexpected.append(name)
    present = set(found) | fused
    optional = _may_be_missing(arch)
    missing = [n for n in expected if n not in present and not any(p.search(n) for p in optional)
               and not (quantized and n.rsplit(".", 1)[0] in modules)]
    shapes = [(n, expected[n], tuple(t["shape"])) for n, t in found.items()
              if t.get("dtype") in FLOAT_DTYPES and tuple(t["shape"]) != tuple(expected[n])]
    return Gap(missing, shapes, unexpected, len(found))


def _renamer(arch):
    """checkpoint name -> (name in the model, fused on load), as transformers' loader renames it."""
    try:
        import transformers
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # another transformers layout: compare names as they are
        return lambda key: (key, False)
    transforms = [*(get_checkpoint_conversion_mapping(arch.model_class) or get_checkpoint_conversion_mapping(arch.model_type) or []),
                  *(get_checkpoint_conversion_mapping("legacy") or [])]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(getattr(transformers, arch.model_class, None), "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, bool]:
        try:
            name, converter = rename_source_key(key, renamings, converters, prefix, arch.parameters)
        except Exception:  # a pattern this transformers cannot apply to the name: leave it as it is
            return key, False
        return name, converter is not None

    return rename


def _may_be_missing(arch) -> list[re.Pattern]:
    """Parameters a checkpoint may leave out: the output layer when tied to the input table, and what the
    model class declares (_keys_to_ignore_on_load_missing)."""
    tied = [re.compile(rf"(^|\.){re.escape(arch.output_layer)}\.weight$")] if arch.tied and arch.output_layer else []
    return tied + _ignored(arch, "_keys_to_ignore_on_load_missing")


def _ignored(arch, attribute: str) -> list[re.Pattern]:
    """The name patterns the model class tells transformers' loader to pass over silently."""
    import transformers

    out = []
    for p in getattr(getattr(transformers, arch.model_class, None), attribute, None) or []:
        try:
            out.append(re.compile(p))
        except re.error:
            continue
    return out


def _has_place(name: str, expected: dict) -> bool:
    """A weight or bias inside a block the model has (a bias on its q_proj, a q_norm in its attention): the
    weights were made for another layout of the same model. Buffers (inv_freq), layers past the model's
    (multi-token prediction) and whole towers it lacks (vision) are not counted."""
    if not name.endswith((".weight", ".bias")) or name.count(".") < 2:
        return False
    block = name.rsplit(".", 2)[0] + "."
    return any(n.startswith(block) for n in expected)


def _family_that_fits(config: dict, tensors: dict[str, dict], model_type: str) -> tuple[str, str] | None:
    """(model_type, architecture class) of a common family whose architecture expects exactly these tensors."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from stages.model import architecture

    quantized = bool(config.get("quantization_config"))
    for family in FAMILIES:
        if family == model_type or family not in CONFIG_MAPPING:
            continue
        arch = architecture.from_config({k: v for k, v in config.items() if k not in ("architectures", "auto_map")} | {"model_type": family})
        if arch is not None and arch.parameters and not compare(arch, tensors, quantized):
            return family, arch.model_class
    return None


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
    return _template(tok)


PROBE_CHAT = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]


def _template(tok) -> list[str]:
    """A chat template that does not parse or reaches for Python internals, named as the culprit now, not as
    a failure on the first data line. A template that raises on this probe for other reasons (roles it wants
    alternating, a system turn it requires) is judged on the real data later."""
    if not tok.chat_template:
        return []  # loading the tokenizer for the run says so, with the fix
    try:
        tok.apply_chat_template(PROBE_CHAT, tokenize=False)
    except Exception as e:  # noqa: BLE001 - only the template's own faults are reported here
        if template_at_fault(e):
            return [template_problem(tok, e)]
    return []


def chat_template_file(model_dir: Path) -> str:
    """Where a model directory's chat template is: chat_template.jinja, which transformers reads first, else
    tokenizer_config.json's `chat_template`."""
    jinja = Path(model_dir) / "chat_template.jinja"
    return str(jinja) if jinja.is_file() else f"{Path(model_dir) / 'tokenizer_config.json'} (its chat_template)"


def template_at_fault(e: BaseException) -> bool:
    """A chat template that does not parse, or that reaches for Python internals (jinja2's sandbox refuses it):
    whatever the sample, the template is what to fix."""
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    return isinstance(e, (SecurityError, TemplateSyntaxError))


def template_problem(tokenizer, e: BaseException) -> str:
    where = chat_template_file(Path(getattr(tokenizer, "name_or_path", "") or "."))
    why = ("reaches for Python internals, which transformers' sandbox refuses and no chat template needs"
           if type(e).__name__ == "SecurityError" else "is not valid Jinja")
    return (f"the chat template in {where} {why} ({type(e).__name__}: {str(e)[:200]}); the model's files are at fault, not the data: "
            "restore the chat template that came with the model, or replace it with a plain one (its messages loop only)")
