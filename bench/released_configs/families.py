"""Which decoder families (MoE and dense) the pipeline breaks on, beyond tests/test_families.py's.

    python bench/released_configs/families.py FAMILY         # one family, in this process: one JSON line on stdout
    python bench/released_configs/families.py all --out F.json  # every family in NEW, each in its own subprocess (timeout)

A tiny random-init model per family is built with tests.test_families.tiny_model (its FAMILIES/SHAPE extended by
NEW below) and run through preflight -> train -> merge -> export -> smoke with tests.test_families._config, i.e. the
product functions with the families test's own settings. CPU only, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MOE = dict(num_experts_per_tok=2)
DROP = object()   # a SHAPE key this family's config must not get
PHI3_TOKENS = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
GLM_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]   # _set_vocab_glm looks these up
# Keys starting with "_" are the sweep's own: _tokenizer_json (save tokenizer.json beside tokenizer.model, as
# tests/test_families.py does for WITH_TOKENIZER_JSON), _tokens (special tokens the family's tokenizer has),
# _patch (merged into the saved config.json, as the family's release writes it), _model (cfg.model overrides).

# family -> (tokenizer asset, config extras beyond tests.test_families.SHAPE; a value DROP removes a SHAPE key)
NEW: dict[str, tuple[str, dict]] = {
    # --- mixture of experts ---
    "qwen2_moe": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                      num_experts=4, **MOE)),
    "gpt_oss": ("tiny-chatml", dict(intermediate_size=256, num_local_experts=4, sliding_window=128,
                                    layer_types=["sliding_attention", "full_attention"], **MOE)),
    # q_lora_rank set (DeepSeek-V2 proper): llama.cpp takes a deepseek2 GGUF without q_lora_rank for V2-Lite only
    # when it has 26 or 27 layers (src/models/deepseek2.cpp is_lite), so a 2-layer Lite-shaped model cannot quantize
    "deepseek_v2": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1,
                                        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                                        v_head_dim=32, head_dim=32, num_key_value_heads=4, first_k_dense_replace=0,
                                        topk_method="greedy", n_group=1, topk_group=1, **MOE)),
    "deepseek_v3": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1,
                                        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                                        v_head_dim=32, head_dim=32, num_key_value_heads=4, first_k_dense_replace=0,
                                        n_group=1, topk_group=1, num_nextn_predict_layers=0, **MOE)),
    # Phi-3.5-MoE's config.json names the architecture PhiMoEForCausalLM (its remote code's class), as the converter does
    "phimoe": ("tiny-llama", dict(intermediate_size=256, num_local_experts=4, lm_head_bias=True, attention_bias=True, **MOE,
                                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, original_max_position_embeddings=1024),
                                  _tokenizer_json=True, _tokens=PHI3_TOKENS, _patch={"architectures": ["PhiMoEForCausalLM"]})),
    "glm4_moe": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1,
                                     first_k_dense_replace=0, n_group=1, topk_group=1, num_nextn_predict_layers=0,
                                     _tokens=GLM_TOKENS, **MOE)),
    # Hunyuan-A13B's config.json: per-layer lists, as the converter reads them
    "hunyuan_v1_moe": ("tiny-chatml", dict(intermediate_size=256, num_experts=4, moe_topk=[2, 2], num_shared_expert=[1, 1],
                                           moe_intermediate_size=[256, 256], use_qk_norm=True, eod_token_id=2)),
    # transformers reads ernie4_5(_moe) / nemotron with TokenizersBackend (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): tokenizer.json
    # llama.cpp: the shared experts' width is intermediate_size // kv_heads
    "ernie4_5_moe": ("tiny-llama", dict(_tokenizer_json=True, intermediate_size=512, moe_intermediate_size=128, moe_num_experts=4, moe_k=2,
                                         moe_num_shared_experts=2, moe_layer_start_index=0, moe_layer_end_index=1)),
    # llama.cpp's dots1 has no GQA (its releases have as many KV heads as query heads)
    "dots1": ("tiny-chatml", dict(intermediate_size=512, num_key_value_heads=4, scoring_func="sigmoid",
                                  moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1,
                                  first_k_dense_replace=0, n_group=1, topk_group=1, **MOE)),
    # llama.cpp's llama4 hard-codes 3 chunked layers then 1 full (load_swa_pattern(ml, 4)): 4 layers, as the releases' pattern
    "llama4_text": ("tiny-chatml", dict(intermediate_size=256, intermediate_size_mlp=512, num_local_experts=4,
                                        num_experts_per_tok=1, moe_layers=[0, 1, 2, 3], interleave_moe_layer_step=1,
                                        num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], attention_chunk_size=128,
                                        layer_types=["chunked_attention"] * 3 + ["full_attention"])),
    "minimax": ("tiny-chatml", dict(intermediate_size=256, num_local_experts=4,
                                    layer_types=["linear_attention", "full_attention"], **MOE)),
    # scoring_func: the releases' config.json names the router's gating (the converter writes expert_gating_func from it;
    # without it llama.cpp aborts in build_moe_ffn, llama-graph.cpp:2072)
    "minimax_m2": ("tiny-chatml", dict(intermediate_size=256, num_local_experts=4, rotary_dim=64, scoring_func="sigmoid", **MOE)),
    "flex_olmo": ("tiny-chatml", dict(intermediate_size=256, num_experts=4, num_key_value_heads=4, **MOE)),
    "qwen3_next": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                       num_experts=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                       linear_num_key_heads=2, linear_num_value_heads=4,
                                       layer_types=["linear_attention", "full_attention"], **MOE)),
    "jamba": ("tiny-llama", dict(_tokenizer_json=True, intermediate_size=256, num_experts=4, expert_layer_period=2, expert_layer_offset=1,
                                 attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=16,
                                 use_mamba_kernels=False, head_dim=DROP, **MOE)),
    "dbrx": ("tiny-chatml", dict(d_model=256, n_heads=4, n_layers=2, max_seq_len=1024,
                                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                 ffn_config=dict(ffn_hidden_size=256, moe_num_experts=4, moe_top_k=2),
                                 hidden_size=DROP, num_hidden_layers=DROP, num_attention_heads=DROP,
                                 num_key_value_heads=DROP, head_dim=DROP, max_position_embeddings=DROP)),
    "granitemoeshared": ("tiny-chatml", dict(intermediate_size=256, num_local_experts=4, shared_intermediate_size=256, **MOE)),
    "lfm2_moe": ("tiny-chatml", dict(intermediate_size=512, tie_word_embeddings=True, moe_intermediate_size=128, num_experts=4, num_dense_layers=0,
                                     layer_types=["conv", "full_attention"], **MOE)),
    "glm4_moe_lite": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, n_routed_experts=4,
                                          n_shared_experts=1, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                                          qk_rope_head_dim=32, v_head_dim=32, head_dim=32, num_key_value_heads=4,
                                          n_group=1, topk_group=1, mlp_layer_types=["sparse", "sparse"],
                                          num_nextn_predict_layers=0, _tokens=GLM_TOKENS, **MOE)),
    "afmoe": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, num_experts=4, num_shared_experts=1,
                                  num_dense_layers=0, sliding_window=128, global_attn_every_n_layers=2,
                                  layer_types=["sliding_attention", "full_attention"], **MOE)),
    "exaone_moe": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, num_experts=4, num_shared_experts=1,
                                       first_k_dense_replace=0, mlp_layer_types=["sparse", "sparse"], sliding_window=128,
                                       layer_types=["sliding_attention", "full_attention"], n_group=1, topk_group=1,
                                       scoring_func="sigmoid", **MOE)),
    # --- dense ---
    "gemma": ("tiny-llama", dict(intermediate_size=512)),
    "phi": ("tiny-chatml", dict(intermediate_size=1024, head_dim=DROP, num_key_value_heads=4)),   # phi-2: no GQA, n_ff = 4 x hidden
    "stablelm": ("tiny-chatml", dict(intermediate_size=512, head_dim=DROP)),
    "starcoder2": ("tiny-chatml", dict(intermediate_size=512, head_dim=DROP)),
    "cohere": ("tiny-chatml", dict(intermediate_size=512, head_dim=DROP, tie_word_embeddings=True)),
    "cohere2": ("tiny-chatml", dict(intermediate_size=512, sliding_window=128, tie_word_embeddings=True, rotary_pct=1.0,
                                    layer_types=["sliding_attention", "full_attention"])),
    "exaone4": ("tiny-chatml", dict(intermediate_size=512, sliding_window=128,
                                    layer_types=["sliding_attention", "full_attention"])),
    "glm4": ("tiny-chatml", dict(intermediate_size=512, _tokens=GLM_TOKENS)),
    "glm": ("tiny-chatml", dict(intermediate_size=512, _tokens=GLM_TOKENS)),
    "olmo": ("tiny-chatml", dict(intermediate_size=512, head_dim=DROP)),
    "olmo3": ("tiny-chatml", dict(intermediate_size=512, sliding_window=128,
                                  layer_types=["sliding_attention", "full_attention"])),
    "falcon": ("tiny-chatml", dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=1024,
                                   num_key_value_heads=DROP, head_dim=DROP)),
    "ernie4_5": ("tiny-llama", dict(intermediate_size=512, _tokenizer_json=True)),
    "hunyuan_v1_dense": ("tiny-chatml", dict(intermediate_size=512, eod_token_id=2)),
    "seed_oss": ("tiny-chatml", dict(intermediate_size=512)),
    "apertus": ("tiny-chatml", dict(intermediate_size=512)),
    "arcee": ("tiny-chatml", dict(intermediate_size=512)),
    "nemotron": ("tiny-llama", dict(intermediate_size=512, _tokenizer_json=True)),
}
MOE_NEW = {"qwen2_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "phimoe", "glm4_moe", "hunyuan_v1_moe", "ernie4_5_moe", "dots1",
           "llama4_text", "minimax", "minimax_m2", "flex_olmo", "qwen3_next", "jamba", "dbrx", "granitemoeshared", "lfm2_moe",
           "glm4_moe_lite", "afmoe", "exaone_moe"}
STAGES = ("build", "preflight", "train", "merge", "export", "smoke")


def _innermost_repo_frame(tb) -> str | None:
    frames = traceback.extract_tb(tb)
    repo = [f for f in frames if f.filename.startswith(str(REPO)) and "/.venv/" not in f.filename
            and "/bench/released_configs/families.py" not in f.filename and "/tests/" not in f.filename]
    f = repo[-1] if repo else None
    return f"{Path(f.filename).relative_to(REPO)}:{f.lineno} ({f.name})" if f else None


def _innermost_frame(tb) -> str | None:
    frames = traceback.extract_tb(tb)
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else None


def build(family: str, out: Path) -> tuple[Path, str]:
    """tests.test_families.tiny_model with the hooks in NEW (its FAMILIES / SHAPE used as they are)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests import test_families as tf

    asset, extra = NEW[family]
    model_type = family.split("@")[0]
    hooks = {k: v for k, v in extra.items() if k.startswith("_")}
    extra = {k: v for k, v in extra.items() if not k.startswith("_")}
    if not hooks.get("_tokenizer_json") and not hooks.get("_tokens"):   # the test's own builder, unchanged
        tf.FAMILIES[model_type] = (asset, {k: v for k, v in extra.items() if v is not DROP})
        saved = tf.SHAPE
        tf.SHAPE = {k: v for k, v in saved.items() if extra.get(k) is not DROP}
        try:
            model_dir, asset = tf.tiny_model(model_type, out)
        finally:
            tf.SHAPE = saved
    else:   # the same steps, with the family's released tokenizer files / special tokens
        src = tf.REPO / "assets" / asset
        out.mkdir(parents=True)
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
                shutil.copy(f, out / f.name)
        tok = AutoTokenizer.from_pretrained(src)
        if hooks.get("_tokens"):
            tok.add_special_tokens({"additional_special_tokens": hooks["_tokens"]})
        tok.save_pretrained(out)
        vocab = len(tok)
        tc = json.loads((out / "tokenizer_config.json").read_text())   # transformers 5 writes "add_prefix_space": null, which
        if "add_prefix_space" in tc and tc["add_prefix_space"] is None:  # ERNIE's converter turns into add_space_prefix=false;
            del tc["add_prefix_space"]                                    # a release's tokenizer_config has no such null
            (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
        if model_type.startswith("gemma"):
            tc = json.loads((out / "tokenizer_config.json").read_text())
            (out / "tokenizer_config.json").write_text(json.dumps(tc | {"legacy": False}))
        ids = json.loads((src / "config.json").read_text())
        special = {k: ids[k] for k in ("bos_token_id", "eos_token_id") if ids.get(k) is not None}
        shape = {k: v for k, v in tf.SHAPE.items() if extra.get(k) is not DROP} | {k: v for k, v in extra.items() if k in tf.SHAPE and v is not DROP}
        config = AutoConfig.for_model(model_type, **shape, **{k: v for k, v in extra.items() if k not in tf.SHAPE},
                                      vocab_size=vocab, pad_token_id=ids.get("pad_token_id") or 0, **special)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        model_dir = out
    if hooks.get("_patch"):
        cfg = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(cfg | hooks["_patch"], indent=2))
    return model_dir, asset


def run_one(family: str, work: Path) -> dict:
    import shutil

    import torch
    torch.set_num_threads(1)
    from stages import merge, preflight, smoke
    from stages.export import stage as export_stage
    from stages.train import stage as train_stage
    from tests import test_families as tf

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    t0 = time.time()
    rec: dict = {"family": family, "moe": family in MOE_NEW, "stage_reached": "build", "ok": False, "error": None}
    try:
        model_dir, asset = build(family, work / "model")
        cfg_json = json.loads((model_dir / "config.json").read_text())
        rec["architectures"] = cfg_json.get("architectures")
        cfg = tf._config(work, model_dir, asset)
        if model := NEW[family][1].get("_model"):
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=model)})
        rec["stage_reached"] = "preflight"
        pre = preflight.run(cfg, work / "preflight")
        rec["adapted"] = pre.adapted
        rec["stage_reached"] = "train"
        trained = train_stage.run(cfg, work / "train")
        rec["final_loss"] = trained.final_loss
        from safetensors.torch import load_file
        lora = load_file(trained.adapter_dir / "adapter_model.safetensors")
        rec["expert_lora_tensors"] = sum(1 for k in lora if ".experts." in k and "lora_B" in k)
        rec["expert_lora_trained"] = all(v.abs().sum() > 0 for k, v in lora.items() if ".experts." in k and "lora_B" in k)
        rec["stage_reached"] = "merge"
        merged = merge.run(cfg, trained.adapter_dir, work / "merge")
        rec["merged_architectures"] = json.loads((merged.merged_dir / "config.json").read_text()).get("architectures")
        rec["stage_reached"] = "export"
        exported = export_stage.run(cfg, merged.merged_dir, work / "export")
        rec["stage_reached"] = "smoke"
        smoked = smoke.run(cfg, [(f.quant, f.path) for f in exported.files], work / "smoke")
        rec["smoke"] = [f.quant for f in smoked.files]
        rec["stage_reached"] = "done"
        rec["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the sweep records every failure
        rec["error"] = {"type": f"{type(e).__module__}.{type(e).__name__}", "message": str(e)[:400],
                        "repo_frame": _innermost_repo_frame(e.__traceback__), "frame": _innermost_frame(e.__traceback__)}
        traceback.print_exc()
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def sweep(families: list[str], out: Path, timeout: int, logs: Path) -> list[dict]:
    results = []
    logs.mkdir(parents=True, exist_ok=True)
    for fam in families:
        t0 = time.time()
        log = logs / f"{fam}.log"
        with log.open("w") as fh:
            try:
                p = subprocess.run([sys.executable, __file__, fam, "--work", str(logs / fam)], stdout=subprocess.PIPE,
                                   stderr=fh, text=True, timeout=timeout, cwd=REPO)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{\"family\"")]
                fh.write("\n--- stdout ---\n" + p.stdout)
                rec = json.loads(lines[-1]) if lines else {
                    "family": fam, "stage_reached": "?", "ok": False,
                    "error": {"type": f"exit {p.returncode}", "message": p.stdout[-400:], "repo_frame": None}}
            except subprocess.TimeoutExpired as e:
                fh.write("\n--- stdout ---\n" + (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")))
                rec = {"family": fam, "stage_reached": "?", "ok": False,
                       "error": {"type": "timeout", "message": f"over {timeout} s", "repo_frame": None}}
        rec["seconds_total"] = round(time.time() - t0, 1)
        rec["log"] = str(log)
        print(json.dumps(rec), flush=True)
        results.append(rec)
        out.write_text(json.dumps(results, indent=1))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("family", help="a family of NEW, or 'all', or a comma list")
    ap.add_argument("--out", default="/tmp/moe_families.json")
    ap.add_argument("--work", default=None)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--logs", default="/tmp/moe_families")
    a = ap.parse_args()
    if a.family == "all" or "," in a.family:
        fams = list(NEW) if a.family == "all" else a.family.split(",")
        sweep(fams, Path(a.out), a.timeout, Path(a.logs))
        return
    rec = run_one(a.family, Path(a.work or f"/tmp/moe_families/{a.family}"))
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
