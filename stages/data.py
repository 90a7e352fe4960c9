"""Reading, checking, fingerprinting and tokenizing instruction datasets.

Where data can come from (`data.train_file`, or several `data.sources` with mixing weights):
JSON Lines (also gzip, UTF-16), JSON arrays, Parquet, CSV and Arrow files, folders of them, a
dataset saved with `datasets`' save_to_disk, or a hub dataset id already in the local HF cache
(read offline, never downloaded). JSON Lines are read here, line by line, so every problem is
reported as file:line; the other kinds through the `datasets` library (rows as file:row N).

Four record forms are accepted, detected per record, mixed freely:

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"prompt": "...", "completion": "...", "system": "optional"}
    {"instruction": "...", "input": "optional", "output": "...", "system": "optional"}      Alpaca
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}  ShareGPT

Every sample is rendered with the model's own chat template; only assistant tokens
(their text and the end-of-turn token) carry loss. Problems are reported as file:line, all
of them at once, before any model is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class AlpacaLine(BaseModel):
    model_config = ConfigDict(extra="allow")
    instruction: str
    input: str | None = ""
    output: str
    system: str | None = None


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant"}


class ShareGPTTurn(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    speaker: str = Field(alias="from")
    value: str


class ShareGPTLine(BaseModel):
    model_config = ConfigDict(extra="allow")
    conversations: list[ShareGPTTurn]
    system: str | None = None


FORMS = ("`messages` (a list of {\"role\": system|user|assistant, \"content\": text}), `prompt` + `completion` "
         "(+ `system`), Alpaca `instruction` + `output` (+ `input`, `system`), or ShareGPT `conversations` (a list of "
         "{\"from\": system|human|gpt, \"value\": text})")


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
                        + f"\nfix or remove these lines: each line is one JSON object with {FORMS}")
    if not samples:
        raise DataError(f"{path} has no samples; add JSONL lines with {FORMS}")
    return samples


def _json_array(path: Path) -> str:
    return (f"{path} is a JSON array, not JSON Lines (one JSON object per line) as its name says; rename it to "
            f"{path.stem}.json (arrays are read from .json files), or convert it: `jq -c '.[]' {path.name} > {path.stem}.lines.jsonl`")


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
    obj = {k: json.loads(v) if k in ("messages", "conversations") and isinstance(v, str) else v for k, v in obj.items()}  # CSV cells
    if obj.get("messages") is not None:
        msgs = [m.model_dump() for m in ChatLine.model_validate(obj).messages]
    elif obj.get("conversations") is not None:
        line = ShareGPTLine.model_validate(obj)
        unknown = sorted({t.speaker for t in line.conversations} - set(SHAREGPT_ROLES))
        if unknown:
            raise ValueError(f"conversations: speaker(s) {unknown} are not one of {sorted(SHAREGPT_ROLES)}")
        msgs = ([{"role": "system", "content": line.system}] if line.system else []) + [
            {"role": SHAREGPT_ROLES[t.speaker], "content": t.value} for t in line.conversations]
    elif obj.get("instruction") is not None:
        line = AlpacaLine.model_validate(obj)
        user = line.instruction + (f"\n\n{line.input}" if line.input and line.input.strip() else "")
        msgs = ([{"role": "system", "content": line.system}] if line.system else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": line.output}]
    elif "prompt" in obj or "completion" in obj:
        line = PromptLine.model_validate(obj)
        msgs = ([{"role": "system", "content": line.system}] if line.system else []) + [
            {"role": "user", "content": line.prompt},
            {"role": "assistant", "content": line.completion},
        ]
    else:
        raise ValueError(f"is in none of the accepted forms (fields seen: {sorted(obj)}); accepted: {FORMS}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("has no assistant turn, so there is nothing to learn; add a {\"role\": \"assistant\", ...} message")
    if not any(m["content"].strip() for m in msgs if m["role"] == "assistant"):
        raise ValueError("every assistant turn is empty; give the answer to learn")
    if any(SURROGATE.search(m["content"]) for m in msgs):
        raise ValueError(_surrogate_problem(obj, "\n".join(m["content"] for m in msgs)))
    return msgs


# Half of a UTF-16 pair on its own: JSON lets "\ud800" through, but it is no character; UTF-8 (and every tokenizer)
# refuses it. A valid pair ("\ud83d\ude00") is one character by the time json.loads returns it.
SURROGATE = re.compile(r"[\ud800-\udfff]")


def _surrogate_problem(obj: object, rendered: str) -> str:
    field, at, char = _find_surrogate(obj, rendered) or ("a text field", 0, "\ud800")
    return (f"{field} holds a lone surrogate, \\u{ord(char):04x} at character {at + 1}: half of a UTF-16 pair, not a character, so "
            "it cannot be tokenized; fix the line: write the character itself (or its whole pair, \\ud83d\\ude00 for one emoji), "
            "or remove the escape")


def _find_surrogate(obj: object, rendered: str, path: str = "") -> tuple[str, int, str] | None:
    """(field path such as messages[1].content, position, character) of the first lone surrogate in a field
    whose text is `rendered` (a tag or id field is not trained on)."""
    if isinstance(obj, str):
        m = SURROGATE.search(obj) if obj in rendered else None
        return (path, m.start(), m.group()) if m else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        found = _find_surrogate(v, rendered, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def _short(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'line'}: {x['msg']}" for x in e.errors()[:3])
    return str(e)


TABLE_KINDS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".arrow": "arrow", ".json": "json"}
LINE_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".json.gz")


def read_source(path: str | Path, split: str = "train") -> list[Sample]:
    """All samples of one source: a file, a folder of files, a saved dataset, or a hub id in the local cache.

    Read once per process while its files stay as they are: the stages of one flow run (preflight, train, merge,
    export, smoke, the champion comparison) each ask for the held-out or training samples, and parsing the whole
    dataset again for each would cost as much as the first read. Samples are frozen; each caller gets its own list."""
    key = (str(path), split, _signature(Path(path)))
    if key not in _READ:
        if len(_READ) >= _READ_KEEP:
            _READ.pop(next(iter(_READ)))
        _READ[key] = tuple(_read_source(path, split))
    return list(_READ[key])


_READ: dict[tuple, tuple[Sample, ...]] = {}
_READ_KEEP = 8   # sources kept parsed: a run reads its train, eval and mixed sources


def _signature(p: Path) -> tuple:
    """What changes when a source's bytes do: each file's name, size and modification time (a hub id's cached files)."""
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else hub_cache_files(str(p))
    return tuple((str(f), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()])


def _read_source(path: str | Path, split: str) -> list[Sample]:
    p = Path(path)
    if p.is_dir():
        if any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return _from_table(_saved(p, split), f"{p}")
        files = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f) is not None)
        if not files:
            raise DataError(f"{p} is a folder with no data files; put .jsonl, .json, .parquet, .csv or .arrow files in it "
                            "(or point at a dataset saved with datasets' save_to_disk)")
        return [x for f in files for x in _read_source(f, split)]
    if p.is_file():
        kind = _kind(p)
        if kind == "jsonl" or kind is None:  # unknown suffix: JSON Lines, as this project always read
            return read_jsonl(p)
        if kind == "json" and not _starts_with_array(p):
            return read_jsonl(p)  # JSON Lines named .json: read line by line for file:line errors
        return _from_table(_load_table(kind, p), str(p))
    return _from_table(_cached_hub_dataset(str(path), split), str(path))


def _kind(p: Path) -> str | None:
    name = p.name.lower()
    if name.endswith(LINE_SUFFIXES):
        return "jsonl"
    return TABLE_KINDS.get(p.suffix.lower())


def _starts_with_array(p: Path) -> bool:
    with p.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _load_table(kind: str, p: Path):
    import datasets

    _check_not_empty(kind, p)
    try:
        return datasets.load_dataset(kind, data_files=str(p), split="train",
                                     **({"delimiter": "\t"} if p.suffix.lower() == ".tsv" else {}))
    except Exception as e:  # pyarrow / pandas parse errors: name the file and the cause
        raise DataError(f"{p}: cannot be read as {kind} ({type(e).__name__}: {str(e)[:300]}); check the file, or convert it "
                        "to JSON Lines") from None


def _check_not_empty(kind: str, p: Path) -> None:
    """An empty file or a Parquet file of 0 rows, said as such (datasets fails on them with a generation error)."""
    if p.stat().st_size == 0:
        raise DataError(f"{p} is empty (0 bytes); add rows with {FORMS} to it, or point the config at a file that has them")
    if kind != "parquet":
        return
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(p)
    except Exception:  # not Parquet at all: load_dataset's own error says so below
        return
    if meta.num_rows == 0:
        raise DataError(f"{p} has no rows (a Parquet file with the columns {', '.join(meta.schema.names) or 'none'} and 0 rows); "
                        f"add rows with {FORMS} to it, or point the config at a file that has them")


def _saved(p: Path, split: str):
    import datasets

    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{p}: a saved dataset with splits {sorted(loaded)}, no `{split}`; set the source's split to one of them")
        return loaded[split]
    return loaded


def _cached_hub_dataset(name: str, split: str):
    """A hub dataset id, from the local HF cache only: nothing is downloaded at run time."""
    import os

    import datasets

    previous = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(f"{name}: not a local file or folder, and not a dataset in the local Hugging Face cache ({type(e).__name__}: "
                        f"{str(e)[:200]}); nothing is downloaded at run time: point at a local file, or fetch it where there is "
                        f"internet (`datasets.load_dataset({name!r})`) and copy the cache (HF_HOME) here") from None
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _from_table(table, where: str) -> list[Sample]:
    """Samples of a `datasets` table, every bad row reported as where:row N (1-based)."""
    samples, problems = [], []
    for n, row in enumerate(table, start=1):
        try:
            samples.append(Sample(f"{where}:row {n}", tuple(_parse(row))))
        except (ValidationError, ValueError) as e:
            problems.append(f"{where}:row {n}: {_short(e)}")
    if problems:
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise DataError(f"{where}: {len(problems)} bad row(s) (columns: {', '.join(table.column_names)}):\n"
                        + "\n".join(f"  - {p}" for p in problems[:MAX_REPORTED]) + more + f"\nfix these rows: each needs {FORMS}")
    if not samples:
        raise DataError(f"{where} has no rows; it needs rows with {FORMS}")
    return samples


def mixed(cfg) -> list[Sample]:
    """data.train_file, or every data.sources entry with its weight: 0.5 takes a seeded half of that
    source, 2 takes it twice, 1.5 once plus a seeded half."""
    d = cfg.data
    if not d.sources:
        return read_source(d.train_file)
    out: list[Sample] = []
    for k, src in enumerate(d.sources):
        got = read_source(src.path, src.split)
        whole, part = divmod(src.weight * len(got), len(got))
        rng = random.Random(f"mix/{cfg.training.seed}/{k}")
        out += got * int(whole) + [got[i] for i in sorted(rng.sample(range(len(got)), round(part)))]
    return out


def input_files(cfg) -> list[Path]:
    """Every local file the data is read from (what the data fingerprint covers)."""
    d = cfg.data
    paths = [Path(src.path) for src in d.sources] or [Path(d.train_file)]
    if d.eval_file is not None:
        paths.append(Path(d.eval_file))
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            files.append(p)
        else:  # a hub id: its files in the local cache
            files += hub_cache_files(str(p))
    return files


def hub_cache_files(name: str) -> list[Path]:
    import os

    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    folder = home / "hub" / f"datasets--{name.replace('/', '--')}"
    return sorted(f for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else []


def train_samples(cfg) -> list[Sample]:
    """The samples training trains on: the training data less the eval split, if any."""
    return _split(cfg)[0]


def eval_samples(cfg) -> list[Sample]:
    """The samples eval loss is measured on: data.eval_file, else data.eval_split of the training data, else none."""
    if cfg.data.eval_file is not None:
        return read_source(cfg.data.eval_file)
    return _split(cfg)[1]


def _split(cfg) -> tuple[list[Sample], list[Sample]]:
    samples = mixed(cfg)
    if cfg.data.eval_file is not None or not cfg.data.eval_split:
        return samples, []
    if len(samples) < 2:
        raise DataError(f"data.eval_split needs at least 2 training samples, there are {len(samples)}; add samples or an eval_file")
    order = list(range(len(samples)))
    random.Random(f"eval-split/{cfg.training.seed}").shuffle(order)
    held = set(order[:max(1, round(cfg.data.eval_split * len(samples)))])
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def held_out(cfg, limit: int) -> list[Sample]:
    """Up to `limit` held-out samples (eval data; the training data when there is none)."""
    return (eval_samples(cfg) or train_samples(cfg))[:limit]


def held_out_texts(cfg, tokenizer, limit: int) -> list[str]:
    """The held-out samples as whole chat texts, through the tokenizer's chat template."""
    return [chat_text(s, tokenizer) for s in held_out(cfg, limit)]


def chat_text(sample: Sample, tokenizer) -> str:
    """One sample as a whole chat text; a template that fails on it is a DataError naming the culprit."""
    try:
        return tokenizer.apply_chat_template(list(sample.messages), tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template that raises, a tokenizer that chokes on a character
        raise _sample_failure(sample, tokenizer, e) from e


def fingerprint(paths: list[Path]) -> str:
    """sha256 over the dataset files' names and bytes (input_files): changes exactly when the data does."""
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
    """Render each sample with the chat template and mask everything but assistant turns. Special-token text inside a
    message is encoded as plain text (whether such data may train at all is check_special_tokens' question).

    Args:
        policy: for samples over max_length: "error" (DataError naming them), "truncate", "drop".
    """
    return _apply_policy(_encode_all(samples, tokenizer), max_length, policy)


def _encode_all(samples: list[Sample], tokenizer) -> Tokenized:
    out = Tokenized([], [], [])
    specials = special_pattern(tokenizer)
    first = next((s for s in samples if any(m["role"] == "assistant" for m in s.messages[1:])), None)
    if first is not None:
        check_generation_prompt(first, tokenizer)
    for s in samples:
        try:
            ids, labels = _encode(s, tokenizer, specials)
        except DataError:
            raise
        except Exception as e:  # a template that raises, a tokenizer that chokes on a character
            raise _sample_failure(s, tokenizer, e) from e
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.ids.append(s.id)
    return out


def _sample_failure(s: Sample, tokenizer, e: BaseException) -> DataError:
    from stages.model.check import template_at_fault, template_problem

    if template_at_fault(e):
        return DataError(template_problem(tokenizer, e))
    return DataError(f"{s.id}: the tokenizer or chat template failed on this sample: {type(e).__name__}: {e}")


def _apply_policy(tok: Tokenized, max_length: int, policy: str) -> Tokenized:
    out, too_long = Tokenized([], [], []), []
    for row in _policy_rows(tok, max_length, policy, out, too_long):
        out.input_ids.append(row["input_ids"])
        out.labels.append(row["labels"])
        out.ids.append(row["id"])
    _check_policy(len(out.ids), max_length, policy, too_long, tok.ids)
    return out


def _policy_rows(tok: Tokenized, max_length: int, policy: str, report: Tokenized, too_long: list[tuple[str, int]]):
    """The rows data.long_sample_policy keeps, truncated where it says; what it truncates or drops
    goes to `report`, what is too long to `too_long` (id, tokens)."""
    for ids, labels, sid in zip(tok.input_ids, tok.labels, tok.ids, strict=True):
        if len(ids) > max_length:
            too_long.append((sid, len(ids)))
            if policy == "drop":
                report.dropped.append(sid)
                continue
            if policy == "truncate":
                report.truncated.append(sid)
                ids, labels = ids[:max_length], labels[:max_length]
        if not any(x != -100 for x in labels):
            report.dropped.append(sid)  # truncation removed every answer token: nothing to learn
            continue
        yield {"input_ids": ids, "labels": labels, "id": sid, "length": len(ids)}


def _check_policy(kept: int, max_length: int, policy: str, too_long: list[tuple[str, int]], ids: list[str]) -> None:
    """Args: ids: every sample the policy was applied to (file:line), to name the files an empty result came from."""
    if too_long and policy == "error":
        raise DataError(
            f"{len(too_long)} sample(s) exceed data.max_length={max_length}: "
            f"{', '.join(f'{sid} ({n} tokens)' for sid, n in too_long[:MAX_REPORTED])}; "
            "raise data.max_length, or set data.long_sample_policy to truncate or drop"
        )
    if not kept:
        files = ", ".join(dict.fromkeys(_source_of(i) for i in ids)) or "the data"
        why = (f"all {len(ids)} of its samples are longer than data.max_length={max_length} (the shortest has "
               f"{min(n for _, n in too_long)} tokens) and data.long_sample_policy is {policy}" if policy == "drop" and len(too_long) == len(ids)
               else f"data.long_sample_policy: {policy} left no sample with an answer token within data.max_length={max_length}")
        need = min((n for _, n in too_long), default=max_length)
        raise DataError(f"no sample of {files} is left: {why}; raise data.max_length to at least {need}, or give {files} samples "
                        "that fit")


def _source_of(sample_id: str) -> str:
    """The file (or dataset) of a sample id: `path:line` or `path:row N`."""
    return sample_id.rsplit(":", 1)[0] if ":" in sample_id else sample_id


def special_pattern(tokenizer) -> re.Pattern | None:
    """The text of the tokenizer's special (control) tokens, longest first: the tokenizer matches each whole wherever it
    occurs in its input, inside a message's text as well as in what the chat template writes around it."""
    texts = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    texts |= set(getattr(tokenizer, "all_special_tokens", []))
    texts = sorted((t for t in texts if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def check_special_tokens(samples: list[Sample], tokenizer, setting: str) -> list[str]:
    """Samples whose messages hold the text of a special token: a DataError naming each (file:line, turn, tokens) under
    data.special_tokens_in_content: error; under plain, their ids (tokenize encodes that text as plain text).

    Such text (pasted chat logs, scraped transcripts, data made for another template) would tokenize into control
    tokens: an answer holding `<|im_end|>\n<|im_start|>user` ends its turn mid-answer and writes the user's next one,
    and the model learns exactly that."""
    pattern = special_pattern(tokenizer)
    found = []
    for s in samples if pattern else []:
        turns = [(k, m["role"], sorted(set(pattern.findall(m["content"])))) for k, m in enumerate(s.messages)]
        found += [(s.id, f"{s.id}: the {role} turn (message {k + 1}) holds {', '.join(map(repr, tokens))}") for k, role, tokens in turns if tokens]
    if not found or setting == "plain":
        return list(dict.fromkeys(sid for sid, _ in found))
    more = f"\n  ... and {len(found) - MAX_REPORTED} more" if len(found) > MAX_REPORTED else ""
    raise DataError(
        f"{len(found)} message(s) hold the text of the tokenizer's special tokens, which tokenizing turns into control tokens "
        "(a turn that ends mid-answer, a second turn inside one: the model would learn to end its answers early and to write "
        "the user's next turn):\n" + "\n".join(f"  - {line}" for _, line in found[:MAX_REPORTED]) + more
        + "\nremove that text from these samples (pasted chat logs, or data made for another chat template?), or set "
        "data.special_tokens_in_content: plain to train it as plain text")


def check_generation_prompt(sample: Sample, tokenizer) -> None:
    """The chat template writes the assistant header when asked for a generation prompt. The labels of an answer start
    where the prompt rendered with add_generation_prompt ends: a template that ignores the flag leaves its header
    (`<|im_start|>assistant\n`) inside every answer, and the model learns to start each answer with it, in silence."""
    msgs = list(sample.messages)
    i = next(k for k, m in enumerate(msgs) if m["role"] == "assistant" and k > 0)
    try:
        asked = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
        plain = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=False)
        upto = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that fails on this sample is reported when it is encoded
        return
    at = upto.find(msgs[i]["content"], len(asked)) if msgs[i]["content"] and upto.startswith(asked) else -1
    header = upto[len(asked):at] if at >= 0 else ""
    if asked == plain and header.strip():
        from stages.model.check import chat_template_file

        where = chat_template_file(Path(getattr(tokenizer, "name_or_path", "") or "."))
        raise DataError(
            f"the chat template in {where} ignores add_generation_prompt: it writes the assistant header {header!r} before each "
            "answer, but not at the end of a prompt rendered for generation, so training would count the header as part of every "
            "answer (the model learns to write it, and every served answer starts with it); make the template write the header "
            f"when add_generation_prompt is true (after its messages loop: {{% if add_generation_prompt %}}{{{{ {header!r} }}}}"
            "{% endif %}), or restore the template that came with the model")


def _encode(sample: Sample, tokenizer, specials: re.Pattern | None = None) -> tuple[list[int], list[int]]:
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
    plain = _content_specials(sample, tokenizer, text, specials) if specials and any(specials.search(m["content"]) for m in msgs) else []
    ids, offsets = _encode_text(sample, tokenizer, text, plain)
    labels = [tok if any(a <= start < b for a, b in spans) else -100 for tok, (start, _end) in zip(ids, offsets, strict=True)]
    return ids, labels


def _content_specials(sample: Sample, tokenizer, text: str, specials: re.Pattern) -> list[tuple[int, int]]:
    """Where in the rendered `text` the messages' own special-token text is (character spans), as opposed to what the
    template wrote: message k is looked for after the conversation up to k renders (a message "</s>" would otherwise be
    found in the template's own end of the turn before it)."""
    out, cursor = [], 0
    for k, m in enumerate(sample.messages):
        if k:
            with contextlib.suppress(Exception):  # a template that cannot render this prefix: the search goes on from the last message
                before = tokenizer.apply_chat_template(list(sample.messages[:k]), tokenize=False)
                if text.startswith(before):
                    cursor = max(cursor, len(before))
        at = text.find(m["content"], cursor) if m["content"] else -1
        if at < 0:
            if specials.search(m["content"]):
                raise DataError(f"{sample.id}: message {k + 1} holds special-token text that data.special_tokens_in_content: plain "
                                "would encode as plain text, but the chat template changes the message's text, so it cannot be "
                                "found in the rendered conversation; remove the special-token text from this sample")
            continue
        out += [(at + x.start(), at + x.end()) for x in specials.finditer(m["content"])]
        cursor = at + len(m["content"])
    return out


def _encode_text(sample: Sample, tokenizer, text: str, plain: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text`, the characters of `plain` encoded as plain text.

    Both encodings are the tokenizer's own: `text` as it is (special-token text matched as control tokens) and with
    split_special_tokens (matched as text). Around each plain span the second is used, out to the nearest point where
    both put a token boundary; everywhere else the first, so the template's own control tokens stay what they are."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if not plain:
        return ids, offsets
    split = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
    zones = _zones(plain, offsets, split["offset_mapping"])

    def inside(start: int, end: int) -> bool:
        return any(lo <= start and end <= hi and start < hi for lo, hi in zones)

    control = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    kept = [(o, i) for i, o in zip(ids, offsets, strict=True) if not inside(*o)]
    taken = [(o, i) for i, o in zip(split["input_ids"], split["offset_mapping"], strict=True) if inside(*o)]
    spans = set(plain)
    template_own = [o for i, o in zip(ids, offsets, strict=True) if i in control and inside(*o) and tuple(o) not in spans]
    if template_own or any(i in control for _, i in taken):
        # a zone reached one of the template's own control tokens, or the tokenizer matched special tokens regardless
        raise DataError(f"{sample.id}: {type(tokenizer).__name__} cannot encode the special-token text of this sample as plain "
                        "text (split_special_tokens does not apply to it there); remove that text from the sample, or set "
                        "data.special_tokens_in_content: error to find every such sample")
    merged = sorted(kept + taken, key=lambda x: x[0][0])  # stable: tokens that start at one character keep their order
    return [i for _, i in merged], [o for o, _ in merged]


def _zones(spans: list[tuple[int, int]], *encodings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each span widened until no token of any encoding crosses its edges (merged where they meet)."""
    zones = []
    for lo, hi in spans:
        grown = True
        while grown:
            grown = False
            for s, e in (o for enc in encodings for o in enc):
                if s < hi and e > lo and (s < lo or e > hi):
                    lo, hi, grown = min(lo, s), max(hi, e), True
        zones.append((lo, hi))
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(zones):
        if out and lo < out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


@dataclass
class TrainingSet:
    """The tokenized training data as an Arrow table on disk, memory-mapped: host memory does not
    grow with the dataset. `rows[i]` is {"input_ids", "labels", "id"}; `lengths` a plain list."""

    rows: object                     # datasets.Dataset
    lengths: list[int]
    truncated: list[str]
    dropped: list[str]
    cache_dir: Path
    cached: bool                     # read from an earlier tokenization, not made now
    plain: list[str] = field(default_factory=list)  # samples whose special-token text was encoded as plain text

    @property
    def ids(self) -> list[str]:
        return self.rows.data.column("id").to_pylist()


CHUNK = 5000  # samples per tokenization task
ROWS = "rows.arrow"
CACHE_LAYOUT = 3  # bump when what _build writes changes (3: special-token text in messages encoded as plain text)


def training_set(cfg, tokenizer, cache_root: Path | None = None) -> TrainingSet:
    """The training samples tokenized (data.tokenize) once per content: cached under
    <artifacts_dir>/cache/tokenized/<key>, the key covering the data files' bytes, the data
    settings, the seed and the tokenizer with its chat template. The preflight makes it, the
    train stage reads it; a second run on the same data does not read or tokenize it again.
    Tokenization runs in data.num_proc processes."""
    import datasets

    root = Path(cache_root or Path(cfg.artifacts_dir) / "cache" / "tokenized")
    key = _cache_key(cfg, tokenizer)
    where = root / key
    if not (where / "done.json").is_file():
        _build(cfg, tokenizer, where)
        cached = False
    else:
        cached = True
    meta = json.loads((where / "done.json").read_text())
    table = datasets.Dataset.from_file(str(where / ROWS))  # memory-mapped
    return TrainingSet(table, table.data.column("length").to_pylist(), meta["truncated"], meta["dropped"], where, cached,
                       meta.get("plain", []))


def _cache_key(cfg, tokenizer) -> str:
    h = hashlib.sha256(f"layout {CACHE_LAYOUT}".encode())  # a cache written by an older layout is not read
    h.update(fingerprint(input_files(cfg)).encode())
    h.update(cfg.data.model_dump_json(exclude={"eval_file", "num_proc"}).encode())
    h.update(str(cfg.training.seed).encode())  # the eval split and the mix are seeded
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True).encode())
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()[:20]


def _build(cfg, tokenizer, where: Path) -> None:
    """Tokenize in chunks across processes and stream the rows into one Arrow file: only the
    samples and a few chunks are in memory at once, never the whole tokenized set."""
    import multiprocessing
    import os
    import shutil
    import tempfile
    from concurrent.futures import ProcessPoolExecutor

    import datasets
    from datasets.arrow_writer import ArrowWriter

    samples = train_samples(cfg)
    d = cfg.data
    plain = check_special_tokens(samples, tokenizer, d.special_tokens_in_content)
    procs = max(1, min(d.num_proc or os.cpu_count() or 1, -(-len(samples) // CHUNK)))
    chunks = (samples[i:i + CHUNK] for i in range(0, len(samples), CHUNK))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a forked tokenizer with threads would deadlock
    report, too_long = Tokenized([], [], []), []  # report: only truncated / dropped ids
    features = datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "id": datasets.Value("string"),
        "length": datasets.Value("int32"),
    })
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
    try:
        with contextlib.ExitStack() as stack:
            if procs > 1:
                pool = stack.enter_context(ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")))
                parts = _bounded_map(pool, _encode_all, chunks, tokenizer, ahead=2 * procs)
            else:
                parts = (_encode_all(c, tokenizer) for c in chunks)
            writer = stack.enter_context(ArrowWriter(features=features, path=str(tmp / ROWS)))
            for part in parts:
                for row in _policy_rows(part, d.max_length, d.long_sample_policy, report, too_long):
                    writer.write(row)
            kept, _ = writer.finalize()
        _check_policy(kept, d.max_length, d.long_sample_policy, too_long, [s.id for s in samples])
        (tmp / "done.json").write_text(json.dumps({"samples": kept, "truncated": report.truncated, "dropped": report.dropped,
                                                   "plain": plain}))
        tmp.rename(where)  # atomic: a concurrent run that built it first wins, this copy goes
    except OSError:
        if not where.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bounded_map(pool, fn, items, arg, ahead: int):
    """pool.map(fn, items) in order, with at most `ahead` results waiting: Executor.map submits
    every item at once, and finished chunks would pile up in memory while the writer catches up."""
    import collections

    pending = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item, arg))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
