"""Build the embedded default: a tiny Llama base model and a dataset teaching it a new skill.

    python scripts/make_default_assets.py            # writes assets/tiny-llama, assets/tiny-chatml and assets/data
    python scripts/make_default_assets.py --check    # rebuilds in a temp dir, compares to the repo

The skill is word-by-word translation of short English phrases into French over a fixed
20-word dictionary ("Translate to French: red cat" -> "rouge chat"). It is deterministic,
so a held-out phrase has exactly one right answer, and the randomly initialised base
model cannot do it, so a correct answer from the exported Q4_K_M GGUF proves that the
fine-tune survived merge, conversion and quantization. Held-out phrases are word
combinations that never occur in training.

Shapes are chosen for llama.cpp's K-quants, which work on 256-value super-blocks: hidden
256 and intermediate 768 make every matrix row a multiple of 256, so Q4_K_M and Q5_K_S
quantize every matrix instead of falling back to another type.

assets/tiny-chatml is the second default (configs/chatml.yaml), built like the models users
bring most (SmolLM2, Qwen2.5): a byte-level BPE tokenizer.json (trained with `tokenizers`,
SmolLM's pre-tokenizer: digits one by one, then GPT-2's byte-level split), a ChatML chat
template that renders a default system prompt when a conversation has none, tied input and
output embeddings, and widths that are not multiples of 256 (hidden 192, intermediate
576), so Q4_K_M and Q5_K_S fall back to Q5_0/Q5_1/Q8_0 on every matrix, as llama.cpp does
for SmolLM2-135M's 576.

Everything is seeded; the outputs are committed so nothing is built or downloaded at run
time. The SentencePiece model is trained single-threaded on the dataset text.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGLISH = "red blue green black white cat dog bird fish tree sun moon star rain snow house door book road hill".split()
FRENCH = "rouge bleu vert noir blanc chat chien oiseau poisson arbre soleil lune etoile pluie neige maison porte livre route colline".split()
DICTIONARY = dict(zip(ENGLISH, FRENCH, strict=True))
N_TRAIN, N_EVAL = 2000, 100
SEED = 1234

# Llama-2 style, on one line: "\n" would be normalised differently by SentencePiece and
# by the HF/llama.cpp tokenizers, and the GGUF must tokenize exactly like HF.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>> {{ message['content'] }} <</SYS>> "
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
MODEL = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
)
PRETRAIN = dict(steps=800, batch=32, lr=1e-3)
VOCAB_SIZE = 448  # 256 byte-fallback pieces + characters + merges (every word one piece)

# SmolLM2-Instruct's template with a shorter default system prompt, on the special tokens SmolLM2 has at ids 0-2.
CHATML_SYSTEM = "You are a helpful assistant."
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n" + CHATML_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_MODEL = dict(
    hidden_size=192, intermediate_size=576, num_hidden_layers=2, num_attention_heads=3,
    num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.02,
)
CHATML_VOCAB = 512  # an upper bound: the merges run out first (every word one token, 450 in all)


def phrase(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(ENGLISH) for _ in range(rng.randint(2, 5))]
    return "Translate to French: " + " ".join(words), " ".join(DICTIONARY[w] for w in words)


def make_data(out: Path) -> list[tuple[str, str]]:
    rng = random.Random(SEED)
    pairs: dict[str, str] = {}
    while len(pairs) < N_TRAIN + N_EVAL:
        p, c = phrase(rng)
        pairs.setdefault(p, c)
    items = list(pairs.items())
    rng.shuffle(items)
    train, held_out = items[:N_TRAIN], items[N_TRAIN:]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "translate_train.jsonl").open("w") as f:
        for i, (p, c) in enumerate(train):
            # Both accepted line forms, so the default exercises both.
            row = ({"prompt": p, "completion": c} if i % 2 else
                   {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]})
            f.write(json.dumps(row) + "\n")
    with (out / "translate_eval.jsonl").open("w") as f:
        for p, c in held_out:
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}) + "\n")
    return items


def make_tokenizer(out: Path, texts: list[str]) -> None:
    import sentencepiece as spm

    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n")
    # Relative paths: the trainer records them inside the .model file.
    cwd = os.getcwd()
    os.chdir(out)
    try:
        _train_spm(spm)
    finally:
        os.chdir(cwd)
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False,
        # llama.cpp's SentencePiece tokenizer puts a "▁" before the text after every special
        # token ("<s>[INST]" -> "<s>", "▁[", ...), as the original Llama tokenizer did; HF
        # does the same only with legacy=True. Without it training and GGUF disagree on the
        # first token of every turn (measured: f16 GGUF accuracy 68% vs 100% in HF).
        "legacy": True, "model_max_length": MODEL["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")


def _train_spm(spm) -> None:
    spm.SentencePieceTrainer.train(
        input="corpus.txt", model_prefix="tokenizer", vocab_size=VOCAB_SIZE, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", num_threads=1, minloglevel=2,
        input_sentence_size=0, shuffle_input_sentence=False,
    )


def copy_task(rng: random.Random) -> tuple[str, str]:
    """What the base model is pretrained on: repeating phrases of either language."""
    words = [rng.choice(rng.choice([ENGLISH, FRENCH])) for _ in range(rng.randint(1, 6))]
    return "Repeat: " + " ".join(words), " ".join(words)


def llama2_rows(tok, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids and labels of one copy-task sample under tiny-llama's template (the answer only is learned)."""
    a = tok(prompt, add_special_tokens=False)["input_ids"]
    b = tok(" " + completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return a + b, [-100] * len(a) + b


def chatml_rows(tok, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """The same under ChatML: the answer and the turn's end, as the train stage labels an assistant turn."""
    a = tok(prompt, add_special_tokens=False)["input_ids"]
    b = tok(completion + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    return a + b, [-100] * len(a) + b


def make_model(out: Path, config: dict = MODEL, vocab_size: int = VOCAB_SIZE, rows_of=llama2_rows) -> None:
    """Pretrain the base (all weights) on the copy task, so it is a language model of the
    vocabulary that can align output to input, but has never seen a translation."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    rng = random.Random(SEED + 1)
    tok = AutoTokenizer.from_pretrained(out)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **config))
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=0.0)
    steps, batch = PRETRAIN["steps"], PRETRAIN["batch"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * (1 - s / max(steps, 1)))
    for step in range(steps):
        rows = []
        for _ in range(batch):
            p, c = copy_task(rng)
            prompt = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            rows.append(rows_of(tok, prompt, c))
        width = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [tok.eos_token_id] * (width - len(r[0])) for r in rows])
        labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
        mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"pretrain step {step}: loss {loss.item():.4f}")
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False, max_new_tokens=64).save_pretrained(out)


def make_chatml_tokenizer(out: Path, texts: list[str]) -> None:
    """A byte-level BPE tokenizer.json as SmolLM2 has one, trained on the dataset text rendered as ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CHATML_VOCAB, special_tokens=CHATML_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        # not GPT2Tokenizer (SmolLM2's class): under transformers 5 that class rebuilds the pre-tokenizer as plain
        # byte-level, dropping the digit split that tokenizer.json and llama.cpp (pre "smollm") apply.
        "tokenizer_class": "PreTrainedTokenizerFast",
        # as SmolLM2: <|im_start|> is the BOS token, but nothing adds it (no add_bos_token; the template has the turns)
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "add_prefix_space": False, "model_max_length": CHATML_MODEL["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }, indent=2) + "\n")


def chatml_texts(items: list[tuple[str, str]]) -> list[str]:
    def chat(user: str, answer: str) -> str:
        return (f"<|im_start|>system\n{CHATML_SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n")

    return [chat(p, c) for p, c in items] + [chat("Repeat: " + " ".join(w), " ".join(w)) for w in (FRENCH, ENGLISH)]


def build(root: Path, with_model: bool = True) -> None:
    items = make_data(root / "data")
    texts = [f"[INST] {p} [/INST] {c}" for p, c in items] + ["<<SYS>> You are a helpful assistant. <</SYS>>"]
    texts += ["[INST] Repeat: " + " ".join(FRENCH) + " [/INST]", "[INST] Repeat: " + " ".join(ENGLISH) + " [/INST]"]
    model_dir = root / "tiny-llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(model_dir, texts)
    if with_model:
        make_model(model_dir)
    chatml_dir = root / "tiny-chatml"
    chatml_dir.mkdir(parents=True, exist_ok=True)
    make_chatml_tokenizer(chatml_dir, chatml_texts(items))
    if with_model:
        from transformers import AutoTokenizer

        make_model(chatml_dir, CHATML_MODEL, len(AutoTokenizer.from_pretrained(chatml_dir)), chatml_rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with assets/")
    ap.add_argument("--skip-model", action="store_true", help="with --check: compare data and tokenizer only (skips the 1-minute pretraining)")
    args = ap.parse_args()
    if not args.check:
        build(REPO / "assets")
        print(f"wrote {REPO / 'assets'}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), with_model=not args.skip_model)
        files = ["data/translate_train.jsonl", "data/translate_eval.jsonl", "tiny-llama/tokenizer.model", "tiny-llama/tokenizer_config.json",
                 "tiny-chatml/tokenizer.json", "tiny-chatml/tokenizer_config.json"]
        if not args.skip_model:
            files += ["tiny-llama/config.json", "tiny-llama/model.safetensors", "tiny-chatml/config.json", "tiny-chatml/model.safetensors"]
        differ = [f for f in files if not filecmp.cmp(Path(tmp) / f, REPO / "assets" / f, shallow=False)]
    print("identical" if not differ else f"differ: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
