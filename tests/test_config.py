"""The config schema: strict, every problem at once, each with the fix."""

from __future__ import annotations

import pytest
import yaml

from stages import inputs
from stages.config import ConfigError, load_config
from tests.conftest import DEFAULT, write_config


def test_default_config_loads():
    cfg = load_config(DEFAULT)
    assert cfg.export.quant_types == ["Q4_K_M", "Q5_K_S"]
    assert cfg.lora.r == 16 and cfg.quantization.load_in_4bit is False


def test_unknown_keys_name_the_nearest_valid_one(tmp_path):
    path = write_config(tmp_path, training={"learning_rte": 1e-3}, lora={"lora_alpah": 8})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "training.learning_rte: unknown key; did you mean `learning_rate`?" in msg
    assert "lora.lora_alpah: unknown key; did you mean `lora_alpha`?" in msg  # both reported at once


def test_unknown_section_and_wrong_type(tmp_path):
    path = write_config(tmp_path, trainng={"max_steps": 3}, lora={"r": "sixteen"})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "trainng: unknown key; did you mean `training`?" in str(e.value)
    assert "lora.r:" in str(e.value) and "'sixteen'" in str(e.value)


def test_missing_model_path_says_how_to_fix(tmp_path):
    path = write_config(tmp_path, model={"name_or_path": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"model.name_or_path: .*nope.* is neither a local directory nor a model in the HF cache"):
        inputs.load(path)


def test_model_dir_without_safetensors_is_refused(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    path = write_config(tmp_path, model={"name_or_path": str(d)})
    with pytest.raises(ConfigError, match="only safetensors are loaded"):
        inputs.load(path)


def test_missing_data_file(tmp_path):
    path = write_config(tmp_path, data={"train_file": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ConfigError, match=r"data.train_file: .*missing.jsonl does not exist"):
        inputs.load(path)
    assert load_config(path).data.train_file.name == "missing.jsonl"   # the schema alone reads no input


def test_unknown_quant_type(tmp_path):
    path = write_config(tmp_path, export={"quant_types": ["Q4_K_M", "Q3_XYZ"]})
    with pytest.raises(ConfigError, match=r"unknown quant type\(s\) \['Q3_XYZ'\]"):
        load_config(path)


def test_overrides_are_parsed_as_yaml_and_validated(tmp_path):
    path = write_config(tmp_path)
    cfg = load_config(path, ["training.max_steps=7", "lora.target_modules=[q_proj, v_proj]"])
    assert cfg.training.max_steps == 7 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="training.max_stepz: unknown key; did you mean `max_steps`"):
        load_config(path, ["training.max_stepz=7"])
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(path, ["max_steps"])


def test_config_file_must_exist_and_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_docs_config_reference_is_the_generated_one():
    from stages.config import reference_markdown
    from tests.conftest import REPO

    assert reference_markdown() in (REPO / "docs" / "config.md").read_text(), "regenerate with `python -m stages.config --update-docs`"


def test_example_configs_are_schema_valid():
    from stages.config import RunConfig
    from tests.conftest import REPO

    for path in (REPO / "configs").glob("*.yaml"):
        RunConfig.model_validate(yaml.safe_load(path.read_text()))  # inputs may live elsewhere


def test_bare_on_and_off_in_yaml_mean_the_words(tmp_path):
    """YAML 1.1 reads `packing: off` as false: the switch settings take it as `off`, as written."""
    path = write_config(tmp_path)
    text = path.read_text().replace("packing: auto", "packing: off\n  tiled_mlp: on")
    assert "packing: off" in text
    path.write_text(text)
    t = load_config(path).training
    assert (t.packing, t.tiled_mlp) == ("off", "on")
    assert load_config(write_config(tmp_path), ["training.offload_embeddings=off"]).training.offload_embeddings == "off"
