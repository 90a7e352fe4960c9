"""What an exported GGUF says it is: llama.cpp's `general.*` authorship keys, from the run and its base model.

The converter names a GGUF after what it finds beside the weights: a model card's front matter, config.json's
`_name_or_path`, else the directory's own name. The merge stage's directory is `model` and has no card, so every file
said `general.name = "Model"`, which is what llama-server's /props, Ollama and every model list showed. Export hands the
converter an override file (`convert_hf_to_gguf.py --metadata`) written here:

    general.name                 handoff.model_name, the name the serving team knows the model by (" (Phi-3)" added
                                 where the tokenizer needs llama.cpp's Phi-3 whitespace rule: stages/export/vocab.py)
    general.finetune             handoff.model_name (what the base was tuned toward, in llama.cpp's naming convention
                                 <basename>-<size>-<finetune>)
    general.basename             the base model's family as llama.cpp parses a Hugging Face id ("Qwen2.5" of
                                 Qwen/Qwen2.5-7B-Instruct), or the base directory's name
    general.base_model.count     1
    general.base_model.0.name    the base, titled as llama.cpp titles a model card's `base_model` ("Qwen2.5 7B Instruct")
    general.base_model.0.organization, .repo_url   where the base is a Hugging Face repo id (given as one, or a
                                 snapshot in the HF cache): https://huggingface.co/<org>/<name>
    general.license (.name, .link)   when the base's README front matter (or config.json) says

gguf-py's override reader takes every key above but `general.license`, which it reads only from a model card: the
converter launcher (stages/export/convert.py) sets that one from the same file. The quantizer copies every key.
"""

from __future__ import annotations

import re
from pathlib import Path

from stages.model.directory import config_json

# A Hugging Face repo id: an optional organization and a name; `--` and `..` are refused by the Hub
HF_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
LICENSE_KEYS = {"license": "general.license", "license_name": "general.license.name", "license_link": "general.license.link"}
NAME_KEYS = ("general.name", "general.basename", "general.finetune")


def hf_repo_id(name_or_path: str, model_dir: Path) -> str | None:
    """The base's Hugging Face repo id: `name_or_path` itself when it names no local directory (resolve_model_dir took it
    from the HF cache), or the id of the HF cache snapshot a local path points into; None for any other directory."""
    if not Path(name_or_path).expanduser().exists() and HF_ID.match(name_or_path) and ".." not in name_or_path:
        return name_or_path
    for part in Path(model_dir).resolve().parts[::-1]:
        if part.startswith("models--"):  # huggingface_hub's cache: models--<org>--<name>/snapshots/<revision>
            return part.removeprefix("models--").replace("--", "/", 1)
    return None


def base_license(model_dir: Path) -> dict[str, str]:
    """The base's license as its model card's front matter (gguf-py's own reader) or its config.json gives it."""
    from gguf import Metadata

    card = Metadata.load_model_card(Path(model_dir))
    try:
        config = config_json(model_dir)
    except (OSError, ValueError):
        config = {}
    out = {}
    for src, key in LICENSE_KEYS.items():
        value = card.get(src, config.get(src))
        if isinstance(value, list):  # a card may list several: llama.cpp writes them comma-separated
            value = ",".join(map(str, value))
        if value:
            out[key] = str(value)
    return out


def override(model_name: str, name_or_path: str, model_dir: Path, tokenizer=None) -> dict:
    """The `--metadata` override for a GGUF of the fine-tune `model_name` of the base `name_or_path` (found in `model_dir`);
    with the HF `tokenizer`, general.name is the name llama.cpp must see to tokenize as it does (vocab.served_name)."""
    from gguf import Metadata

    from stages.export import vocab

    repo = hf_repo_id(name_or_path, model_dir)
    full, org, basename, _finetune, version, _size = Metadata.get_model_id_components(repo or Path(model_dir).resolve().name, 0)
    base = {"name": Metadata.id_to_title(full)}
    if repo:
        base |= {"organization": Metadata.id_to_title(org)} if org else {}
        base |= {"version": version} if version else {}
        base["repo_url"] = f"https://huggingface.co/{repo}"
    name = model_name if tokenizer is None else vocab.served_name(model_name, tokenizer, model_dir)
    return {"general.name": name, "general.basename": basename or full, "general.finetune": model_name,
            "general.base_models": [base]} | base_license(model_dir)


def expected_fields(meta: dict) -> dict:
    """The GGUF keys (as gguf-py reads them back) that `meta` makes the converter write."""
    out = {k: v for k, v in meta.items() if k != "general.base_models"}
    bases = meta.get("general.base_models") or []
    if bases:
        out["general.base_model.count"] = len(bases)
    for i, b in enumerate(bases):
        out |= {f"general.base_model.{i}.{k}": v for k, v in b.items()}
    return out


def check(info: dict, meta: dict, what: str) -> dict:
    """The names `meta` asked for, as the GGUF `what` holds them; a RuntimeError if the converter wrote others."""
    want = expected_fields(meta)
    got = {k: info["fields"].get(k) for k in want}
    wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    if wrong:
        raise RuntimeError(f"{what}: llama.cpp's converter did not write the names it was given: "
                           + ", ".join(f"{k} is {g!r}, expected {w!r}" for k, (g, w) in wrong.items())
                           + "; the converter's --metadata handling changed: see stages/export/naming.py")
    return got
