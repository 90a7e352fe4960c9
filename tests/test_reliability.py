"""Reliability suite: bad inputs and faults through the README's command, judged by one set of rules.

Each refused case breaks one thing in a copy of the default (its data, config, model files or
run) and runs `python -m flows.train_and_export`'s main in-process. The same rules judge every
case, whatever its message says:
  1. exit code 2;
  2. exactly one "train-and-export stopped: <Error>: <message>" line on stderr, and no traceback
     anywhere in the output (fd-level capture: Prefect's log handlers included);
  3. the message names what was wrong: the file, key or value the case broke (`names`), and not a wrong
     diagnosis beside it (`absent`: another file blamed as well);
  4. the message says how to fix it: it holds one of FIX_WORDS;
  5. the hand-off directory (holding an earlier bundle and `latest`) is byte-identical after,
     and no adapter was trained.
Accepted cases are inputs users have that must simply work (other encodings, compression,
OpenAI message fields): they must read to exactly the samples of the plain UTF-8 file.
Adding a case is one line in CASES. A case about the environment rather than the files gives `env`
(variables set for the run: a tracker URI, a PYTHONPATH on which a package fails to import) and,
where the run must start with it, `fresh` (a new process) or `mounts` (filesystems mounted for that
process alone, in a user and mount namespace: a full disk, a read-only directory). The cases found
before training (`before_training`) are also refused by `python -m stages.preflight` alone. The
suite writes tests/reliability_summary.json (cases tried and passed per category), which the
README's reliability section quotes.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, seeded_prefect_home, write_config

pytestmark = pytest.mark.slow

FIX_WORDS = ("set ", "use ", "add ", "remove", "point ", "download", "restore", "raise ", "run ", "fix ", "give ", "copy ",
             "free ", "rename", "pass ", "save ", "convert", "choose", "install", "re-export", "did you mean", "replace", "lower ",
             "split ", "compress", "merge them", "wait ", "start ", "rerun", "finish", "keys are", "valid keys", "must look like",
             "add it", "drop", "truncate", "a larger", "another --run-id", "a new --run-id", "a plain name")
# Cases tried and passed per category: tests/conftest.py sums them over the xdist workers into
# tests/reliability_summary.json at the end of the session.
RESULTS: Counter = Counter()
TRIED: Counter = Counter()


@dataclass
class Case:
    category: str
    name: str
    setup: object           # (ws) -> None: breaks the workspace
    names: object           # what the message must name (a file name, a key, a value); or (ws) -> that
    args: tuple = ()        # extra CLI arguments
    env: object = None      # (ws) -> {variable: value} for the run
    fresh: bool = False     # the run starts in a new process (what `env` breaks is read at start-up)
    mounts: object = None   # (ws) -> shell commands mounting filesystems for the run's process alone
    before_training: bool = False  # the preflight's own checks find it: `python -m stages.preflight` refuses it too
    absent: str = ""        # what the message must not say (a second, wrong diagnosis)


class Workspace:
    """A copy of the default (model, data, config) under tmp, with an earlier bundle already published."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        shutil.copytree(REPO / "assets" / "tiny-llama", self.model)
        self.data = tmp / "data"
        self.data.mkdir()
        for f in ("translate_train.jsonl", "translate_eval.jsonl"):
            shutil.copy(REPO / "assets" / "data" / f, self.data / f)
        self.sections: dict = {"model": {"name_or_path": str(self.model)},
                               "data": {"train_file": str(self.train), "eval_file": str(self.eval)},
                               "training": {"max_steps": 5, "save_steps": 5},
                               # what fails here is not the imatrix (tests/test_imatrix.py) nor the adapter's proof
                               # (tests/test_adapter_handoff.py): each would cost every run here its time
                               "export": {"imatrix": "off"}, "handoff": {"adapter": "off"}}
        bundle = tmp / "handoff" / "tiny-llama-translate" / "v0"
        bundle.mkdir(parents=True)
        (bundle / "model-Q4_K_M.gguf").write_bytes(b"earlier bundle")
        (bundle / "SHA256SUMS").write_text("x  model-Q4_K_M.gguf\n")
        (bundle.parent / "latest").symlink_to("v0")

    @property
    def train(self) -> Path:
        return self.data / "translate_train.jsonl"

    @property
    def eval(self) -> Path:
        return self.data / "translate_eval.jsonl"

    @property
    def config(self) -> Path:
        return self.tmp / "config.yaml"

    def set(self, section: str, **values) -> None:
        self.sections.setdefault(section, {}).update(values)

    def write(self) -> Path:
        return write_config(self.tmp, **self.sections)

    def lines(self, *objs) -> None:
        self.train.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b"dir")
    return h.hexdigest()


GOOD = {"prompt": "Translate to French: red cat", "completion": "rouge chat"}


def _raw_config(ws: Workspace, mutate) -> None:
    """Write the config, then edit its text (for what YAML itself must refuse)."""
    ws.write()
    ws.config.write_text(mutate(ws.config.read_text()))
    ws.sections = None  # written: leave it as it is


def _model_config(ws: Workspace, **changes) -> None:
    c = json.loads((ws.model / "config.json").read_text())
    c.update(changes)
    (ws.model / "config.json").write_text(json.dumps(c))


def _safetensors(ws: Workspace) -> Path:
    return ws.model / "model.safetensors"


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _free_port() -> int:
    """A local port nothing listens on: bound to get a free one, then closed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unimportable(ws: Workspace, *packages: str) -> str:
    """A folder that, first on PYTHONPATH, makes `packages` fail to import as they do when not installed."""
    shadow = ws.tmp / "shadow"
    for name in packages:
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(f'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n')
    return str(shadow)


def _broken_converter(ws: Workspace) -> dict:
    """A copy of the converter whose own gguf-py does not import (a cache damaged after install)."""
    from stages.export import llamacpp

    copy = ws.tmp / "converter"
    shutil.copytree(llamacpp.converter_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "gguf-py" / "gguf" / "__init__.py").write_text("raise ImportError('gguf-py damaged: cannot import name GGUFWriter')\n")
    return {"TAE_CONVERTER_DIR": str(copy)}


def _tmpfs(ws: Workspace, key: str, size: str) -> list[str]:
    """`key` (artifacts_dir or handoff.dir) on a tmpfs of `size` of its own."""
    where = ws.tmp / f"small-{key.replace('.', '-')}"
    where.mkdir(exist_ok=True)
    return [f"mount -t tmpfs -o size={size} tmpfs {where}"]


def _on_tmpfs(ws: Workspace, key: str) -> None:
    where = ws.tmp / f"small-{key.replace('.', '-')}"
    if key == "handoff.dir":
        ws.set("handoff", dir=str(where))
    else:
        ws.sections[key] = str(where)


def _read_only_tensorboard(ws: Workspace) -> list[str]:
    where = ws.tmp / "artifacts" / "runs" / "tb" / "train" / "tensorboard"
    where.mkdir(parents=True, exist_ok=True)
    return [f"mount --bind {where} {where}", f"mount -o remount,bind,ro {where}"]


def _chat_template(ws: Workspace, template: str) -> None:
    path = ws.model / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"chat_template": template}))


ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _tokenizer_config(ws: Workspace, **changes) -> None:
    path = ws.model / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _tokenizer_json(ws: Workspace, kind: str) -> None:
    """A tokenizer.json beside (or instead of) the SentencePiece model, as a hand-made or mismatched tokenizer has it:
    `chars`, a BPE with no merges (every word split into characters) beside tokenizer.model, which llama.cpp's
    converter reads instead; `wordlevel`, a word-level tokenizer alone, which the converter cannot read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(ws.model).get_vocab()
    if kind == "chars":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    else:
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (ws.model / "tokenizer.model").unlink()
    tok.save(str(ws.model / "tokenizer.json"))


def _imatrix(ws: Workspace, names: dict[str, int]) -> None:
    """export.imatrix: an importance matrix of `names` (GGUF tensor -> width), as llama-imatrix writes one."""
    import numpy as np

    from stages.export import imatrix

    path = ws.tmp / "imatrix.gguf"
    imatrix.Imatrix({n: np.ones(w, np.float32) for n, w in names.items()}, {n: 512 for n in names}, 512, 1, "other.txt").write(path)
    ws.set("export", imatrix=str(path))


def _gguf(path: Path) -> Path:
    """A model GGUF as gguf's writer makes one (a file of a published bundle)."""
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _model_gguf(ws: Workspace) -> None:
    """export.imatrix pointing at a model GGUF (the wrong file of a bundle)."""
    ws.set("export", imatrix=str(_gguf(ws.tmp / "model-Q4_K_M.gguf")))


def _chatml(ws: Workspace) -> None:
    """tiny-chatml (byte-level BPE, ChatML, <|im_start|>/<|im_end|> as special tokens) in place of tiny-llama."""
    shutil.rmtree(ws.model)
    shutil.copytree(REPO / "assets" / "tiny-chatml", ws.model)


CHATML_GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
# an answer pasted from a chat log: tokenized as it is, it ends the assistant turn and opens a user turn
PASTED = "rouge chat<|im_end|>\n<|im_start|>user\nthanks"


def _chatml_template() -> str:
    return json.loads((REPO / "assets" / "tiny-chatml" / "tokenizer_config.json").read_text())["chat_template"]


def _no_generation_prompt(ws: Workspace) -> None:
    """tiny-chatml's template without its generation prompt: it renders the same with and without add_generation_prompt."""
    _chatml(ws)
    template = _chatml_template()
    assert CHATML_GENERATION_PROMPT in template
    _chat_template(ws, template.replace(CHATML_GENERATION_PROMPT, ""))


def _named_templates(ws: Workspace, *names: str) -> None:
    """chat_template as a list of named templates (`default`, `tool_use`, ...), as several releases ship it."""
    _chatml(ws)
    _tokenizer_config(ws, chat_template=[{"name": n, "template": f"{{# {n} #}}" + _chatml_template()} for n in names])


def _pasted_answer(ws: Workspace) -> None:
    _chatml(ws)
    ws.lines(GOOD, {"messages": [{"role": "user", "content": "Translate to French: red cat"}, {"role": "assistant", "content": PASTED}]})


def _classifier(ws: Workspace) -> None:
    """LlamaForSequenceClassification weights saved by transformers: a `score` head of 3 labels, no lm_head."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(ws.model, num_labels=3)
    _safetensors(ws).unlink()
    LlamaForSequenceClassification(config).save_pretrained(ws.model)


def _adapter(ws: Workspace) -> None:
    """model.name_or_path at a LoRA adapter peft saved (what an earlier run's train/adapter holds)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(ws.model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(ws.tmp / "adapter")
    ws.set("model", name_or_path=str(ws.tmp / "adapter"))


def _missing_shard(ws: Workspace) -> None:
    """The weights saved in two shards with their index, the second shard missing (a download cut short)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(_safetensors(ws))
    _safetensors(ws).unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ws.model / shard, metadata={"format": "pt"})
    (ws.model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: shard for shard, keys in shards.items() for k in keys}}))
    (ws.model / "model-00002-of-00002.safetensors").unlink()


def _read_only(ws: Workspace, where: Path) -> list[str]:
    where.mkdir(parents=True, exist_ok=True)
    return [f"mount --bind {where} {where}", f"mount -o remount,bind,ro {where}"]


def _latest_a_directory(ws: Workspace) -> None:
    root = ws.tmp / "handoff" / "tiny-llama-translate"
    (root / "latest").unlink()
    (root / "latest").mkdir()
    (root / "latest" / "model-Q4_K_M.gguf").write_bytes(b"copied by hand")


def _no_handoff(ws: Workspace) -> None:
    shutil.rmtree(ws.tmp / "handoff")


def _empty_parquet(ws: Workspace) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = ws.data / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "completion": pa.array([], pa.string())}), path)
    ws.set("data", train_file=str(path))


def _long_eval(ws: Workspace) -> None:
    """Every eval sample over data.max_length (64 tokens), each prompt within smoke.n_ctx; the policy drops them."""
    ws.eval.write_text("".join(json.dumps({"prompt": "Translate to French: " + "red cat " * 40, "completion": "rouge chat"}) + "\n"
                               for _ in range(3)))
    ws.set("data", long_sample_policy="drop")


def _published(ws: Workspace) -> None:
    bundle = ws.tmp / "handoff" / "tiny-llama-translate" / "taken"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")


def _other_config(ws: Workspace) -> None:
    run = ws.tmp / "artifacts" / "runs" / "mixed"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("training: {max_steps: 7}\n")


CASES = [
    # data
    Case("data", "line that is not JSON", lambda ws: ws.lines(GOOD, '{"prompt": "a"'), "translate_train.jsonl:2"),
    Case("data", "empty file", lambda ws: ws.train.write_text(""), "translate_train.jsonl"),
    Case("data", "only blank lines", lambda ws: ws.train.write_text("\n\n  \n"), "translate_train.jsonl"),
    Case("data", "unknown role", lambda ws: ws.lines({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
         "translate_train.jsonl:1"),
    Case("data", "misspelt role", lambda ws: ws.lines(GOOD, {"messages": [{"role": "user", "content": "x"}, {"role": "assitant", "content": "y"}]}),
         "translate_train.jsonl:2"),
    Case("data", "no assistant turn", lambda ws: ws.lines({"messages": [{"role": "user", "content": "hello"}]}), "translate_train.jsonl:1"),
    Case("data", "empty assistant turn", lambda ws: ws.lines({"prompt": "a", "completion": "  "}), "translate_train.jsonl:1"),
    Case("data", "neither messages nor prompt", lambda ws: ws.lines({"question": "a", "answer": "b"}), "translate_train.jsonl:1"),
    Case("data", "a JSON array file", lambda ws: ws.train.write_text(json.dumps([GOOD, GOOD], indent=2)), "JSON array"),
    Case("data", "a one-line JSON array", lambda ws: ws.train.write_text(json.dumps([GOOD, GOOD]) + "\n"), "JSON array"),
    Case("data", "invalid UTF-8 bytes", lambda ws: ws.train.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "\xff", "completion": "x"}\n'),
         "translate_train.jsonl:2"),
    Case("data", "a line over the size limit", lambda ws: ws.train.write_bytes(b'{"prompt": "' + b"a" * (17 * 2**20) + b'", "completion": "x"}\n'),
         "translate_train.jsonl:1"),
    Case("data", "damaged gzip", lambda ws: ws.train.write_bytes(gzip.compress(json.dumps(GOOD).encode())[:20]), "gzip"),
    Case("data", "messages is not a list", lambda ws: ws.lines({"messages": "hello"}), "translate_train.jsonl:1"),
    Case("data", "content is not text", lambda ws: ws.lines({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "y"}]}),
         "translate_train.jsonl:1"),
    Case("data", "unsupported message field", lambda ws: ws.lines({"messages": [{"role": "user", "content": "x"},
                                                                   {"role": "assistant", "content": "y", "weight": 0}]}), "weight"),
    Case("data", "a line that is a number", lambda ws: ws.lines(GOOD, "42"), "translate_train.jsonl:2"),
    Case("data", "binary garbage", lambda ws: ws.train.write_bytes(bytes(range(256)) * 4), "translate_train.jsonl"),
    Case("data", "CSV named .jsonl", lambda ws: ws.train.write_text("prompt,completion\nred cat,rouge chat\n"), "translate_train.jsonl:1"),
    Case("data", "sample over max_length", lambda ws: ws.lines(GOOD, {"prompt": "Translate to French: " + "red " * 200, "completion": "rouge"}),
         "translate_train.jsonl:2"),
    Case("data", "every sample dropped", lambda ws: ws.set("data", max_length=4, long_sample_policy="drop"), "data.max_length"),
    Case("data", "train_file is a folder without data files", lambda ws: ((ws.tmp / "empty").mkdir(), ws.set("data", train_file=str(ws.tmp / "empty"))),
         "no data files"),
    Case("data", "a CSV file with no accepted columns", lambda ws: ((ws.tmp / "t.csv").write_text("question,answer\nred cat,rouge chat\n"),
                                                                  ws.set("data", train_file=str(ws.tmp / "t.csv"))), "fields seen: ['answer', 'question']"),
    Case("data", "a hub id that is not in the local cache", lambda ws: ws.set("data", train_file="nobody/no-such-dataset"), "no-such-dataset"),
    Case("data", "both train_file and sources", lambda ws: ws.set("data", sources=[{"path": str(ws.train)}]), "exactly one of them"),
    Case("data", "train_file missing", lambda ws: ws.set("data", train_file=str(ws.data / "nope.jsonl")), "nope.jsonl"),
    Case("data", "eval_file missing", lambda ws: ws.set("data", eval_file=str(ws.data / "gone.jsonl")), "gone.jsonl"),
    Case("data", "eval_file not JSON", lambda ws: ws.eval.write_text('{"prompt": "a", "completion": "b"}\n{oops\n'), "translate_eval.jsonl:2"),
    Case("data", "eval_file empty", lambda ws: ws.eval.write_text(""), "translate_eval.jsonl"),
    Case("data", "eval_file without answers", lambda ws: ws.eval.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"),
         "translate_eval.jsonl:1"),
    Case("data", "every eval sample dropped as too long", _long_eval, "translate_eval.jsonl", before_training=True),
    Case("data", "a Parquet file of 0 rows", _empty_parquet, "empty.parquet has no rows", before_training=True),
    Case("data", "a lone surrogate in a prompt", lambda ws: ws.lines(GOOD, '{"prompt": "red \\ud800 cat", "completion": "rouge chat"}'),
         "translate_train.jsonl:2: prompt holds a lone surrogate", before_training=True),
    Case("data", "a lone surrogate in a message", lambda ws: ws.lines({"messages": [{"role": "user", "content": "red cat"},
                                                                                 {"role": "assistant", "content": "rouge \udc00"}]}),
         "translate_train.jsonl:1: messages[1].content", before_training=True),
    Case("data", "eval_file is the training file", lambda ws: ws.set("data", eval_file=str(ws.train)), "data.eval_file is the training file",
         before_training=True),
    Case("data", "special-token text in an answer (a pasted chat log)", _pasted_answer,
         "translate_train.jsonl:2: the assistant turn (message 2) holds '<|im_end|>', '<|im_start|>'", before_training=True),
    Case("data", "special-token text in a held-out prompt", lambda ws: ws.eval.write_text(
        json.dumps({"prompt": "Translate to French: red </s> cat", "completion": "rouge chat"}) + "\n"),
         "translate_eval.jsonl:1: the user turn (message 1) holds '</s>'", before_training=True),
    Case("data", "an OpenAI tool call", lambda ws: ws.lines(GOOD, {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}), "translate_train.jsonl:2"),
    Case("data", "eval_file a copy of training lines", lambda ws: ws.eval.write_text("".join(ws.train.read_text().splitlines(True)[:30])),
         "30 of the 30 held-out samples", before_training=True),
    # config
    Case("config", "unknown key", lambda ws: ws.set("lora", rank=8), "lora.rank"),
    Case("config", "misspelt section", lambda ws: ws.set("trainng", max_steps=3), "trainng"),
    Case("config", "wrong type", lambda ws: ws.set("lora", r="sixteen"), "lora.r"),
    Case("config", "out of range", lambda ws: ws.set("training", learning_rate=5), "learning_rate"),
    Case("config", "zero steps", lambda ws: ws.set("training", max_steps=0), "max_steps"),
    Case("config", "unsafe model name", lambda ws: ws.set("handoff", model_name="../escape"), "model_name"),
    Case("config", "section given twice", lambda ws: _raw_config(ws, lambda t: t + "training:\n  max_steps: 9\n"), "training"),
    Case("config", "key given twice", lambda ws: _raw_config(ws, lambda t: t.replace("  max_steps: 5\n", "  max_steps: 5\n  max_steps: 6\n")),
         "max_steps"),
    Case("config", "lower-case threshold key", lambda ws: ws.set("export", fidelity={"min_top1": {"q4_k_m": 0.9}}), "q4_k_m"),
    Case("config", "unknown quant type", lambda ws: ws.set("export", quant_types=["Q4_K_X"]), "Q4_K_X"),
    Case("config", "a quant type listed twice", lambda ws: ws.set("export", quant_types=["Q4_K_M", "Q4_K_M"]),
         "export.quant_types: Q4_K_M listed more than once"),
    Case("config", "override without =", lambda ws: None, "training.max_steps", args=("--set", "training.max_steps")),
    Case("config", "override of an unknown key", lambda ws: None, "training.max_stesp", args=("--set", "training.max_stesp=3")),
    Case("config", "config is a list", lambda ws: _raw_config(ws, lambda t: "- model\n- data\n"), "config.yaml"),
    Case("config", "config is not YAML", lambda ws: _raw_config(ws, lambda t: t + "lora: [unclosed\n"), "config.yaml"),
    Case("config", "config is not UTF-8", lambda ws: (ws.write(), ws.config.write_bytes(ws.config.read_bytes() + "# caf\xe9\n".encode("latin-1")),
                                                      setattr(ws, "sections", None)), "config.yaml"),
    Case("config", "artifacts_dir is a file", lambda ws: ((ws.tmp / "afile").write_text("x"), ws.sections.update(artifacts_dir=str(ws.tmp / "afile"))),
         "artifacts_dir"),
    Case("config", "exact smoke check without eval data", lambda ws: ws.set("data", eval_file=None), "eval_file"),
    Case("config", "no target modules", lambda ws: ws.set("lora", target_modules=[]), "target_modules"),
    Case("config", "target modules the model lacks", lambda ws: ws.set("lora", target_modules=["c_attn"]), "c_attn"),
    Case("config", "unknown dtype", lambda ws: ws.set("model", torch_dtype="bf16"), "torch_dtype"),
    Case("config", "unknown long-sample policy", lambda ws: ws.set("data", long_sample_policy="cut"), "long_sample_policy"),
    Case("config", "a budget the weights do not fit", lambda ws: ws.set("preflight", gpu_memory_gib=0.004), "weights"),
    Case("config", "a budget the step does not fit", lambda ws: ws.set("preflight", gpu_memory_gib=0.02), "max_tokens_per_batch"),
    Case("config", "smoke context shorter than the prompts", lambda ws: ws.set("smoke", n_ctx=20), "smoke.n_ctx"),
    Case("config", "override value with a YAML tag", lambda ws: None, "training.max_steps=!!python/object:os.system",
         args=("--set", "training.max_steps=!!python/object:os.system")),
    Case("config", "override value with an unclosed brace", lambda ws: None, "lora.target_modules={q_proj", args=("--set", "lora.target_modules={q_proj")),
    Case("config", "imatrix setting in capitals", lambda ws: ws.set("export", imatrix="AUTO"), "'AUTO' reads as the setting `auto`"),
    Case("config", "imatrix none", lambda ws: ws.set("export", imatrix="none"), "'none' reads as the setting `off`"),
    Case("config", "artifacts_dir a dangling link", lambda ws: ((ws.tmp / "gone").symlink_to(ws.tmp / "nowhere"),
                                                               ws.sections.update(artifacts_dir=str(ws.tmp / "gone" / "artifacts"))),
         "gone is a symbolic link"),
    # the importance matrix a config names: found by the preflight, before any training
    Case("export", "imatrix file missing", lambda ws: ws.set("export", imatrix=str(ws.tmp / "no-such.gguf")), "no-such.gguf",
         before_training=True),
    Case("export", "imatrix a directory", lambda ws: ws.set("export", imatrix=str(ws.data)), "is a directory", before_training=True),
    Case("export", "imatrix random bytes", lambda ws: ((ws.tmp / "noise.gguf").write_bytes(os.urandom(4096)),
                                                      ws.set("export", imatrix=str(ws.tmp / "noise.gguf"))), "noise.gguf is not a GGUF file",
         before_training=True),
    Case("export", "imatrix a model GGUF", _model_gguf, "model-Q4_K_M.gguf is a GGUF file but no importance matrix", before_training=True),
    Case("export", "imatrix of another model's tensors", lambda ws: _imatrix(ws, {"blk.0.ffn_gate_exps.weight": 256, "blk.0.ssm_in.weight": 256}),
         "names none of the tensors", before_training=True),
    Case("export", "imatrix of other widths", lambda ws: _imatrix(ws, {f"blk.{i}.attn_q.weight": 4096 for i in range(2)}),
         "imatrix.gguf was computed on a model of other widths", before_training=True),
    # trackers, export tools, disk: found by the preflight, before any training
    Case("environment", "MLflow server at a closed port", lambda ws: ws.set("training", report_to=["mlflow"]), "MLFLOW_TRACKING_URI",
         env=lambda ws: {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{_free_port()}"}, before_training=True),
    Case("environment", "TensorBoard log directory read-only", lambda ws: ws.set("training", report_to=["tensorboard"]), "tensorboard",
         args=("--run-id", "tb"), mounts=_read_only_tensorboard, before_training=True),
    Case("environment", "artifacts_dir on a disk too small for the export", lambda ws: _on_tmpfs(ws, "artifacts_dir"), "small-artifacts_dir",
         mounts=lambda ws: _tmpfs(ws, "artifacts_dir", "4m"), before_training=True),
    Case("environment", "handoff.dir on a disk too small for the bundle", lambda ws: _on_tmpfs(ws, "handoff.dir"), "small-handoff-dir",
         mounts=lambda ws: _tmpfs(ws, "handoff.dir", "1m"), before_training=True),
    Case("environment", "llama_cpp not importable in the llama.cpp process", lambda ws: None, "llama_cpp",
         env=lambda ws: {"PYTHONPATH": _unimportable(ws, "llama_cpp")}, before_training=True),
    Case("environment", "gguf not importable where the converter runs", lambda ws: None, "gguf",
         env=_broken_converter, before_training=True),
    Case("environment", "gguf not installed", lambda ws: None, "gguf",
         env=lambda ws: {"PYTHONPATH": _unimportable(ws, "gguf"), "NO_LOCAL_GGUF": "1"}, fresh=True, before_training=True),
    Case("environment", "llama-cpp-python not installed", lambda ws: None, "llama-cpp-python",
         env=lambda ws: {"PYTHONPATH": _unimportable(ws, "llama_cpp")}, fresh=True, before_training=True),
    Case("environment", "the converter missing from the cache", lambda ws: None, "convert_hf_to_gguf.py",
         env=lambda ws: {"TAE_CONVERTER_DIR": str(ws.tmp / "no-converter")}, before_training=True),
    # model files
    Case("model", "model directory missing", lambda ws: shutil.rmtree(ws.model), "model"),
    Case("model", "no config.json", lambda ws: (ws.model / "config.json").unlink(), "config.json"),
    Case("model", "pickle weights only", lambda ws: (_safetensors(ws).unlink(), (ws.model / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")),
         "safetensors"),
    Case("model", "truncated weights", lambda ws: _truncate(_safetensors(ws), 0.6), "model.safetensors"),
    Case("model", "git-lfs pointer instead of weights", lambda ws: _safetensors(ws).write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 3609272\n"), "git-lfs"),
    Case("model", "weights header cut short", lambda ws: _truncate(_safetensors(ws), 0.0001), "model.safetensors"),
    Case("model", "truncated config.json", lambda ws: _truncate(ws.model / "config.json", 0.5), "config.json"),
    Case("model", "config.json is a list", lambda ws: (ws.model / "config.json").write_text("[1, 2]"), "config.json"),
    Case("model", "made-up architecture", lambda ws: _model_config(ws, model_type="madeupformer", architectures=["MadeUpForCausalLM"]),
         "madeupformer"),
    Case("model", "config of another family", lambda ws: _model_config(ws, model_type="mamba", architectures=["MambaForCausalLM"],
                                                                      vocab_size=50280, hidden_size=768), "config"),
    Case("model", "hidden size contradicts the weights", lambda ws: _model_config(ws, hidden_size=512), "hidden_size"),
    Case("model", "layer count contradicts the weights", lambda ws: _model_config(ws, num_hidden_layers=4), "num_hidden_layers"),
    Case("model", "vocabulary contradicts the weights", lambda ws: _model_config(ws, vocab_size=32000), "vocab_size"),
    Case("model", "tokenizer files missing", lambda ws: (ws.model / "tokenizer.model").unlink(), "tokenizer"),
    Case("model", "tokenizer file corrupted", lambda ws: (ws.model / "tokenizer.model").write_bytes(os.urandom(512)), "tokenizer"),
    Case("model", "no chat template", lambda ws: (ws.model / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((ws.model / "tokenizer_config.json").read_text()).items() if k != "chat_template"})), "chat template"),
    Case("model", "shard index names a missing shard", lambda ws: (ws.model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})), "model-00002-of-00002.safetensors"),
    Case("model", "a sharded checkpoint missing a shard", _missing_shard, "names shard(s) that are not there: model-00002-of-00002",
         absent="config.json"),
    Case("model", "a GGUF file as the base model", lambda ws: ws.set("model", name_or_path=str(_gguf(ws.tmp / "model-Q4_K_M.gguf"))),
         "model-Q4_K_M.gguf is a GGUF file: a quantized inference file for llama.cpp, not a trainable checkpoint"),
    Case("model", "a folder of GGUF files as the base model", lambda ws: (_gguf(ws.tmp / "gguf" / "model-Q4_K_M.gguf"),
                                                                        ws.set("model", name_or_path=str(ws.tmp / "gguf"))),
         "holds GGUF files (model-Q4_K_M.gguf) and no config.json"),
    Case("model", "a classifier checkpoint", _classifier,
         "the architecture is LlamaForSequenceClassification, a sequence classifier", absent="the config does not belong"),
    Case("model", "a LoRA adapter as the base model", _adapter,
         lambda ws: f"is a PEFT adapter (adapter_config.json, adapter weights), not a base model: it holds only the low-rank update "
                    f"trained on top of {ws.model}, and cannot be trained on as a base; set model.name_or_path to that base, {ws.model}"),
    Case("model", "a chat template without a generation prompt", _no_generation_prompt,
         "ignores add_generation_prompt: it writes the assistant header '<|im_start|>assistant\\n' before each answer", before_training=True),
    Case("model", "named chat templates, none named default", lambda ws: _named_templates(ws, "chat", "tool_use"),
         "is a list of named templates (chat, tool_use), none named `default`", before_training=True),
    Case("model", "model_type with q/k/v biases on Llama weights", lambda ws: _model_config(ws, model_type="qwen2",
                                                                                           architectures=["Qwen2ForCausalLM"]), "q_proj.bias",
         before_training=True),
    Case("model", "model_type with q/k norms on Llama weights", lambda ws: _model_config(ws, model_type="qwen3",
                                                                                        architectures=["Qwen3ForCausalLM"]), "q_norm",
         before_training=True),
    Case("model", "model_type with fused projections on Llama weights", lambda ws: _model_config(ws, model_type="phi3",
                                                                                                architectures=["Phi3ForCausalLM"]), "qkv_proj",
         before_training=True),
    Case("model", "chat template reaching for Python internals", lambda ws: _chat_template(ws, PLAIN_TEMPLATE + ESCAPE),
         "tokenizer_config.json (its chat_template)", before_training=True),
    Case("model", "chat template whose escape only some data triggers", lambda ws: _chat_template(
        ws, "{% for m in messages %}{{ m['content'] }}{% if 'Translate' in m['content'] %}" + ESCAPE + "{% endif %}{% endfor %}"),
         "tokenizer_config.json (its chat_template)", before_training=True),
    Case("model", "eos_token outside the vocabulary", lambda ws: _tokenizer_config(ws, eos_token="<|end|>"),
         "eos_token '<|end|>' has id 448, outside the model's 448-row embedding table"),
    Case("model", "eos_token null", lambda ws: _tokenizer_config(ws, eos_token=None), "has no eos_token"),
    Case("model", "config.json eos_token_id contradicts the tokenizer", lambda ws: _model_config(ws, eos_token_id=5),
         "eos_token_id is 5, but the tokenizer's eos_token is '</s>' (id 2)"),
    Case("model", "config.json bos_token_id outside the vocabulary", lambda ws: _model_config(ws, bos_token_id=50000),
         "bos_token_id 50000 is outside the vocabulary"),
    Case("model", "llama.cpp tokenizes otherwise (legacy false)", lambda ws: _tokenizer_config(ws, legacy=False),
         'set "legacy": true in', before_training=True),
    Case("model", "chat template in two places that differ", lambda ws: (ws.model / "chat_template.jinja").write_text(PLAIN_TEMPLATE),
         "chat_template gguf", before_training=True),
    Case("model", "a tokenizer that splits into characters", lambda ws: _tokenizer_json(ws, "chars"),
         "as many tokens as llama.cpp does", before_training=True),
    Case("model", "a tokenizer the converter cannot read", lambda ws: _tokenizer_json(ws, "wordlevel"), "tokenizer.json",
         before_training=True),
    # runs
    Case("run", "run id climbing out", lambda ws: None, "../escape", args=("--run-id", "../escape")),
    Case("run", "run id with a slash", lambda ws: None, "a/b", args=("--run-id", "a/b")),
    Case("run", "run id already published", _published, "taken", args=("--run-id", "taken")),
    Case("run", "run id of another config", _other_config, "mixed", args=("--run-id", "mixed")),
    Case("run", "run id latest", lambda ws: None, "run id 'latest' is reserved", args=("--run-id", "latest")),
    Case("run", "run id latest, nothing published yet", _no_handoff, "run id 'latest' is reserved", args=("--run-id", "latest")),
    Case("run", "run id empty", lambda ws: None, "run id '' is empty", args=("--run-id", "")),
    Case("run", "a file named like the run id", lambda ws: (ws.tmp / "handoff" / "tiny-llama-translate" / "r1").write_text("x"),
         "r1 is a file, not a published bundle", args=("--run-id", "r1")),
    Case("run", "an empty directory named like the run id", lambda ws: (ws.tmp / "handoff" / "tiny-llama-translate" / "r2").mkdir(),
         "r2 is an empty directory, not a published bundle", args=("--run-id", "r2")),
    Case("run", "latest a directory", _latest_a_directory, "latest is a directory, not the symbolic link", before_training=True),
    Case("environment", "artifacts_dir read-only", lambda ws: ws.sections.update(artifacts_dir=str(ws.tmp / "ro-artifacts")),
         "ro-artifacts cannot be written", mounts=lambda ws: _read_only(ws, ws.tmp / "ro-artifacts")),
    Case("environment", "handoff.dir read-only", lambda ws: None, "handoff.dir", mounts=lambda ws: _read_only(ws, ws.tmp / "handoff")),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.category}: {c.name}" for c in CASES])
def test_refused_with_one_clear_message(case, tmp_path, capfd, prefect_harness, monkeypatch):
    from flows.train_and_export import main

    TRIED[case.category] += 1
    ws = Workspace(tmp_path)
    case.setup(ws)
    if ws.sections is not None:
        ws.write()
    handoff = tree_hash(tmp_path / "handoff")
    env = case.env(ws) if case.env else {}
    if case.fresh or case.mounts:
        code, out, err = _in_new_process(case, ws, ["flows.train_and_export", "--config", str(ws.config), *case.args], env)
    else:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        code = main(["--config", str(ws.config), *case.args])
        out, err = capfd.readouterr()
    _judge(case, code, out, err, "train-and-export", ws)
    assert tree_hash(tmp_path / "handoff") == handoff, "the hand-off directory changed"
    assert not list((tmp_path / "artifacts").glob("runs/*/train/adapter")), "an adapter was trained"
    RESULTS[case.category] += 1


BEFORE_TRAINING = [c for c in CASES if c.before_training]


@pytest.mark.parametrize("case", BEFORE_TRAINING, ids=[c.name for c in BEFORE_TRAINING])
def test_the_preflight_alone_refuses_it(case, tmp_path):
    """What the preflight's own checks find, `python -m stages.preflight` refuses on its own, by the same rules."""
    TRIED["preflight alone"] += 1
    ws = Workspace(tmp_path)
    case.setup(ws)
    if ws.sections is not None:
        ws.write()
    args = list(case.args)
    if "--run-id" in args:  # the preflight of that run: its directory holds what the case broke
        run_id = args.pop(args.index("--run-id") + 1)
        args[args.index("--run-id")] = "--out"
        args.insert(args.index("--out") + 1, str(tmp_path / "artifacts" / "runs" / run_id / "preflight"))
    code, out, err = _in_new_process(case, ws, ["stages.preflight", "--config", str(ws.config), *args], case.env(ws) if case.env else {})
    _judge(case, code, out, err, "preflight", ws)
    assert not list((tmp_path / "artifacts").glob("runs/*/train/adapter")), "an adapter was trained"
    RESULTS["preflight alone"] += 1


def _judge(case: Case, code: int, out: str, err: str, prog: str, ws: Workspace) -> None:
    """Rules 1-4: exit 2, one `stopped:` line, no traceback, the input named (and no wrong diagnosis), a fix said."""
    stopped = [line for line in err.splitlines() if line.startswith(f"{prog} stopped: ")]
    assert code == 2, (code, (out + err)[-3000:])
    assert len(stopped) == 1 and "Traceback" not in out + err, (out + err)[-3000:]
    message = err[err.index(stopped[0]):]
    names = case.names(ws) if callable(case.names) else case.names
    assert names.lower() in message.lower(), f"the message does not name {names!r}: {message}"
    assert not case.absent or case.absent.lower() not in message.lower(), f"the message also says {case.absent!r}: {message}"
    assert any(w in message.lower() for w in FIX_WORDS), f"the message says no fix: {message}"


def _in_new_process(case: Case, ws: Workspace, argv: list[str], env: dict) -> tuple[int, str, str]:
    """`python -m <argv>` as a user runs it, with `env`, and with the case's filesystems mounted for that process
    alone (a user and mount namespace: no privileges needed, nothing visible outside)."""
    cmd = [sys.executable, "-m", *argv]
    if case.mounts:
        if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
            pytest.skip("needs unshare -rm (user and mount namespaces) to mount a filesystem for one process")
        script = " && ".join([*case.mounts(ws), 'exec "$@"'])
        cmd = ["unshare", "-rm", "sh", "-c", script, "sh", *cmd]
    p = subprocess.run(cmd, cwd=ws.tmp, env=_isolated_env(ws.tmp) | env, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


ACCEPTED = {
    "UTF-8 with a byte-order mark": lambda text: codecs.BOM_UTF8 + text.encode(),
    "UTF-16 LE with a byte-order mark (Windows redirect)": lambda text: text.encode("utf-16"),
    "UTF-16 BE with a byte-order mark": lambda text: codecs.BOM_UTF16_BE + text.encode("utf-16-be"),
    "gzip, .jsonl name": lambda text: gzip.compress(text.encode()),
    "CRLF line ends": lambda text: text.replace("\n", "\r\n").encode(),
    "trailing blank lines": lambda text: (text + "\n\n\n").encode(),
}


@pytest.mark.parametrize("form", sorted(ACCEPTED))
def test_accepted_as_the_plain_file(form, tmp_path):
    from stages import data

    TRIED["data (accepted)"] += 1
    rows = [GOOD, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Translate: vert", "name": "ana"},
                                {"role": "assistant", "content": "vert é"}]}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    plain, other = tmp_path / "plain.jsonl", tmp_path / "other.jsonl"
    plain.write_text(text, encoding="utf-8")
    other.write_bytes(ACCEPTED[form](text))
    assert [s.messages for s in data.read_jsonl(other)] == [s.messages for s in data.read_jsonl(plain)]
    RESULTS["data (accepted)"] += 1


def test_special_token_text_trains_as_plain_text(tmp_path):
    """data.special_tokens_in_content: plain: the pasted answer's `<|im_end|>` and `<|im_start|>` are plain text, so the
    loss covers the answer's own text and the one end-of-turn token the template writes after it, and the input holds
    the template's control tokens only; the preflight names the sample."""
    from stages import data, preflight
    from stages.config import load_config
    from stages.model.load import load_tokenizer

    TRIED["data (accepted)"] += 1
    ws = Workspace(tmp_path)
    _chatml(ws)
    with ws.train.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "Translate to French: red cat"},
                                         {"role": "assistant", "content": PASTED}]}) + "\n")
    line = len(ws.train.read_text().splitlines())
    ws.set("data", special_tokens_in_content="plain")
    cfg = load_config(ws.write())
    result = preflight.run(cfg, tmp_path / "pre")
    assert result.fits and any(f"translate_train.jsonl:{line})" in n and "encoded as plain text" in n for n in result.data_notes)
    tok = load_tokenizer(cfg.model)
    rows = data.training_set(cfg, tok).rows
    row = rows[len(rows) - 1]
    assert row["id"].endswith(f"translate_train.jsonl:{line}")
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    answer = [i for i in row["labels"] if i != -100]
    assert tok.decode(answer) == PASTED + "<|im_end|>\n"
    assert [i for i in answer if i in (start, end)] == [end]  # the template's end of the turn, and no other
    assert row["input_ids"].count(start) == row["input_ids"].count(end) == 3  # the system, user and assistant turns
    RESULTS["data (accepted)"] += 1


def test_named_chat_templates_train_and_serve_the_default(tmp_path):
    """chat_template as a list of named templates, read as transformers reads it: `default` renders the training data
    (the loss covers the answer and its end of turn, not the header) and is the GGUF's tokenizer.chat_template, the
    other is in the GGUF under its name, and the preflight's comparison of the two tokenizers passes."""
    from stages import data, preflight
    from stages.config import load_config
    from stages.export import llamacpp, vocab
    from stages.model.load import load_tokenizer

    TRIED["model (accepted)"] += 1
    ws = Workspace(tmp_path)
    _named_templates(ws, "default", "tool_use")
    cfg = load_config(ws.write())
    assert preflight.run(cfg, tmp_path / "pre").fits
    tok = load_tokenizer(cfg.model)
    assert tok.chat_template == "{# default #}" + _chatml_template()
    first, row = data.read_jsonl(ws.train)[0], data.training_set(cfg, tok).rows[0]
    assert row["id"] == first.id and tok.decode([i for i in row["labels"] if i != -100]) == first.answer + "<|im_end|>\n"
    fields = llamacpp.read_gguf(vocab.start(ws.model, llamacpp.converter_dir()).wait())["fields"]
    assert fields["tokenizer.chat_template"] == tok.chat_template
    assert fields["tokenizer.chat_template.tool_use"] == "{# tool_use #}" + _chatml_template()
    RESULTS["model (accepted)"] += 1


def test_gzip_with_gz_suffix_and_openai_names_train(tmp_path, capfd, prefect_harness):
    """A .jsonl.gz with OpenAI `name` fields goes through preflight like the plain file."""
    from stages import preflight
    from stages.config import load_config

    TRIED["data (accepted)"] += 1
    ws = Workspace(tmp_path)
    gz = ws.data / "train.jsonl.gz"
    lines = [json.loads(x) for x in ws.train.read_text().splitlines()[:200]]
    for row in lines:
        for m in row.get("messages", []):
            m["name"] = "someone"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in lines).encode()))
    ws.set("data", train_file=str(gz))
    result = preflight.run(load_config(ws.write()), tmp_path / "pre")
    assert result.fits and result.lengths.n_samples == 200
    RESULTS["data (accepted)"] += 1


def test_full_disk_during_export_leaves_nothing_partial(tmp_path, capfd, prefect_harness, monkeypatch):
    """ENOSPC while a quantized file is written: one message naming the disk, no *.partial left, nothing published."""
    from flows.train_and_export import main

    TRIED["faults"] += 1
    ws = Workspace(tmp_path)
    ws.set("smoke", min_accuracy=0.0, max_prompts=5)
    ws.write()
    handoff = tree_hash(tmp_path / "handoff")
    monkeypatch.setenv("TAE_INJECT", "export-quantize")
    code = main(["--config", str(ws.config), "--run-id", "full"])
    out, err = capfd.readouterr()
    assert code == 2 and "Traceback" not in out + err, err[-3000:]
    assert re.search(r"stopped: DiskFull: no space left on the filesystem mounted at /\S* \(\d+\.\d+ [GM]iB free of .*\) "
                     r"while writing .*model-Q4_K_M\.gguf\.partial; free", err), err[-2000:]
    assert not list((tmp_path / "artifacts").rglob("*.partial"))
    assert tree_hash(tmp_path / "handoff") == handoff
    # the disk freed, the same run id resumes: training is not redone, and it publishes
    monkeypatch.delenv("TAE_INJECT")
    assert main(["--config", str(ws.config), "--run-id", "full"]) == 0
    bundle = tmp_path / "handoff" / "tiny-llama-translate" / "full"
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=bundle, check=True, capture_output=True)
    RESULTS["faults"] += 1


def test_a_run_id_in_use_is_refused_at_once(tmp_path, capfd, prefect_harness):
    from flows.train_and_export import main
    from stages.config import load_config
    from stages.paths import RunPaths

    TRIED["faults"] += 1
    ws = Workspace(tmp_path)
    paths = RunPaths.for_run(load_config(ws.write()), "busy")
    with paths.lock():
        code = main(["--config", str(ws.config), "--run-id", "busy"])
    err = capfd.readouterr().err
    assert code == 2 and re.search(r"stopped: RunError: run busy is in use by pid \d+ since .*another --run-id", err), err[-2000:]
    RESULTS["faults"] += 1


def test_after_the_artifacts_are_deleted_a_rerun_runs_again(tmp_path, capfd, prefect_harness):
    """Prefect's cached stage results are used only while the stage's files are there."""
    from flows.train_and_export import main

    TRIED["faults"] += 1
    ws = Workspace(tmp_path)
    ws.set("smoke", min_accuracy=0.0, max_prompts=5)
    ws.write()
    (tmp_path / "handoff" / "tiny-llama-translate" / "latest").unlink()
    shutil.rmtree(tmp_path / "handoff")
    assert main(["--config", str(ws.config), "--run-id", "again", "--set", "handoff.model_name=first"]) == 0
    shutil.rmtree(tmp_path / "artifacts")
    assert main(["--config", str(ws.config), "--run-id", "again", "--set", "handoff.model_name=second"]) == 0, capfd.readouterr().err[-3000:]
    assert (tmp_path / "handoff" / "second" / "again" / "SHA256SUMS").is_file()
    RESULTS["faults"] += 1


def test_killed_flow_leaves_no_process_and_ctrl_c_says_how_to_resume(tmp_path):
    """kill -9 of the flow process: its temporary API server goes too. Ctrl-C: exit 130 within seconds, one
    line naming the command that resumes, no traceback."""
    import signal
    import time

    import psutil

    TRIED["faults"] += 2
    ws = Workspace(tmp_path)
    ws.set("training", max_steps=100000, save_steps=1000)
    ws.write()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(seeded_prefect_home(tmp_path / "prefect")), "TAE_GPU_LOCK": str(tmp_path / "gpu.lock")}

    def start():
        # SIGINT as a terminal's foreground command has it: a suite started in the background (`pytest &`) hands its
        # children SIGINT ignored, and the Ctrl-C below would then never end the run
        p = subprocess.Popen([sys.executable, "-m", "flows.train_and_export", "--config", str(ws.config)], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        seen = []
        for line in p.stdout:
            seen.append(line)
            if "train: " in line:
                return p, seen
        raise AssertionError("".join(seen)[-3000:])

    p, _ = start()
    kids = [k for k in psutil.Process(p.pid).children(recursive=True) if "uvicorn" in " ".join(k.cmdline())]
    assert kids, "no temporary API server seen"
    p.kill()
    p.wait()
    gone = psutil.wait_procs(kids, timeout=15)[1] == []
    assert gone, [k.cmdline() for k in kids if k.is_running()]
    RESULTS["faults"] += 1

    p, _ = start()
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    rest = p.stdout.read()
    p.wait()
    assert p.returncode == 130 and time.monotonic() - t0 < 30, (p.returncode, rest[-2000:])
    assert "Traceback" not in rest and re.search(r"interrupted\. Nothing was published; to resume: python -m flows\.train_and_export .*--run-id \S+", rest)
    RESULTS["faults"] += 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> bytes:
    """The adapter of an uninterrupted run of the kill tests' config: its train stage alone (the adapter is that
    stage's output; the flow's other stages would only cost the suite time)."""
    tmp = tmp_path_factory.mktemp("straight")
    ws = _kill_workspace(tmp)
    p = subprocess.run([sys.executable, "-m", "stages.train", "--config", str(ws.config), "--out", str(tmp / "train")],
                       cwd=tmp, env=_isolated_env(tmp), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return (tmp / "train" / "adapter" / "adapter_model.safetensors").read_bytes()


def _kill_workspace(tmp: Path) -> Workspace:
    ws = Workspace(tmp)
    ws.set("training", max_steps=10, save_steps=5)
    ws.set("smoke", min_accuracy=0.0, max_prompts=5)
    ws.set("export", imatrix="off")  # the faults here are the process's, not the quantization's: one file per type
    ws.write()
    return ws


def _isolated_env(tmp: Path) -> dict:
    """A user's shell: no Prefect server, no test hooks, this test's own Prefect home (its database already
    migrated, as a user's earlier runs leave it) and GPU lock."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TAE_INJECT"))} | {
        "PREFECT_HOME": str(seeded_prefect_home(tmp / "prefect")), "TAE_GPU_LOCK": str(tmp / "gpu.lock")}


@pytest.mark.parametrize("point", ["train", "export-quantize", "handoff-copy"])
def test_kill_9_then_the_same_run_id_publishes_a_verified_bundle(point, tmp_path, uninterrupted):
    """The flow process killed outright in training, in the middle of a quantization and halfway through
    copying the bundle; the rerun with the same --run-id resumes, publishes a bundle that passes
    `sha256sum -c`, leaves no partial file or hidden temp dir, and trains the same adapter as an
    uninterrupted run (training resumes from its checkpoint, the rest from the stage outputs)."""
    import signal
    import time

    TRIED["faults"] += 1
    ws = _kill_workspace(tmp_path)
    env = _isolated_env(tmp_path)
    cmd = [sys.executable, "-m", "flows.train_and_export", "--config", str(ws.config), "--run-id"]

    def run(run_id: str, inject: str | None = None, kill_on: str | None = None) -> subprocess.CompletedProcess | int:
        if kill_on is None:
            return subprocess.run([*cmd, run_id], cwd=tmp_path, env=env | ({"TAE_INJECT": inject} if inject else {}),
                                  capture_output=True, text=True, timeout=600)
        p = subprocess.Popen([*cmd, run_id], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        marker = tmp_path / "artifacts" / "runs" / run_id / kill_on
        while not marker.exists() and p.poll() is None:  # killed once training wrote its first checkpoint
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        return p.wait()

    if point == "train":
        assert run("k", kill_on="train/checkpoints/checkpoint-5/trainer_state.json") == -signal.SIGKILL
    else:
        assert run("k", inject=f"{point}:kill").returncode == -signal.SIGKILL
    again = run("k")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    bundle = tmp_path / "handoff" / "tiny-llama-translate" / "k"
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=bundle, check=True, capture_output=True)
    assert not list((tmp_path / "artifacts").rglob("*.partial")) and not list(bundle.parent.glob(".k.*"))
    assert (tmp_path / "artifacts" / "runs" / "k" / "train" / "adapter" / "adapter_model.safetensors").read_bytes() == uninterrupted
    RESULTS["faults"] += 1


ENTRY_POINTS = [
    ("stages.preflight", ["--config", "{config}"], lambda ws: ws.lines(GOOD, '{"prompt": "a"'), "translate_train.jsonl:2"),
    ("stages.train", ["--config", "{config}", "--set", "training.max_stesp=3"], lambda ws: None, "training.max_stesp"),
    ("stages.merge", ["--config", "{config}", "--adapter", "{tmp}/nowhere", "--out", "{tmp}/m"], lambda ws: None, "nowhere"),
    ("stages.export", ["--config", "{config}", "--merged", "{tmp}/nothing", "--out", "{tmp}/e"], lambda ws: None, "nothing"),
    ("stages.smoke", ["--config", "{config}", "--gguf", "{tmp}/x.gguf", "--out", "{tmp}/s"], lambda ws: None, "x.gguf"),
    ("stages.smoke", ["--config", "{config}", "--gguf", "{tmp}/y.gguf", "--out", "{tmp}/s"],
     lambda ws: ((ws.tmp / "y.gguf").write_bytes(b"GGUF"), ws.set("smoke", n_ctx=20)), "smoke.n_ctx"),
    ("flows.deploy", ["notify", "--config", "{config}"], lambda ws: None, "PREFECT_API_URL"),
]


@pytest.mark.parametrize("module,args,setup,names", ENTRY_POINTS, ids=[f"{e[0]}: {e[3]}" for e in ENTRY_POINTS])
def test_every_entry_point_has_the_same_boundary(module, args, setup, names, tmp_path):
    """Each stage's CLI and flows.deploy, started as users start them: exit 2, one line, no traceback."""
    TRIED["entry points"] += 1
    ws = Workspace(tmp_path)
    setup(ws)
    ws.write()
    argv = [a.format(config=ws.config, tmp=tmp_path) for a in args]
    p = subprocess.run([sys.executable, "-m", module, *argv], cwd=tmp_path, env=_isolated_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    stopped = [line for line in p.stderr.splitlines() if " stopped: " in line]
    assert p.returncode == 2 and len(stopped) == 1 and "Traceback" not in p.stdout + p.stderr, (p.returncode, p.stderr[-2000:])
    assert names.lower() in p.stderr[p.stderr.index(stopped[0]):].lower(), p.stderr[-2000:]
    RESULTS["entry points"] += 1


def _champion_and_challenger(tmp_path: Path, damage) -> tuple:
    """A champion published by the hand-off, damaged by `damage(bundle)`, then a challenger judged far worse on the
    same held-out data: the hand-off as the flow calls it."""
    from stages.config import load_config
    from tests.conftest import write_config
    from tests.test_handoff import _judged

    cfg = load_config(write_config(tmp_path))
    first = _judged(cfg, "v1", tmp_path, 1.0, 0.010, 1.00)
    damage(first.bundle_dir)
    root = first.bundle_dir.parent
    before = {p.name for p in root.iterdir()}
    return _judged(cfg, "v2", tmp_path, 0.0, 0.500, 9.00), root, before


def _rewrite(path: Path, change) -> None:
    path.chmod(0o644)
    path.write_bytes(change(path.read_bytes()))


DAMAGED_CHAMPIONS = {
    "a GGUF that no longer matches SHA256SUMS": (lambda b: _rewrite(b / "model-Q4_K_M-v1.gguf", lambda x: x[:-4] + b"XXXX"),
                                                "model-Q4_K_M-v1.gguf does not match its SHA256SUMS"),
    "a forged manifest": (lambda b: _rewrite(b / "manifest.json", lambda x: x.replace(b'"accuracy": 1.0', b'"accuracy": 9.0')),
                          "manifest.json does not match its SHA256SUMS"),
    "a manifest that is not JSON": (lambda b: _rewrite(b / "manifest.json", lambda x: x[: len(x) // 2]),
                                    "manifest.json does not match its SHA256SUMS"),
    "a manifest of another schema, re-summed": (lambda b: (_rewrite(b / "manifest.json", lambda x: b'{"smoke": "all good"}'),
                                                           _resum(b)), "manifest.json is not a bundle manifest: smoke"),
    "no SHA256SUMS": (lambda b: (b / "SHA256SUMS").unlink(), "it has no SHA256SUMS"),
    "latest pointing at nothing": (lambda b: shutil.rmtree(b), "`latest` points at `v1`, which does not exist"),
}


def _resum(bundle: Path) -> None:
    from stages import checksums

    listed, _ = checksums.read(bundle)
    sums = bundle / "SHA256SUMS"
    sums.chmod(0o644)
    sums.write_text(checksums.render({n: checksums.sha256_file(bundle / n) for n in listed}))


@pytest.mark.parametrize("kind", sorted(DAMAGED_CHAMPIONS))
def test_a_damaged_champion_is_named_and_treated_as_absent(kind, tmp_path, capfd):
    """The bundle `latest` points at judges a retrain only if its files still match SHA256SUMS and its manifest holds
    the figures; otherwise the comparison names what is wrong, the retrain is promoted (a damaged bundle cannot be the
    bar), and the damaged one is left as it is for inspection."""
    TRIED["champion"] += 1
    damage, said = DAMAGED_CHAMPIONS[kind]
    result, root, before = _champion_and_challenger(tmp_path, damage)
    assert result.promoted and (root / "latest").resolve().name == "v2"
    assert said in result.comparison and "treated as absent and not compared" in result.comparison, result.comparison
    assert (result.bundle_dir / "comparison.md").read_text() == result.comparison
    assert {p.name for p in root.iterdir()} == before | {"v2"}, "a stray file beside the versions"
    assert "Traceback" not in "".join(capfd.readouterr())
    RESULTS["champion"] += 1


def test_an_unreadable_manifest_does_not_stop_the_retrain_check(tmp_path):
    """flows.deploy's "did the data change?" reads the manifest `latest` points at: one that is not JSON means
    "unknown", so the data is retrained on (and the hand-off then names the damaged bundle), not a traceback."""
    from flows.deploy import last_published_fingerprint
    from stages.config import load_config
    from tests.conftest import write_config
    from tests.test_handoff import _judged

    TRIED["champion"] += 1
    cfg = load_config(write_config(tmp_path))
    first = _judged(cfg, "v1", tmp_path, 1.0, 0.010, 1.00)
    assert last_published_fingerprint(cfg) == "f" * 64
    _rewrite(first.bundle_dir / "manifest.json", lambda x: b"{not json")
    assert last_published_fingerprint(cfg) is None
    RESULTS["champion"] += 1


def test_an_override_inside_a_threshold_map_changes_that_entry_only(tmp_path):
    """--set export.fidelity.max_mean_kl.Q5_K_S=0.05 tightens Q5_K_S and leaves f16's gate at 0.01 (it once replaced
    the map, and f16 fell to `default`, 0.1)."""
    from stages.config import load_config
    from tests.conftest import write_config

    TRIED["config (accepted)"] += 1
    path = write_config(tmp_path)
    cfg = load_config(path, ["export.fidelity.max_mean_kl.Q5_K_S=0.05", "export.fidelity.min_top1.Q4_K_M=0.5"])
    fid = cfg.export.fidelity
    assert fid.thresholds("Q5_K_S") == (0.05, 0.80) and fid.thresholds("f16") == (0.01, 0.99) and fid.thresholds("Q4_K_M") == (0.10, 0.5)
    assert fid.thresholds("bf16") == (0.01, 0.99)  # not in the YAML's partial map: the default entry, not `default`
    RESULTS["config (accepted)"] += 1


def test_a_full_disk_whose_write_names_no_file_names_the_stage_s_filesystem(tmp_path):
    """artifacts_dir on a small filesystem of its own, filling while a library writes without naming its file (the
    merged model's save): the message names that filesystem and the stage directory on it, not the one the command
    was started from; nothing is published."""
    TRIED["faults"] += 1
    ws = Workspace(tmp_path)
    ws.set("smoke", min_accuracy=0.0, max_prompts=5)
    _on_tmpfs(ws, "artifacts_dir")
    ws.write()
    handoff = tree_hash(tmp_path / "handoff")
    case = Case("faults", "full disk", lambda ws: None, "", mounts=lambda ws: _tmpfs(ws, "artifacts_dir", "64m"))
    code, out, err = _in_new_process(case, ws, ["flows.train_and_export", "--config", str(ws.config), "--run-id", "full"],
                                     {"TAE_INJECT": "merge-save"})
    assert code == 2 and "Traceback" not in out + err, err[-3000:]
    where = tmp_path / "small-artifacts_dir"
    assert re.search(rf"stopped: DiskFull: no space left on the filesystem mounted at {where} \(.*\) while writing "
                     rf"{where}/runs/full/merge; free", err), err[-2000:]
    assert tree_hash(tmp_path / "handoff") == handoff
    RESULTS["faults"] += 1
