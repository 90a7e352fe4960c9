"""The analytic preflight model, the dataset scan, the verdict and the fixes (CPU)."""

from __future__ import annotations

import json

import pytest

from stages import data, preflight
from stages.config import ConfigError, RunConfig, load_config
from stages.model.load import load_tokenizer
from stages.train import memory_model
from tests.conftest import REPO, write_config

TOY = {"model_type": "llama", "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
       "num_attention_heads": 2, "num_key_value_heads": 1}
QWEN7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
          "num_attention_heads": 28, "num_key_value_heads": 4}


def cfg(**sections) -> RunConfig:
    raw = {"model": {"name_or_path": "x", "torch_dtype": "bfloat16"}, "data": {"train_file": "x"}, "handoff": {"model_name": "t"},
           "lora": {"r": 2, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0},
           "training": {"per_device_train_batch_size": 1, "gradient_checkpointing": True, "cross_entropy": "plain",
                        # the recipe the estimate's coefficients were fitted on (bench/gpu_figure/preflight_grid.py's grid, in git history at 72c6a44)
                        "offload_activations": "off", "offload_embeddings": "off", "tiled_mlp": "off", "optim": "adamw_torch",
                        "packing": "off"}}
    for k, v in sections.items():
        raw[k] = raw.get(k, {}) | v
    return RunConfig.model_validate(raw)


def items(est: memory_model.Estimate, prefix: str) -> float:
    return next(v for k, v in est.items_bytes.items() if k.startswith(prefix))


def test_weights_and_adapters_match_hand_arithmetic():
    s = memory_model.Shapes.from_config(TOY)
    est = memory_model.estimate(cfg(), s, longest=10, on_gpu=True)
    # linear: per layer q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate/up/down 3x8x16 = 576, x2 layers;
    # embeddings + lm_head 2x100x8 + norms 5x8 = 1640; bf16: 2 bytes each
    assert items(est, "base weights") == (1152 + 1640) * 2
    # LoRA r=2: q 2x(8+8) + v 2x(8+4) = 56 per layer, x2 = 112 params; fp32 weight 4 + grad 4 + AdamW 8
    assert items(est, "LoRA") == 112 * 16
    # checkpointing keeps every layer's input: 2 layers x 10 tokens x 8 x 2 bytes
    assert items(est, "activations kept") == 2 * 10 * 8 * 2
    nf4 = memory_model.estimate(cfg(quantization={"load_in_4bit": True}), s, longest=10, on_gpu=True)
    assert items(nf4, "base weights") == pytest.approx(1152 * memory_model.NF4_BYTES[True] + 1640 * 2)
    # bitsandbytes keeps 32-bit states for tensors under 4096 elements: the toy's adapters stay at 8 bytes
    paged = memory_model.estimate(cfg(training={"optim": "paged_adamw_8bit"}), s, longest=10, on_gpu=True)
    assert items(paged, "LoRA") == 112 * 16


def test_optimizer_states_are_counted_where_bitsandbytes_puts_them():
    """R7 r=64 q/v/o: every adapter matrix has >= 1e5 elements, so the paged 8-bit states sit in
    CUDA managed memory (outside torch's allocator, evictable); unpaged 8-bit: 2 bytes + absmax."""
    s = memory_model.Shapes.from_config(QWEN7B)
    qvo = {"r": 64, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    params = 28 * 64 * ((3584 + 3584) + (3584 + 512) + (3584 + 3584))
    paged = memory_model.estimate(cfg(lora=qvo, training={"optim": "paged_adamw_8bit"}), s, 1024, True)
    small = 28 * 512 * 64  # v_proj's lora_B (512 x 64) is under 1e5 elements: its 8-bit states stay in torch's memory
    assert items(paged, "LoRA") == pytest.approx(params * 8 + small * (2 + 8 / 256))
    assert "GiB more states paged outside torch" in next(k for k in paged.items_gib if k.startswith("LoRA"))
    unpaged = memory_model.estimate(cfg(lora=qvo, training={"optim": "adamw_8bit"}), s, 1024, True)
    assert items(unpaged, "LoRA") == pytest.approx(params * (8 + 2 + 8 / 256))
    torch_adamw = memory_model.estimate(cfg(lora=qvo, training={"optim": "adamw_torch"}), s, 1024, True)
    assert items(torch_adamw, "LoRA") == params * 16


def test_gpu_defaults_are_modelled():
    """fit: memory on a GPU: the input table and the checkpointed layer inputs live in host memory, 8-bit AdamW."""
    s = memory_model.Shapes.from_config(TOY)
    auto = {"offload_activations": "auto", "offload_embeddings": "auto", "tiled_mlp": "auto", "optim": "auto"}
    est = memory_model.estimate(cfg(training=auto), s, longest=10, on_gpu=True)
    assert items(est, "base weights") == (1152 + 1640 - 100 * 8) * 2  # minus the 100 x 8 input embedding
    assert items(est, "LoRA") == 112 * 16  # 8-bit AdamW, but 32-bit states below 4096 elements
    tied = memory_model.Shapes.from_config(TOY | {"tie_word_embeddings": True})
    # a table tied to lm_head stays on the GPU, once
    assert items(memory_model.estimate(cfg(training=auto), tied, longest=10, on_gpu=True), "base weights") == (1152 + 100 * 8 + 5 * 8) * 2
    # 2 layers' inputs at most stay on the GPU (in use, prefetched) instead of all 28 of a 7B
    r7 = memory_model.Shapes.from_config(QWEN7B)
    on = items(memory_model.estimate(cfg(training=auto), r7, longest=4096, on_gpu=True), "activations kept")
    off = items(memory_model.estimate(cfg(), r7, longest=4096, on_gpu=True), "activations kept")
    assert on == 2 * 4096 * 3584 * 2 and off == 28 * 4096 * 3584 * 2
    cpu = memory_model.estimate(cfg(training=auto), s, longest=10, on_gpu=False)
    # bfloat16 as configured, nothing offloaded on CPU, no allocator or cuBLAS figures
    assert items(cpu, "base weights") == (1152 + 1640) * 2 and items(cpu, "LoRA") == 112 * 16
    assert items(cpu, "allocator") == 0 and items(cpu, "cuBLAS") == 0
    # `auto` dtype: bf16 when estimating for a GPU even from a CPU-only laptop, fp32 for a CPU run
    auto_dtype = cfg(training=auto).model_copy(update={"model": cfg().model.model_copy(update={"torch_dtype": "auto"})})
    assert items(memory_model.estimate(auto_dtype, s, 10, on_gpu=True), "base weights") == (1152 + 1640 - 800) * 2
    assert items(memory_model.estimate(auto_dtype, s, 10, on_gpu=False), "base weights") == (1152 + 1640) * 4


def test_the_tiled_mlp_stops_the_intermediate_activations_growing_with_context():
    s = memory_model.Shapes.from_config(QWEN7B)
    auto = {"tiled_mlp": "auto", "optim": "auto", "offload_activations": "auto", "offload_embeddings": "auto", "cross_entropy": "chunked"}

    def peak(seq: int) -> float:
        c = cfg(training=auto, data={"train_file": "x", "max_length": seq})
        return items(memory_model.estimate(c, s, seq, on_gpu=True), "peak moment")

    # untiled below 32k tokens per micro-batch: x2 tokens, x2 the layer's working set; tiled above: grows with
    # the hidden-sized tensors only, so 64k costs far less than twice 32k's untiled equivalent would
    assert peak(16384) == pytest.approx(2 * peak(8192), rel=0.02)
    assert peak(65536) < 2.1 * peak(32768) and peak(32768) < 1.5 * peak(16384)


def test_r7_weights_match_the_anchor_measurements():
    """Anchors: R7 bf16 loads at 14.23 GiB allocated, NF4 + double quant at 5.24 GiB."""
    s = memory_model.Shapes.from_config(QWEN7B)
    bf16 = items(memory_model.estimate(cfg(), s, 4096, True), "base weights") / preflight.GIB
    nf4 = items(memory_model.estimate(cfg(quantization={"load_in_4bit": True}), s, 4096, True), "base weights") / preflight.GIB
    assert bf16 == pytest.approx(14.23, rel=0.01)
    assert nf4 == pytest.approx(5.24, rel=0.03)


@pytest.mark.parametrize("change", [
    {"seq": 2048}, {"training": {"per_device_train_batch_size": 2}}, {"lora": {"r": 64}},
    {"lora": {"target_modules": "all-linear"}}, {"training": {"gradient_checkpointing": False}},
    {"training": {"cross_entropy": "plain"}},
])
def test_estimate_grows_with_what_costs_memory(change):
    s = memory_model.Shapes.from_config(QWEN7B)
    base = {"training": {"cross_entropy": "chunked"}}
    change = dict(change)
    seq = change.pop("seq", 1024)
    sections = {k: base.get(k, {}) | change.get(k, {}) for k in base | change}
    if change.get("training", {}).get("cross_entropy") == "plain":
        sections["training"]["cross_entropy"] = "plain"
    assert memory_model.estimate(cfg(**sections), s, seq, True).total_gib > memory_model.estimate(cfg(**base), s, 1024, True).total_gib


def test_chunked_loss_saves_the_logits_at_152k_vocab():
    s = memory_model.Shapes.from_config(QWEN7B)
    c2 = {"per_device_train_batch_size": 2}
    plain = memory_model.estimate(cfg(training=c2 | {"cross_entropy": "plain"}), s, 4096, True).total_gib
    chunked = memory_model.estimate(cfg(training=c2 | {"cross_entropy": "chunked"}), s, 4096, True).total_gib
    assert plain - chunked > 10  # anchors: 11.5 GiB at 2 x 4096


def test_unknown_architecture_is_estimated_where_possible_and_says_what_not():
    gpt = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12}
    s = memory_model.Shapes.from_config(gpt)
    assert (s.hidden, s.layers, s.heads, s.intermediate) == (768, 12, 12, 4 * 768)
    assert any("GPT2LMHeadModel" in n and "trust the GPU probe" in n for n in s.unknown)
    assert any("intermediate_size" in n for n in s.unknown)
    assert memory_model.estimate(cfg(), s, 512, True).total_gib > 0


def test_fixes_are_ranked_by_saving_and_the_least_invasive_fitting_one_is_chosen():
    s = memory_model.Shapes.from_config(QWEN7B)
    c = cfg(training={"per_device_train_batch_size": 2, "cross_entropy": "plain"}, lora={"r": 64, "target_modules": ["q_proj", "v_proj", "o_proj"]})
    scan = preflight.LengthScan(100, 800, 1000, 1024, 4096, "x:1", [], [], 2 * 4096)
    sug = preflight.suggest(c, s, scan, usable=23.0, on_gpu=True)
    assert [x["saving_gib"] for x in sug] == sorted((x["saving_gib"] for x in sug), reverse=True)
    best = preflight.smallest_fix(sug)
    assert best["overrides"] == ['training.cross_entropy="chunked"']  # same maths, only the loss is chunked
    assert "cross_entropy: \"chunked\"  # was \"plain\"" in best["diff"]
    # with chunked loss already on, a 10 GiB card needs QLoRA, not a change to the data
    tight = preflight.suggest(cfg(training={"cross_entropy": "chunked", "per_device_train_batch_size": 1}), s, scan, usable=12.0, on_gpu=True)
    assert preflight.smallest_fix(tight)["overrides"] == ["quantization.load_in_4bit=true"]


def test_a_fix_that_changes_nothing_is_never_offered():
    """optim: auto already resolves to paged 8-bit AdamW on a GPU (fit: memory), cross_entropy: auto to chunked."""
    s = memory_model.Shapes.from_config(QWEN7B)
    auto = cfg(training={"optim": "auto", "cross_entropy": "auto", "per_device_train_batch_size": 2}, lora={"r": 64})
    scan = preflight.LengthScan(100, 800, 1000, 1024, 4096, "x:1", [], [], 2 * 4096)
    changes = [x["change"] for x in preflight.suggest(auto, s, scan, usable=5.0, on_gpu=True)]
    assert changes and not any("optim" in c or "cross_entropy" in c for c in changes), changes
    assert all(x["saving_gib"] > 0 for x in preflight.suggest(auto, s, scan, usable=5.0, on_gpu=True))
    # where the setting is not already that, it is offered
    torch_adamw = cfg(training={"optim": "adamw_torch", "cross_entropy": "plain", "per_device_train_batch_size": 2}, lora={"r": 64})
    changes = [x["change"] for x in preflight.suggest(torch_adamw, s, scan, usable=5.0, on_gpu=True)]
    assert 'training.optim="paged_adamw_8bit"' in changes and 'training.cross_entropy="chunked"' in changes


def test_the_report_leads_with_the_verdict_and_what_decided_it(tmp_path):
    c = load_config(write_config(tmp_path))
    ok = preflight.run(c, tmp_path / "ok")
    first = (tmp_path / "ok" / "preflight.md").read_text().splitlines()[0]
    assert first.startswith("## Preflight: FITS, estimated: ") and "no CUDA device here to measure on" in first
    est = memory_model.estimate(c, memory_model.Shapes.from_config(TOY), 22, on_gpu=False)
    lengths = ok.lengths
    probed = preflight.PreflightResult(True, "NVIDIA H200", 24.0, 21.15, est, lengths, [], tmp_path / "x.md",
                                       probe=preflight.ProbeResult(True, 9.25, 8.61, 21.15, [4096, 4095]))
    line = preflight.headline(probed, c)
    assert line.startswith("Preflight: FITS, measured: two real optimizer steps") and "8.61 GiB allocated / 9.25 GiB reserved" in line
    assert "21.15 GiB cap" in line and line.index("measured") < line.index("estimate")
    oom = preflight.PreflightResult(False, "NVIDIA H200", 24.0, 21.15, est, lengths, [], tmp_path / "x.md",
                                    probe=preflight.ProbeResult(False, 21.1, 20.9, 21.15, [4096, 4095], error="CUDA out of memory"))
    assert preflight.headline(oom, c).startswith("Preflight: DOES NOT FIT, measured: two real optimizer steps on the worst micro-batch ran out")
    # with the descent's figure, the verdict is the need measured on this GPU: the step's need scaled for the whole run
    stepped = preflight.ProbeResult(True, 9.25, 8.61, 21.15, [4096, 4095], pages_gib=9.1, build_pages_gib=6.0, step_need_gib=8.9)
    need = preflight.PreflightResult(True, "NVIDIA H200", 24.0, 21.15, est, lengths, [], tmp_path / "x.md", probe=stepped)
    assert need.need_gib == round(8.9 * preflight.NEED_SCALE + preflight.NEED_PLUS_GIB, 4)
    line = preflight.headline(need, c)
    assert line.startswith(f"Preflight: FITS, measured: this run needs {need.need_gib:.2f} GiB") and "8.90 GiB cap and no lower" in line
    # a model build that touches more pages than the steps need decides instead
    heavy = preflight.ProbeResult(True, 9.25, 8.61, 21.15, [4096], pages_gib=9.1, build_pages_gib=12.0, step_need_gib=8.9)
    assert preflight.PreflightResult.need_of(heavy) == 12.0


def test_scan_reports_percentiles_and_worst_batch(tmp_path):
    c = load_config(write_config(tmp_path))
    scan = preflight.scan_lengths(c)
    assert scan.n_samples == 2000 and scan.p50 <= scan.p95 <= scan.p99 <= scan.max == 22
    assert scan.worst_batch_tokens == 32 * 22 and scan.longest_id.endswith("translate_train.jsonl:2")


@pytest.mark.parametrize("packing, fix", [("off", "training.per_device_train_batch_size=16"), ("on", "training.max_tokens_per_batch=352")])
def test_run_writes_report_and_refuses_with_the_fix(tmp_path, packing, fix):
    c = load_config(write_config(tmp_path, training={"packing": packing}))
    ok = preflight.run(c, tmp_path / "ok")
    assert ok.fits and (tmp_path / "ok" / "preflight.md").read_text().startswith("## Preflight: FITS, estimated")
    assert json.loads((tmp_path / "ok" / "preflight.json").read_text())["lengths"]["max"] == 22
    with pytest.raises(preflight.PreflightError, match=r"(?s)smallest change that fits: .*--set " + fix):
        preflight.run(c, tmp_path / "tight", gpu_memory_gib=0.02)


def test_budget_below_the_weights_alone_says_so_in_one_line(tmp_path):
    c = load_config(write_config(tmp_path))
    with pytest.raises(preflight.PreflightError) as e:
        preflight.run(c, tmp_path / "p", gpu_memory_gib=0.005)
    assert str(e.value).startswith("the base weights alone need 0.01 GiB") and "\n" not in str(e.value)


def test_a_sample_the_template_cannot_render_is_named(tmp_path):
    c = load_config(write_config(tmp_path))
    tok = load_tokenizer(c.model)
    tok.chat_template = "{% if 'boom' in messages[0]['content'] %}{{ raise_exception('unsupported') }}{% endif %}" + tok.chat_template
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "fine", "completion": "ok"}) + "\n" + json.dumps({"prompt": "boom", "completion": "x"}) + "\n")
    with pytest.raises(data.DataError, match=r"d.jsonl:2: the tokenizer or chat template failed on this sample: .*unsupported"):
        data.tokenize(data.read_jsonl(f), tok, 64, "error")


def test_an_eval_sample_longer_than_every_training_one_sizes_the_worst_step(tmp_path):
    """Eval runs training's micro-batch shape forward only; padded, its longest sample can make the widest
    micro-batch of the run, so the estimate is sized by it. Packed, the budget must hold it."""
    long = {"messages": [{"role": "user", "content": "Translate to French: " + " ".join(["red cat house"] * 5)},
                         {"role": "assistant", "content": " ".join(["rouge chat maison"] * 5)}]}
    ev = tmp_path / "eval.jsonl"
    ev.write_text((REPO / "assets/data/translate_eval.jsonl").read_text() + json.dumps(long) + "\n")
    c = load_config(write_config(tmp_path, data={"eval_file": str(ev)}, training={"packing": "off"}))
    r = preflight.run(c, tmp_path / "p")
    assert r.lengths.max > 22 and r.lengths.longest_id == f"{ev}:101 (eval)"
    assert r.lengths.worst_batch_tokens == 32 * r.lengths.max
    without = preflight.run(load_config(write_config(tmp_path, training={"packing": "off"})), tmp_path / "q")
    assert without.lengths.max == 22 and r.estimate.total_gib > without.estimate.total_gib
    packed = load_config(write_config(tmp_path, data={"eval_file": str(ev)}, training={"packing": "on", "max_tokens_per_batch": 30}))
    with pytest.raises(ConfigError, match=rf"shorter than the longest eval sample \({r.lengths.max} tokens, {ev}:101\); set it to at least"):
        preflight.run(packed, tmp_path / "r")
