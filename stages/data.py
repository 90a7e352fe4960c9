"""Reading, checking, fingerprinting and tokenizing instruction datasets (JSONL).

Two line forms are accepted, mixed freely:

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"prompt": "...", "completion": "...", "system": "optional"}

Every sample is rendered with the model's own chat template; only assistant tokens
(their text and the end-of-turn token) carry loss. Problems are reported as file:line, all
of them at once, before any model is loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from stages.errors import UserError

MAX_REPORTED = 20  # problems listed per file; the rest are counted


class DataError(UserError, ValueError):
    """The dataset cannot be used as it is; the message says where and how to fix it."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None  # OpenAI's participant name: accepted, not rendered (chat templates have no place for it)

    def model_dump(self, **kw) -> dict:
        return {"role": self.role, "content": self.content}


class ChatLine(BaseModel):
    model_config = ConfigDict(extra="allow")  # ids, sources, tags: kept out of training
    messages: list[Message]


class PromptLine(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt: str
    completion: str
    system: str | None = None


@dataclass(frozen=True)
class Sample:
    id: str                      # file:line, how every report refers to it
    messages: tuple[dict, ...]   # role/content dicts, chat-template ready

    @property
    def prompt_messages(self) -> list[dict]:
        """Everything before the last assistant turn: what a serving prompt would hold."""
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return list(self.messages[:last])

    @property
    def answer(self) -> str:
        return [m for m in self.messages if m["role"] == "assistant"][-1]["content"]


MAX_LINE_BYTES = 16 * 2**20  # one sample; a larger line is a wrong file (a JSON dump, a binary), not a long conversation


def read_jsonl(path: Path) -> list[Sample]:
    """All samples of one file, or DataError listing every bad line as file:line.

    UTF-8 (with or without a BOM) and UTF-16 with a BOM (what a Windows shell redirect writes)
    are read, gzip-compressed files too (`.jsonl.gz`, or any name); a JSON array, invalid bytes
    and a line over MAX_LINE_BYTES are refused by name.
    """
    path = Path(path)
    samples, problems = [], []
    for n, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            samples.append(Sample(where, tuple(_parse(json.loads(line)))))
        except json.JSONDecodeError as e:
            if n == 1 and line.lstrip().startswith("["):
                raise DataError(_json_array(path)) from None
            problems.append(f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix or remove the line")
        except (ValidationError, ValueError) as e:
            if isinstance(e, ValueError) and n == 1 and line.lstrip().startswith("["):
                raise DataError(_json_array(path)) from None
            problems.append(f"{where}: {_short(e)}")
    if problems:
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise DataError(f"{path}: {len(problems)} bad line(s):\n" + "\n".join(f"  - {p}" for p in problems[:MAX_REPORTED]) + more
                        + "\nfix or remove these lines: each line is one JSON object with `messages` (a list of {\"role\": "
                        "system|user|assistant, \"content\": text}) or with `prompt` and `completion`")
    if not samples:
        raise DataError(f"{path} has no samples; add JSONL lines with `messages` or `prompt`/`completion`")
    return samples


def _json_array(path: Path) -> str:
    return (f"{path} is a JSON array, not JSON Lines (one JSON object per line); convert it: "
            f"`jq -c '.[]' {path.name} > {path.stem}.lines.jsonl`, or in Python write json.dumps(item) + '\\n' for each item")


def _lines(path: Path):
    """(line number, text) of a UTF-8 / UTF-16 / gzip JSONL file; DataError for anything else."""
    import codecs
    import gzip

    with path.open("rb") as f:
        magic = f.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                text = (head + f.read()).decode("utf-16")  # the BOM says which byte order
                yield from enumerate(text.splitlines(), start=1)
                return
            f.seek(0)
            for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(raw) > MAX_LINE_BYTES:
                    raise DataError(f"{path}:{n}: a line of over {MAX_LINE_BYTES // 2**20} MiB; one sample per line is expected: "
                                    "split the file into JSON Lines, one conversation per line")
                if n == 1:
                    raw = raw.removeprefix(codecs.BOM_UTF8)
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{n}: not UTF-8 ({e.reason}: byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                    "save the file as UTF-8 (UTF-16 with a byte-order mark is read too)") from None
    except UnicodeDecodeError as e:  # UTF-16 with a BOM but broken
        raise DataError(f"{path}: not valid UTF-16 ({e.reason}); save the file as UTF-8") from None
    except (gzip.BadGzipFile, EOFError) as e:
        raise DataError(f"{path}: a damaged gzip file ({e}); compress it again or give the uncompressed JSONL") from None


def _parse(obj: object) -> list[dict]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = [m.model_dump() for m in ChatLine.model_validate(obj).messages]
    elif "prompt" in obj or "completion" in obj:
        line = PromptLine.model_validate(obj)
        msgs = ([{"role": "system", "content": line.system}] if line.system else []) + [
            {"role": "user", "content": line.prompt},
            {"role": "assistant", "content": line.completion},
        ]
    else:
        raise ValueError(f"has neither `messages` nor `prompt`/`completion` (keys: {sorted(obj)})")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("has no assistant turn, so there is nothing to learn; add a {\"role\": \"assistant\", ...} message")
    if not any(m["content"].strip() for m in msgs if m["role"] == "assistant"):
        raise ValueError("every assistant turn is empty; give the answer to learn")
    return msgs


def _short(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'line'}: {x['msg']}" for x in e.errors()[:3])
    return str(e)


def held_out(cfg, limit: int) -> list[Sample]:
    """Up to `limit` samples of data.eval_file (of the training file when there is none)."""
    return read_jsonl(cfg.data.eval_file or cfg.data.train_file)[:limit]


def held_out_texts(cfg, tokenizer, limit: int) -> list[str]:
    """The held-out samples as whole chat texts, through the tokenizer's chat template."""
    return [tokenizer.apply_chat_template(list(s.messages), tokenize=False) for s in held_out(cfg, limit)]


def fingerprint(paths: list[Path]) -> str:
    """sha256 over the dataset files' names and bytes: changes exactly when the data does."""
    h = hashlib.sha256()
    for p in sorted(Path(x) for x in paths if x is not None):
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class Tokenized:
    input_ids: list[list[int]]
    labels: list[list[int]]          # -100 outside assistant turns
    ids: list[str]                   # Sample.id per row
    truncated: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.input_ids]


def tokenize(samples: list[Sample], tokenizer, max_length: int, policy: str) -> Tokenized:
    """Render each sample with the chat template and mask everything but assistant turns.

    Args:
        policy: for samples over max_length: "error" (DataError naming them), "truncate", "drop".
    """
    out = Tokenized([], [], [])
    too_long = []
    for s in samples:
        try:
            ids, labels = _encode(s, tokenizer)
        except DataError:
            raise
        except Exception as e:  # a template that raises, a tokenizer that chokes on a character
            raise DataError(f"{s.id}: the tokenizer or chat template failed on this sample: {type(e).__name__}: {e}") from e
        if len(ids) > max_length:
            too_long.append(f"{s.id} ({len(ids)} tokens)")
            if policy == "drop":
                out.dropped.append(s.id)
                continue
            if policy == "truncate":
                out.truncated.append(s.id)
                ids, labels = ids[:max_length], labels[:max_length]
        if not any(x != -100 for x in labels):
            out.dropped.append(s.id)  # truncation removed every answer token: nothing to learn
            continue
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.ids.append(s.id)
    if too_long and policy == "error":
        raise DataError(
            f"{len(too_long)} sample(s) exceed data.max_length={max_length}: {', '.join(too_long[:MAX_REPORTED])}; "
            "raise data.max_length, or set data.long_sample_policy to truncate or drop"
        )
    if not out.input_ids:
        raise DataError("no sample is left to train on after applying data.long_sample_policy; raise data.max_length")
    return out


def _encode(sample: Sample, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and labels that keep only assistant spans."""
    msgs = list(sample.messages)
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"{sample.id}: the chat template does not render conversations incrementally "
                "(a prefix of the conversation renders differently), so assistant turns cannot be located"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        tok if any(a <= start < b for a, b in spans) else -100
        for tok, (start, _end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    ]
    return enc["input_ids"], labels
