"""Dataset reading and tokenization: file:line errors, both line forms, assistant-only labels."""

from __future__ import annotations

import json

import pytest

from stages import data
from stages.config import load_config
from stages.modelio import load_tokenizer
from tests.conftest import DEFAULT


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(load_config(DEFAULT).model)


def write(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return p


def test_both_forms_become_the_same_conversation(tmp_path):
    p = write(tmp_path, [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"prompt": "hi", "completion": "yo"},
        {"prompt": "hi", "completion": "yo", "system": "be brief", "id": 7},
    ])
    a, b, c = data.read_jsonl(p)
    assert a.messages == b.messages
    assert c.messages[0] == {"role": "system", "content": "be brief"}
    assert a.id.endswith("d.jsonl:1") and c.answer == "yo" and c.prompt_messages[-1]["content"] == "hi"


def test_every_bad_line_is_reported_with_file_and_line(tmp_path):
    p = write(tmp_path, [
        {"prompt": "ok", "completion": "fine"},
        '{"prompt": "broken", ',
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"text": "neither form"},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ])
    with pytest.raises(data.DataError) as e:
        data.read_jsonl(p)
    msg = str(e.value)
    assert "4 bad line(s)" in msg
    assert "d.jsonl:2: not valid JSON" in msg
    assert "d.jsonl:3: has no assistant turn" in msg
    assert "d.jsonl:4: has neither `messages` nor `prompt`/`completion`" in msg
    assert "d.jsonl:5: messages.0.role" in msg


def test_empty_dataset(tmp_path):
    p = write(tmp_path, ["", "  "])
    with pytest.raises(data.DataError, match="has no samples"):
        data.read_jsonl(p)


def test_labels_cover_exactly_the_assistant_turns(tokenizer, tmp_path):
    p = write(tmp_path, [{"messages": [
        {"role": "user", "content": "Translate to French: red cat"},
        {"role": "assistant", "content": "rouge chat"},
        {"role": "user", "content": "Translate to French: dog"},
        {"role": "assistant", "content": "chien"},
    ]}])
    tok = data.tokenize(data.read_jsonl(p), tokenizer, 128, "error")
    ids, labels = tok.input_ids[0], tok.labels[0]
    kept = [i for i, l in zip(ids, labels, strict=True) if l != -100]
    assert tokenizer.decode(kept) == "rouge chat</s> chien</s>"
    # what the model sees is the chat template, token for token
    assert ids == tokenizer(tokenizer.apply_chat_template(list(data.read_jsonl(p)[0].messages), tokenize=False), add_special_tokens=False)["input_ids"]


def test_long_sample_policies(tokenizer, tmp_path):
    p = write(tmp_path, [{"prompt": "Translate to French: red", "completion": "rouge"},
                         {"prompt": "Translate to French: " + "red " * 40, "completion": "rouge " * 40},
                         {"prompt": "Translate to French: red", "completion": "rouge " * 40}])
    samples = data.read_jsonl(p)
    with pytest.raises(data.DataError, match=r"2 sample\(s\) exceed data.max_length=32: .*d.jsonl:2 \(\d+ tokens\), .*d.jsonl:3"):
        data.tokenize(samples, tokenizer, 32, "error")
    dropped = data.tokenize(samples, tokenizer, 32, "drop")
    assert dropped.dropped == [samples[1].id, samples[2].id] and len(dropped.input_ids) == 1
    cut = data.tokenize(samples, tokenizer, 32, "truncate")
    assert cut.truncated == [samples[1].id, samples[2].id] and max(cut.lengths) == 32
    # truncation that leaves no answer token leaves nothing to learn: the sample is dropped
    assert cut.dropped == [samples[1].id] and cut.ids == [samples[0].id, samples[2].id]


def test_fingerprint_follows_content(tmp_path):
    p = write(tmp_path, [{"prompt": "a", "completion": "b"}])
    before = data.fingerprint([p])
    assert before == data.fingerprint([p])
    p.write_text(p.read_text().replace('"b"', '"c"'))
    assert data.fingerprint([p]) != before
