"""Released tokenizers for the suite, rebuilt from llama.cpp's own test vocabularies.

The llama-cpp-python sdist that scripts/install.sh caches ($TAE_CACHE_DIR/llama_cpp_python-<version>.tar.gz, on every
machine, CI included) ships `vendor/llama.cpp/models/ggml-vocab-<name>.gguf`: a release's whole vocabulary (tokens,
merges or scores, token types, special ids, often its chat template), with `.inp` test strings and the ids llama.cpp
gives them (`.out`). `build(name)` turns one into an HF model directory's tokenizer files as that release ships them
(tokenizer.json, tokenizer.model for SentencePiece, tokenizer_config.json with the release's chat template and special
tokens, and release.json: the ids its config.json and generation_config.json declare, its end-of-generation tokens),
once per machine under $TAE_CACHE_DIR/real-tokenizers/ (keyed by the sdist and this file; ~20 s for the four);
`roundtrip(name)` compares it with llama.cpp's strings id for id:

    qwen2, llama-bpe     46/46 (byte-level BPE)
    phi-3, llama-spm     46/46 through tokenizer.model (the sentencepiece library); 31/46 through transformers 5, whose
                         Metaspace adds no word-start space to text that already starts with a space (" Hello": HF
                         "▁Hello", SentencePiece and llama.cpp "▁" "▁Hello") and whose BPE merges runs of "▁" that
                         SentencePiece's scores keep apart: the 15 differing strings are exactly those starting with " "

Not transformers' own GGUF reader (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`): on these files it rebuilds
qwen2 right (46/46, in ~50 s) but Llama 3 with GPT-2's pre-tokenizer regex and BOS and EOS swapped (35/46) and the
SentencePiece ones from merges it guesses from scores, without the word-start space (1/46, in ~100 s). The files here are
written the way the releases' own are: byte-level BPE as a tokenizer.json with the release's pre-tokenizer (its regex is
the "original regex from tokenizer.json" llama.cpp's src/llama-vocab.cpp quotes), SentencePiece as a tokenizer.model
with the tokenizer.json transformers converts from it (behind the Prepend/Replace normalizer those releases' files have).
llama.cpp's converter recognises each rebuilt BPE tokenizer by its own table (tokenizer.ggml.pre qwen2 / llama-bpe).

    python -m tests.real_tokenizers qwen2 llama-bpe phi-3 llama-spm    # build and print each round trip
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from stages.export import llamacpp

SEPARATOR = "\n__ggml_vocab_test__\n"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # gguf's token types, SentencePiece's too

# The releases' pre-tokenizer regexes, as llama.cpp's src/llama-vocab.cpp quotes them from their tokenizer.json
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")

# Meta-Llama-3-8B-Instruct's tokenizer_config.json (the test vocabulary carries no template)
LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
                   "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
                   "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


@dataclass(frozen=True)
class Release:
    """What a release's model directory says about its tokenizer beyond the vocabulary (its tokenizer_config.json,
    config.json and generation_config.json)."""

    vocab: str                       # ggml-vocab-<vocab>.gguf
    model_type: str                  # config.json's, what the converter and transformers pick their classes by
    source: str                      # the release these files copy
    tokens: dict[str, str | None]    # tokenizer_config.json's bos / eos / pad / unk token
    bos_token_id: int | None         # config.json's
    eos_token_id: int                # config.json's
    generation_eos: list[int]        # generation_config.json's eos_token_id
    end_of_generation: list[str]     # what a server must stop at: the template's end of turn first, then the EOS ids'
    template: str | None = None      # None: the vocabulary's own tokenizer.chat_template
    rows: int | None = None          # config.json's vocab_size where the embedding has more rows than tokens
    config: dict = field(default_factory=dict)   # the rest of tokenizer_config.json
    rstrip: frozenset[str] = frozenset()         # added tokens that eat the whitespace after them (Phi-3's chat tokens)
    not_special: frozenset[str] = frozenset()    # added tokens that are plain text to HF (`special: false`)


RELEASES = {
    # Qwen2-7B-Instruct's files (the vocabulary's template is Qwen's ChatML with its default system turn)
    "qwen2": Release("qwen2", "qwen2", "Qwen/Qwen2-7B-Instruct",
                     {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None},
                     151643, 151645, [151645, 151643], ["<|im_end|>", "<|endoftext|>"], rows=151936,
                     config={"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 32768, "errors": "replace",
                             "clean_up_tokenization_spaces": False, "split_special_tokens": False}),
    # Meta-Llama-3-8B-Instruct's
    "llama-bpe": Release("llama-bpe", "llama", "meta-llama/Meta-Llama-3-8B-Instruct",
                         {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, 128000, 128009, [128001, 128009],
                         ["<|eot_id|>", "<|end_of_text|>"], template=LLAMA3_TEMPLATE,
                         config={"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
                                 "model_max_length": 1000000000000000019884624838656,
                                 "model_input_names": ["input_ids", "attention_mask"]}),
    # microsoft/Phi-3-mini-4k-instruct's: SentencePiece plus chat tokens that strip the whitespace after them
    "phi-3": Release("phi-3", "phi3", "microsoft/Phi-3-mini-4k-instruct",
                     {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
                     1, 32000, [32000, 32001, 32007], ["<|end|>", "<|endoftext|>", "<|assistant|>"], rows=32064,
                     config={"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True, "add_eos_token": False,
                             "model_max_length": 4096, "padding_side": "left", "clean_up_tokenization_spaces": False,
                             "use_default_system_prompt": False},
                     rstrip=frozenset({"</s>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"}
                                      | {f"<|placeholder{i}|>" for i in range(1, 7)}),
                     not_special=frozenset({"</s>"})),
    # Llama-2-7b-chat-hf's: SentencePiece alone; the template closes an assistant turn with the EOS itself
    "llama-spm": Release("llama-spm", "llama", "meta-llama/Llama-2-7b-chat-hf",
                         {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None, "unk_token": "<unk>"},
                         1, 2, [2], ["</s>"],
                         template=("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
                                   "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
                                   "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                                   "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
                                   "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
                                   "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
                                   "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
                                   "{% endfor %}"),
                         config={"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True, "add_eos_token": False,
                                 "model_max_length": 1000000000000000019884624838656, "padding_side": "right",
                                 "clean_up_tokenization_spaces": False, "use_default_system_prompt": False}),
}


def sdist() -> Path:
    version = llamacpp.runtime_version()
    path = llamacpp.CACHE / f"llama_cpp_python-{version}.tar.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: scripts/install.sh caches it (the runtime and converter are built from it)")
    return path


def _cache_dir(name: str) -> Path:
    """Where `name`'s files live: keyed by the sdist and this file, so a change to either rebuilds them."""
    h = hashlib.sha256(sdist().name.encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    return llamacpp.CACHE / "real-tokenizers" / f"{name}-{h}"


def vocabulary(name: str) -> Path:
    """The directory holding ggml-vocab-<name>.gguf with its .inp and .out, out of the sdist (once)."""
    d = _cache_dir(name) / "llama.cpp"
    if (d / f"ggml-vocab-{name}.gguf.out").is_file():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".vocab.", dir=d.parent))
    with tarfile.open(sdist()) as tar:
        top = tar.next().name.split("/")[0]
        for suffix in ("", ".inp", ".out"):
            member = tar.getmember(f"{top}/vendor/llama.cpp/models/ggml-vocab-{name}.gguf{suffix}")
            with tar.extractfile(member) as src, open(tmp / Path(member.name).name, "wb") as dst:
                shutil.copyfileobj(src, dst)
    _publish(tmp, d)
    return d


def _publish(tmp: Path, final: Path) -> None:
    """`tmp` renamed to `final`; where another process (an xdist worker) got there first, its copy stays."""
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise


def build(name: str) -> Path:
    """`name`'s tokenizer files (tokenizer_config.json, tokenizer.json, tokenizer.model where SentencePiece) and
    release.json (config.json's and generation_config.json's ids, the end-of-generation tokens), built once per machine."""
    out = _cache_dir(name) / "tokenizer"
    if (out / "release.json").is_file():
        return out
    release = RELEASES[name]
    gguf = vocabulary(release.vocab) / f"ggml-vocab-{release.vocab}.gguf"
    fields = _fields(gguf)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=out.parent))
    try:
        if fields["tokenizer.ggml.model"] == "gpt2":
            _byte_level_bpe(fields, release, tmp)
        elif fields["tokenizer.ggml.model"] == "llama":
            _sentencepiece(fields, release, tmp)
        else:
            raise ValueError(f"{gguf.name}: tokenizer model {fields['tokenizer.ggml.model']!r} is not rebuilt here")
        template = release.template or fields.get("tokenizer.chat_template")
        config = json.loads((tmp / "tokenizer_config.json").read_text())
        (tmp / "tokenizer_config.json").write_text(json.dumps(config | release.config | {"chat_template": template}, indent=1))
        (tmp / "release.json").write_text(json.dumps(
            {"source": release.source, "vocab": release.vocab, "model_type": release.model_type,
             "bos_token_id": release.bos_token_id, "eos_token_id": release.eos_token_id, "generation_eos": release.generation_eos,
             "end_of_generation": release.end_of_generation, "rows": release.rows or len(fields["tokenizer.ggml.tokens"])}, indent=1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out)
    for stale in out.parent.parent.glob(f"{name}-*"):   # built by an earlier version of this file or another sdist
        if stale != out.parent:
            shutil.rmtree(stale, ignore_errors=True)
    return out


def _fields(gguf: Path) -> dict:
    """The GGUF's tokenizer.* metadata, whole (gguf-py's GGUFReader takes 11 s over Qwen2's 150k tokens and merges)."""
    import struct

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    buf = gguf.read_bytes()
    _version, _tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    offs = 24

    def value(kind: int):
        nonlocal offs
        if kind == 8:
            (n,) = struct.unpack_from("<Q", buf, offs)
            offs += 8 + n
            return buf[offs - n:offs].decode("utf-8")
        if kind == 9:
            item, n = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            if item in scalars:
                out = list(struct.unpack_from(f"<{n}{scalars[item]}", buf, offs))
                offs += struct.calcsize(scalars[item]) * n
                return out
            return [value(item) for _ in range(n)]
        (v,) = struct.unpack_from("<" + scalars[kind], buf, offs)
        offs += struct.calcsize(scalars[kind])
        return v

    fields = {}
    for _ in range(n_kv):
        key = value(8)
        (kind,) = struct.unpack_from("<I", buf, offs)
        offs += 4
        fields[key] = value(kind)
    return {k: v for k, v in fields.items() if k.startswith("tokenizer.")}


def _special_tokens(fields: dict, release: Release) -> list:
    """The vocabulary's control and user-defined tokens as HF added tokens, as the release's tokenizer.json lists
    them; the converter's [PAD<i>] fillers (the embedding's spare rows) are no tokens of the release."""
    from tokenizers import AddedToken

    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    return [(i, AddedToken(t, special=t not in release.not_special, normalized=False, rstrip=t in release.rstrip))
            for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
            if kind in (CONTROL, USER_DEFINED) and not t.startswith("[PAD")]


def _byte_level_bpe(fields: dict, release: Release, out: Path) -> None:
    """A byte-level BPE tokenizer.json as Qwen2's and Llama 3's releases write it."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    pre = fields["tokenizer.ggml.pre"]
    regex, nfc, ignore_merges = {"qwen2": (QWEN2_REGEX, True, False), "llama-bpe": (LLAMA3_REGEX, False, True)}[pre]
    added = _special_tokens(fields, release)
    first_added = min(i for i, _ in added)
    vocab = {t: i for i, t in enumerate(fields["tokenizer.ggml.tokens"][:first_added])}
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(BPE(vocab, merges, ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([a for _, a in added])
    assert [tok.token_to_id(a.content) for _, a in added] == [i for i, _ in added], "added tokens out of place"
    bos = release.tokens.get("bos_token")
    if pre == "llama-bpe":   # Llama 3's tokenizer.json puts <|begin_of_text|> first; Qwen2's adds nothing
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab.get(bos, tok.token_to_id(bos)))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, **release.tokens).save_pretrained(out)


def _sentencepiece(fields: dict, release: Release, out: Path) -> None:
    """tokenizer.model (the SentencePiece model the vocabulary was converted from) and tokenizer.json as Llama 2's and
    Phi-3's releases ship them: the BPE transformers converts from tokenizer.model, behind the normalizer those
    releases' files have (a word-start space before every piece of text, as SentencePiece and llama.cpp put one)."""
    from sentencepiece import sentencepiece_model_pb2 as sp
    from transformers import LlamaTokenizer

    tokens, scores, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"], fields["tokenizer.ggml.token_type"]
    n = max(i for i, kind in enumerate(types) if kind == NORMAL) + 1   # SentencePiece's pieces; added tokens follow
    unk, bos, eos = (fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("unknown", "bos", "eos"))
    m = sp.ModelProto()
    m.trainer_spec.model_type = sp.TrainerSpec.BPE
    m.trainer_spec.vocab_size = n
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.split_digits = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = unk, bos, eos, -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i in range(n):
        kind = UNKNOWN if i == unk else CONTROL if i in (bos, eos) else BYTE if types[i] == BYTE else NORMAL
        m.pieces.add(piece=tokens[i], score=scores[i], type=kind)
    with tempfile.TemporaryDirectory() as convert:
        (Path(convert) / "tokenizer.model").write_bytes(m.SerializeToString())
        converted = json.loads(LlamaTokenizer.from_pretrained(convert).backend_tokenizer.to_str())
    (out / "tokenizer.model").write_bytes(m.SerializeToString())
    added = _special_tokens(fields, release)
    first = tokens[bos]
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": a.content, "single_word": False, "lstrip": False, "rstrip": a.rstrip,
                          "normalized": False, "special": a.special} for i, a in added],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                          {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": first, "type_id": 0}},
                                                                    {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": first, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": first, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {first: {"id": first, "ids": [bos], "tokens": [first]}}},
        "decoder": converted["decoder"],
        "model": converted["model"] | {"unk_token": tokens[unk]},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    decoder = {str(i): {"content": a.content, "lstrip": False, "normalized": False, "rstrip": a.rstrip, "single_word": False,
                        "special": a.special} for i, a in added}
    (out / "tokenizer_config.json").write_text(json.dumps(release.tokens | {"added_tokens_decoder": decoder}))


def load(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build(name))


@dataclass
class RoundTrip:
    name: str
    strings: int
    identical: int                 # the HF tokenizer's ids are llama.cpp's
    differ: list[dict]             # text, llama.cpp's ids, HF's ids
    sentencepiece: int | None      # tokenizer.model's ids (the sentencepiece library) are llama.cpp's; None without one


def cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings for the vocabulary with the ids it expects, read as its tests/test-tokenizer-0.cpp
    reads them (strings between separators, the last one closed by one; one line of ids each)."""
    d = vocabulary(name)
    raw = (d / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.removesuffix(SEPARATOR).split(SEPARATOR) if raw.endswith(SEPARATOR) else raw.split(SEPARATOR)
    ids = (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(ids) == len(texts), (name, len(texts), len(ids))
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids, strict=True)]


def roundtrip(name: str, tokenizer=None) -> RoundTrip:
    """The HF tokenizer of `name`'s release against the ids llama.cpp expects for its test strings."""
    release = RELEASES[name]
    tok = tokenizer or load(name)
    strings = cases(release.vocab)
    differ = []
    for text, want in strings:
        got = tok(text, add_special_tokens=False)["input_ids"]
        if got != want:
            differ.append({"text": text, "llama.cpp": want, "hf": got})
    spm = None
    if (build(name) / "tokenizer.model").is_file():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(build(name) / "tokenizer.model"))
        spm = sum(sp.encode(text) == want for text, want in strings)
    return RoundTrip(name, len(strings), len(strings) - len(differ), differ, spm)


def main(names: list[str]) -> None:
    for name in names or list(RELEASES):
        r = roundtrip(name)
        spm = "" if r.sentencepiece is None else f" (its tokenizer.model through sentencepiece: {r.sentencepiece}/{r.strings})"
        print(f"{name}: {build(name)}: {r.identical}/{r.strings} of llama.cpp's test strings id for id{spm}")
        for d in r.differ:
            print(f"  {d['text'][:50]!r}: llama.cpp {d['llama.cpp'][:10]} hf {d['hf'][:10]}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
