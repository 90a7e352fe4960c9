"""Dataset reading and tokenization: file:line errors, both line forms, assistant-only labels."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from stages import data
from stages.config import load_config
from stages.model.load import load_tokenizer
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
    assert "d.jsonl:4: is in none of the accepted forms" in msg
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


def _conversation(samples):
    return [s.messages for s in samples]


def test_alpaca_and_sharegpt_records_become_the_same_conversations(tmp_path):
    want = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Translate to French: red cat"},
            {"role": "assistant", "content": "rouge chat"})
    f = write(tmp_path, [
        {"messages": list(want)},
        {"instruction": "Translate to French:", "input": "red cat", "output": "rouge chat", "system": "Be brief."},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Translate to French: red cat"},
                           {"from": "gpt", "value": "rouge chat"}]},
    ])
    got = _conversation(data.read_source(f))
    assert got[0] == want and got[2] == want
    assert got[1][1]["content"] == "Translate to French:\n\nred cat" and got[1][2] == want[2]


ROWS = [{"prompt": f"Translate to French: word{i}", "completion": f"mot{i}"} for i in range(6)]


@pytest.mark.parametrize("kind", ["parquet", "csv", "json-array", "arrow", "folder", "saved", "saved-dict"])
def test_every_file_kind_reads_the_same_samples(tmp_path, kind):
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    path = {
        "parquet": lambda: (table.to_parquet(str(tmp_path / "d.parquet")), tmp_path / "d.parquet")[1],
        "csv": lambda: (table.to_csv(str(tmp_path / "d.csv"), index=False), tmp_path / "d.csv")[1],
        "json-array": lambda: ((tmp_path / "d.json").write_text(json.dumps(ROWS)), tmp_path / "d.json")[1],
        "arrow": lambda: (table.save_to_disk(str(tmp_path / "s")), next((tmp_path / "s").glob("*.arrow")))[1],
        "folder": lambda: ((tmp_path / "f").mkdir(), (tmp_path / "f" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3])),
                           table.select(range(3, 6)).to_parquet(str(tmp_path / "f" / "b.parquet")), tmp_path / "f")[3],
        "saved": lambda: (table.save_to_disk(str(tmp_path / "s")), tmp_path / "s")[1],
        "saved-dict": lambda: (datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "s")),
                               tmp_path / "s")[1],
    }[kind]()
    got = data.read_source(path)
    assert _conversation(got) == _conversation(data.read_source(write(tmp_path, ROWS)))
    assert all(str(path) in s.id for s in got)
    if kind == "parquet":
        assert got[2].id == f"{path}:row 3"


def test_a_table_in_no_accepted_form_lists_the_fields_it_has_and_the_forms(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"question": "a", "answer": "b"}]).to_parquet(str(tmp_path / "q.parquet"))
    with pytest.raises(data.DataError, match=r"q.parquet:row 1: is in none of the accepted forms \(fields seen: \['answer', 'question'\]\).*Alpaca.*ShareGPT"):
        data.read_source(tmp_path / "q.parquet")
    with pytest.raises(data.DataError, match=r"speaker\(s\) \['robot'\]"):
        data.read_source(write(tmp_path, [{"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]}]))


def test_sources_mix_by_weight_and_the_eval_split_is_held_out(tmp_path):
    from tests.conftest import write_config

    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"a{i}", "completion": f"x{i}"}) + "\n" for i in range(10)))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"prompt": f"b{i}", "completion": f"y{i}"}) + "\n" for i in range(10)))
    cfg = load_config(write_config(tmp_path, data={"train_file": None, "eval_file": None, "eval_split": 0.2,
                                                   "sources": [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}]},
                                   smoke={"check": "stops"}))
    mixed = data.mixed(cfg)
    assert sum(s.id.startswith(str(a)) for s in mixed) == 20 and sum(s.id.startswith(str(b)) for s in mixed) == 5
    assert [s.id for s in data.mixed(cfg)] == [s.id for s in mixed]  # seeded
    train, held = data.train_samples(cfg), data.eval_samples(cfg)
    assert len(held) == 5 and len(train) == 20
    # a partition of the mix: every mixed position in exactly one of the two (a source taken twice is two positions)
    assert Counter(s.id for s in train) + Counter(s.id for s in held) == Counter(s.id for s in mixed)
    assert data.held_out(cfg, 3) == held[:3]
    assert set(data.input_files(cfg)) == {a, b}


def test_the_training_set_is_tokenized_once_per_content_in_parallel_and_memory_mapped(tmp_path, tokenizer):
    from tests.conftest import write_config

    train = tmp_path / "t.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Translate to French: red cat {i % 7}", "completion": "rouge chat"}) + "\n"
                             for i in range(30)))
    cfg = load_config(write_config(tmp_path, data={"train_file": str(train), "num_proc": 2}))
    first = data.training_set(cfg, tokenizer)
    assert not first.cached and len(first.lengths) == 30
    again = data.training_set(cfg, tokenizer)
    assert again.cached and again.cache_dir == first.cache_dir and again.lengths == first.lengths
    # read from Arrow files in the cache, memory-mapped, not copied into this process
    assert again.rows.cache_files and all(f["filename"].startswith(str(first.cache_dir)) for f in again.rows.cache_files)
    serial = data.training_set(cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_proc": 1})}), tokenizer,
                               cache_root=tmp_path / "serial")
    ref = data.tokenize(data.read_source(train), tokenizer, cfg.data.max_length, "error")
    assert [r["input_ids"] for r in serial.rows] == [r["input_ids"] for r in first.rows] == ref.input_ids
    assert [r["labels"] for r in first.rows] == ref.labels and first.ids == ref.ids
    train.write_text(train.read_text() + json.dumps({"prompt": "one more", "completion": "encore"}) + "\n")
    changed = data.training_set(cfg, tokenizer)
    assert not changed.cached and changed.cache_dir != first.cache_dir and len(changed.lengths) == 31


def test_a_source_is_parsed_once_while_its_files_stay_the_same(tmp_path):
    """The stages of one run each ask for the samples: parsed once per content, read again once the file changes."""
    p = write(tmp_path, [{"prompt": "a", "completion": "b"}])
    first = data.read_source(p)
    again = data.read_source(p)
    assert again == first and again is not first and again[0] is first[0]   # the cached samples, in a list of its own
    again.clear()
    assert len(data.read_source(p)) == 1   # a caller's list is its own
    write(tmp_path, [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}])
    assert [s.answer for s in data.read_source(p)] == ["b", "d"]
    p.write_text("not json\n")
    with pytest.raises(data.DataError, match="d.jsonl:1"):
        data.read_source(p)
