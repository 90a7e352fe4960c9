"""The tokenizer as llama.cpp will serve it, against the HF tokenizer that training uses.

A served GGUF tokenizes prompts with llama.cpp's tokenizer, which the converter builds from the model's files by its
own rules (tokenizer.model before tokenizer.json for SentencePiece families, its table of BPE pre-tokenizers, the
architecture's space prefix). Where the two disagree the served model sees prompts it was never trained on, or never
stops. So the two are compared twice:

- before training (the preflight): the converter writes a vocabulary-only GGUF from the base model's own directory
  (`start`: metadata, no tensors, ~6 s; cached by the files' content under $TAE_CACHE_DIR/vocab), which also proves
  the converter supports the architecture and can read the tokenizer;
- after export, on the real GGUF, the same checks (stages/export/stage.py).

Checked: vocabulary size, BOS/EOS ids and the chat template (`check_metadata`), and the ids of the same texts
(`check_tokenization`), with the direction of a word-start space or a tokenizer that splits text far finer than
llama.cpp said as such.

One tokenizer property a GGUF cannot carry: whether an added token strips the whitespace after it (`rstrip`). Phi-3's
releases make their chat tokens do so ("<|user|>\n" is the token alone); llama.cpp does the same only for a GGUF whose
`general.name` contains "phi3" or "phi-3" (src/llama-vocab.cpp), and the converter names a Phi-3 directory "Phi 3 Mini
4k Instruct". `served_name` gives the name the GGUFs are written with (handoff.model_name, with " (Phi-3)" where the
tokenizer needs that rule), and the preflight's vocabulary is converted under the same name.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stages.errors import UserError
from stages.export import convert, llamacpp
from stages.export.llamacpp_process import LlamaProcess

CONVERT_TIMEOUT_S = 300
# HF tokens per llama.cpp token over the compared texts from which the HF tokenizer is said to split far finer (a
# tokenizer.json that is not the one the model was trained with: every sample several times longer).
FINER = 1.5
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


class TokenizerMismatch(UserError, ValueError):
    """llama.cpp would tokenize or stop differently from the HF tokenizer the model trains with."""


@dataclass
class VocabJob:
    """The converter writing a vocabulary-only GGUF of a model directory (or the cached one)."""

    model_dir: Path
    path: Path
    proc: subprocess.Popen | None = None
    partial: Path | None = None  # where the converter writes; renamed to `path` once whole (two runs may convert at once)

    def wait(self, timeout: float = CONVERT_TIMEOUT_S) -> Path:
        """The GGUF's path; a UserError naming the user's file when the converter refuses it."""
        if self.proc is None:
            return self.path
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TokenizerMismatch(f"llama.cpp's converter did not write the vocabulary of {self.model_dir} within {timeout:.0f} s; "
                                    "run it by hand to see why (convert_hf_to_gguf.py --vocab-only), or free the machine") from None
        partial = self.partial
        if self.proc.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            lines = [line for line in (out or "").splitlines() if line.strip()]
            raise convert.refusal(out or "", self.model_dir) or TokenizerMismatch(
                f"llama.cpp's converter cannot convert {self.model_dir} (exit {self.proc.returncode}: "
                f"{lines[-1].strip()[:300] if lines else 'no output'}); nothing could be exported after training. Give the model "
                "directory its release's config.json and tokenizer files, or set the model to one the converter supports")
        partial.with_suffix(".names.json").unlink(missing_ok=True)
        partial.rename(self.path)
        return self.path

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        if self.partial is not None:
            self.partial.unlink(missing_ok=True)
            self.partial.with_suffix(".names.json").unlink(missing_ok=True)


def start(model_dir: Path, converter: Path, name: str | None = None) -> VocabJob:
    """Start convert_hf_to_gguf.py --vocab-only on `model_dir` (nothing to run when its vocabulary is cached); `name`: the
    general.name the exported GGUFs will have (`served_name`), which decides how llama.cpp reads some vocabularies."""
    model_dir = Path(model_dir)
    cache = llamacpp.CACHE / "vocab"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{_key(model_dir, converter, name)}.gguf"
    if path.is_file():
        return VocabJob(model_dir, path)
    partial = cache / f"{path.stem}.{os.getpid()}.{secrets.token_hex(3)}.partial"
    options = ["--vocab-only"]
    if name is not None:
        meta = partial.with_suffix(".names.json")
        meta.write_text(json.dumps({"general.name": name}))
        options += ["--metadata", str(meta)]
    cmd, env, _pre = convert.command(converter, model_dir, partial, *options)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return VocabJob(model_dir, path, proc, partial)


def _key(model_dir: Path, converter: Path, name: str | None = None) -> str:
    """What the converter's vocabulary depends on: every non-weight file's bytes, the weights' names and sizes, the
    converter itself, and the name the GGUF is given."""
    h = hashlib.sha256((converter / "VERSION").read_bytes() if (converter / "VERSION").is_file() else str(converter).encode())
    h.update(Path(convert.__file__).read_bytes())  # the pre-tokenizer launcher decides names too
    if name is not None:
        h.update(b"general.name\0" + name.encode())
    for f in sorted(p for p in model_dir.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0")
        h.update(str(f.stat().st_size).encode() if f.name.endswith(WEIGHT_SUFFIXES) else f.read_bytes())
    return h.hexdigest()[:32]


# llama.cpp reads no per-token attributes from a GGUF: it makes every special token of a vocabulary but these three
# strip the whitespace after it, and "</s>" too, where general.name contains one of PHI3_NAMES (src/llama-vocab.cpp)
PHI3_NAMES = ("phi-3", "phi3")
PHI3_KEEPS_SPACE = ("<unk>", "<s>", "<|endoftext|>")


def phi3_rule(tokenizer) -> tuple[bool, list[str]]:
    """(the HF tokenizer's added tokens strip the whitespace after them exactly as llama.cpp's Phi-3 rule makes them,
    the added tokens that rule would make strip where the HF tokenizer keeps the whitespace)."""
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    rule = {a.content: a.content not in PHI3_KEEPS_SPACE for a in added}
    hf = {a.content: bool(a.rstrip) for a in added}
    return hf == rule and any(hf.values()), [t for t in rule if rule[t] and not hf[t]]


def served_name(model_name: str, tokenizer, model_dir: Path) -> str:
    """The general.name the GGUFs of `model_name` are written with: the name itself, with " (Phi-3)" where the HF
    tokenizer strips whitespace after its special tokens as Phi-3's does (llama.cpp does so only under such a name). A
    name that would make llama.cpp strip where the tokenizer does not is refused: every served prompt would differ."""
    needs, would_differ = phi3_rule(tokenizer)
    named = next((k for k in PHI3_NAMES if k in model_name.lower()), None)
    if needs and not named:
        return f"{model_name} (Phi-3)"
    if named and not needs and would_differ:
        raise TokenizerMismatch(
            f"handoff.model_name {model_name!r} contains {named!r}: llama.cpp makes the special tokens of a GGUF so named strip "
            f"the whitespace after them (its Phi-3 rule), and the tokenizer of {model_dir} keeps it after "
            f"{', '.join(would_differ[:4])}: every served prompt would differ from the training ones. Choose a "
            f"handoff.model_name without {' or '.join(map(repr, PHI3_NAMES))}")
    return model_name


def check_metadata(info: dict, tokenizer, model_vocab: int | None, what: str, model_dir: Path) -> dict:
    """Vocabulary, special ids and chat template of a GGUF (`what` names it) as the HF tokenizer has them.

    The converter pads the GGUF vocabulary to the model's embedding rows (Qwen2-7B: 151,646 tokens, 152,064 rows), so
    either size is right; anything else is not."""
    f = info["fields"]
    got = {
        "vocab_size": f.get("tokenizer.ggml.tokens", {}).get("array_len"),
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
        "chat_template": f.get("tokenizer.chat_template"),
    }
    want = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "chat_template": tokenizer.chat_template,
    }
    if model_vocab and got["vocab_size"] == model_vocab:
        want["vocab_size"] = model_vocab
    bad = {k: (got[k], want[k]) for k in want if want[k] is not None and got[k] != want[k]}
    if bad:
        raise TokenizerMismatch(
            f"{what}: llama.cpp reads the tokenizer of {model_dir} otherwise than the HF tokenizer does: " + "; ".join(
                f"{k} gguf {str(g)[:80]!r} vs hf {str(w)[:80]!r}" for k, (g, w) in bad.items())
            + f"; {_metadata_fix(bad, tokenizer, model_dir)}")
    return {k: v for k, v in got.items() if k != "chat_template"} | {"chat_template_equal": True}


def _metadata_fix(bad: dict, tokenizer, model_dir: Path) -> str:
    if "bos_token_id" in bad or "eos_token_id" in bad:
        return (f"make config.json's bos_token_id / eos_token_id and the \"bos_token\" / \"eos_token\" of "
                f"{model_dir / 'tokenizer_config.json'} name the same tokens (the converter takes them from both)")
    if "chat_template" in bad:
        return (f"keep the chat template in one place ({model_dir / 'tokenizer_config.json'} or chat_template.jinja, not two "
                "different ones)")
    return f"give {model_dir} the tokenizer files the model was released with (one tokenizer.json or tokenizer.model, not a mix)"


def check_tokenization(gguf_path: Path, tokenizer, texts: list[str], what: str, model_dir: Path) -> dict:
    """llama.cpp's ids for `texts` must be the HF tokenizer's, text for text.

    A mismatch (typically a word-start space llama.cpp puts after special tokens that the HF tokenizer does not) makes
    every served prompt slightly foreign to the model; a tokenizer.json that splits characters apart makes every
    training sample several times longer than the model was trained on."""
    with LlamaProcess(gguf_path.name) as vocab:
        try:
            vocab.call("load", str(gguf_path), vocab_only=True)
        except ValueError as e:   # llama.cpp logged its reason (TAE_LLAMA_VERBOSE=1 keeps the log) and returned no model
            raise TokenizerMismatch(
                f"{what}: llama.cpp cannot load the vocabulary its converter writes from the tokenizer files of {model_dir} "
                f"({e}); no export of this model would run. "
                f"Give {model_dir} the tokenizer files the model was released with (set TAE_LLAMA_VERBOSE=1 to see llama.cpp's "
                "reason)") from None
        ours = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        theirs = vocab.call("tokenize", texts)
        n_hf, n_gguf = sum(map(len, ours)), sum(map(len, theirs))
        if n_gguf and n_hf >= FINER * n_gguf:
            text = next(t for t, a, b in zip(texts, ours, theirs, strict=True) if len(a) > len(b))
            raise TokenizerMismatch(
                f"{what}: the HF tokenizer of {model_dir} splits text into {n_hf / n_gguf:.1f}x as many tokens as llama.cpp does "
                f"({n_hf} vs {n_gguf} over {len(texts)} texts; e.g. {text[:40]!r}: hf {tokenizer.convert_ids_to_tokens(_first(ours, theirs))} "
                f"vs gguf {vocab.call('pieces', _first(theirs, ours))}): the files HF loads are not the tokenizer llama.cpp reads "
                f"(a tokenizer.json beside a tokenizer.model that disagree?); give {model_dir} the tokenizer files the model was "
                "released with")
        for text, hf, gg in zip(texts, ours, theirs, strict=True):
            if hf != gg:
                i = next((k for k, (a, b) in enumerate(zip(hf, gg, strict=False)) if a != b), min(len(hf), len(gg)))
                hf_pieces, gg_pieces = tokenizer.convert_ids_to_tokens(hf[i:i + 3]), vocab.call("pieces", gg[i:i + 3])
                raise TokenizerMismatch(
                    f"{what} tokenizes differently from the HF tokenizer of {model_dir} at token {i} of {text[:60]!r}: "
                    f"hf {hf_pieces} vs gguf {gg_pieces}; {space_fix(hf_pieces, gg_pieces, tokenizer, model_dir)}")
    return {"texts_compared": len(texts), "identical": True}


def _first(rows: list[list[int]], other: list[list[int]]) -> list[int]:
    """The first 6 ids of the first row that differs from its counterpart (the pieces a message shows)."""
    return next((a for a, b in zip(rows, other, strict=True) if a != b), rows[0])[:6]


def space_fix(hf_pieces: list[str], gguf_pieces: list[str], tokenizer=None, model_dir: Path | None = None) -> str:
    """The fix for a SentencePiece word-start space ("▁") that one side puts after a special token and the other does
    not. llama.cpp follows the GGUF's add_space_prefix, which the converter sets per architecture (on for Llama, off
    for Gemma); the HF tokenizer follows `legacy`, so the fix is on the HF side, in the direction llama.cpp goes, and
    only where `legacy` is not set that way already (a byte-level BPE tokenizer has no such switch)."""
    config = f"{model_dir / 'tokenizer_config.json'}" if model_dir else "the model's tokenizer_config.json"
    sentencepiece = not any(p.startswith("Ġ") for p in hf_pieces)  # a byte-level BPE marks spaces with Ġ, and has no `legacy`
    hf_space = bool(hf_pieces) and hf_pieces[0].startswith("▁")
    gguf_space = bool(gguf_pieces) and gguf_pieces[0].startswith(("▁", " "))
    if tokenizer is not None and not hasattr(tokenizer, "legacy") and sentencepiece and hf_space != gguf_space:
        # transformers built this tokenizer from tokenizer.model with a generic class (e.g. TokenizersBackend for
        # model_type mistral / phi3 without a tokenizer.json): it never reads `legacy`, so that switch is no fix
        return (f"{type(tokenizer).__name__}, the class transformers picks for this model_type, does not read \"legacy\": "
                f"give {model_dir or 'the model directory'} the tokenizer.json the model was released with, beside tokenizer.model")
    legacy = getattr(tokenizer, "legacy", None)
    if sentencepiece and gguf_space and not hf_space and legacy is not True:
        return f"llama.cpp puts a word-start space after special tokens and the HF tokenizer does not: set \"legacy\": true in {config}"
    if sentencepiece and hf_space and not gguf_space and legacy is not False:
        return ("the HF tokenizer puts a word-start space after special tokens and llama.cpp does not (this architecture's "
                f"GGUF has no space prefix): set \"legacy\": false in {config}")
    return (f"the two tokenizers split this text differently: give {model_dir or 'the model directory'} the tokenizer files the model "
            "was released with (tokenizer.json / tokenizer.model beside config.json)")
