"""What the serving team reads in a bundle: an Ollama Modelfile and a model card.

Chat templates come from model files, so they are rendered only in Jinja's immutable
sandbox (attribute access to Python internals raises SecurityError, as in transformers'
own `apply_chat_template`).

Ollama wants a Go template, not Jinja. The Go template is derived by rendering the
Jinja template on marker messages (one system, user, assistant, user turn) and cutting
the text around the markers; it is then checked by re-assembling a conversation from the
pieces and comparing it with the Jinja rendering. A template whose turns are not plain
prefix/suffix text (conditionals on content, tool calls) fails that check, and the
Modelfile then leaves TEMPLATE out: Ollama falls back to the template stored in the GGUF
(`tokenizer.chat_template`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stages.memory import markdown_table

S, U, A, V = "\x00SYSTEM\x00", "\x00USER\x00", "\x00ASSISTANT\x00", "\x00USER2\x00"


def render(template: str, messages: list[dict], *, add_generation_prompt: bool, bos_token: str = "", eos_token: str = "") -> str:
    """The chat template applied to `messages`, in a sandbox (transformers' Jinja settings)."""

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=bos_token, eos_token=eos_token)


@dataclass
class TurnTemplate:
    prefix: str           # once, before the first message
    user: tuple[str, str]
    assistant: tuple[str, str]
    system: tuple[str, str] | None
    generation: str       # after the last message, to make the model answer
    default_system: str = ""  # after the prefix when the conversation has no system message (a default system turn)

    def assemble(self, messages: list[dict]) -> str:
        """The text the Go template renders for `messages` (as Ollama fills .System and .Messages)."""
        parts = [self.prefix]
        if not any(m["role"] == "system" for m in messages):
            parts.append(self.default_system)
        for m in messages:
            pre, suf = {"user": self.user, "assistant": self.assistant, "system": self.system}[m["role"]]
            parts += [pre, m["content"], suf]
        return "".join(parts) + self.generation

    def go_template(self) -> str:
        """Ollama's TEMPLATE: no whitespace-trimming markers, so every literal stays byte-exact."""
        branches = [("system", self.system), ("user", self.user), ("assistant", self.assistant)]
        body = "".join(
            f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{pre}{{{{ .Content }}}}{suf}'
            for i, (role, (pre, suf)) in enumerate((r, p) for r, p in branches if p is not None)
        )
        default = f"{{{{ if not .System }}}}{self.default_system}{{{{ end }}}}" if self.default_system else ""
        return f"{self.prefix}{default}{{{{ range .Messages }}}}{body}{{{{ end }}}}{{{{ end }}}}{self.generation}"


def turn_template(template: str, bos_token: str, eos_token: str, *, strip_bos: bool) -> TurnTemplate | None:
    """Prefix/suffix text of each role, or None when the template is not that simple."""

    def r(msgs, gen=False):
        return render(template, [{"role": ro, "content": c} for ro, c in msgs], add_generation_prompt=gen,
                      bos_token=bos_token, eos_token=eos_token)

    try:
        one, one_gen = r([("user", U)]), r([("user", U)], True)
        two = r([("user", U), ("assistant", A)])
        three = r([("user", U), ("assistant", A), ("user", V)])
        u_suf = one[one.index(U) + len(U):]
        a_suf = two[two.index(A) + len(A):]
        between = three[three.index(A) + len(A): three.index(V)]
        u_pre = between[len(a_suf):] if between.startswith(a_suf) else None
        head = one[: one.index(U)]
        if u_pre is None or not head.endswith(u_pre) or not one_gen.startswith(one):
            return None
        prefix = head[: len(head) - len(u_pre)]  # all that precedes the first user turn when there is no system message
        a_pre = two[one.index(U) + len(U): two.index(A)][len(u_suf):]
        system, default = None, ""
        try:
            sys_text = r([("system", S), ("user", U)])
            if S in sys_text:
                s_head = sys_text[: sys_text.index(S)]
                s_suf = sys_text[sys_text.index(S) + len(S): sys_text.index(U) - len(u_pre)]
                if not s_head.startswith(prefix):  # no system message renders text a system message replaces
                    prefix, default = _split_default(s_head, prefix, u_pre)
                system = (s_head[len(prefix):], s_suf)
        except TemplateError:
            pass
        tt = TurnTemplate(prefix, (u_pre, u_suf), (a_pre, a_suf), system, one_gen[len(one):], default)
    except (TemplateError, ValueError):
        return None
    # The derived pieces must rebuild what Jinja renders, with and without a system message, or they are not trusted.
    turns = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    convos = [turns] + ([[{"role": "system", "content": "Be brief."}, *turns]] if tt.system else [])
    try:
        if any(tt.assemble(c) != render(template, c, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token) for c in convos):
            return None
    except TemplateError:
        return None
    pieces = [tt.prefix, tt.generation, tt.default_system, *tt.user, *tt.assistant, *(tt.system or ())]
    if any(bad in p for p in pieces for bad in ('"""', "{{", "}}")):
        return None  # would end the Modelfile's TEMPLATE block or be read as Go template code
    if strip_bos and bos_token and tt.prefix.startswith(bos_token):
        tt.prefix = tt.prefix[len(bos_token):]  # llama.cpp adds BOS itself (tokenizer.ggml.add_bos_token)
    return tt


def assistant_turn_end(template: str, bos_token: str, eos_token: str) -> str | None:
    """The text the chat template puts after an assistant message's content ("<|im_end|>\\n", "<end_of_turn>\\n",
    "</s>"): where the model learned to end its turn. None when the template renders no assistant turn."""
    msgs = [{"role": "user", "content": U}, {"role": "assistant", "content": A}]
    try:
        text = render(template, msgs, add_generation_prompt=False, bos_token=bos_token, eos_token=eos_token)
    except TemplateError:
        return None
    return text[text.index(A) + len(A):] if A in text else None


def _split_default(s_head: str, head: str, u_pre: str) -> tuple[str, str]:
    """(prefix, default system text) for a template that renders `head` with no system message and `s_head` before
    a system message's content. Any split inside their common start renders the same conversations; the one
    chosen makes the system turn open like a user turn does ("<|im_start|>"), so it reads as a turn of its own."""
    common = len(os.path.commonprefix([s_head, head]))
    k = max(range(common + 1), key=lambda k: (len(os.path.commonprefix([s_head[k:], u_pre])), -k))
    return head[:k], head[k:]


def modelfile(gguf_name: str, others: list[str], template: str, bos_token: str, eos_token: str, stops: list[str],
              add_bos: bool, n_ctx: int) -> tuple[str, TurnTemplate | None]:
    """An Ollama Modelfile for `gguf_name`; returns (text, the turn template its TEMPLATE came from, None if left out)."""
    tt = turn_template(template, bos_token, eos_token, strip_bos=add_bos)
    lines = [f"# Ollama: ollama create <name> -f Modelfile   (other quantizations in this bundle: {', '.join(others) or 'none'})",
             f"FROM ./{gguf_name}"]
    if tt is not None:
        if tt.default_system:
            lines.append(f"# the chat template's default system turn, used when a conversation has no system message: {tt.default_system!r}")
        lines.append(f'TEMPLATE """{tt.go_template()}"""')
    else:
        lines.append("# TEMPLATE omitted: the chat template is not plain per-role text; Ollama uses the GGUF's tokenizer.chat_template")
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in dict.fromkeys(stops) if s]
    lines.append(f"PARAMETER num_ctx {n_ctx}")
    return "\n".join(lines) + "\n", tt


def imatrix_lines(info: dict | None) -> list[str]:
    """What the importance matrix was made from and, per type, both files' figures and which was kept."""
    if not info:
        return []
    if not info.get("used_by", list(info.get("choices", {}))):
        return ["", "## Importance matrix", "",
                f"An importance matrix ({info['dataset']}, {info['tensors']} tensors) was tried on each type and no type was "
                "closer to the merged model with it: every file here is quantized without one, and the matrix is not in this bundle."]
    rows = ["", "## Importance matrix", "",
            f"`imatrix.gguf` (in this bundle; `llama-quantize --imatrix imatrix.gguf` reads it): the merged model's input "
            f"activations on {info['dataset']}, {info['chunks']} chunks, {info['tensors']} tensors; never the held-out texts "
            "the figures below are measured on. Each type was quantized with and without it and the file with the lower "
            "mean KL was kept:", "",
            "| type | kept | mean KL plain | mean KL imatrix | top-1 plain | top-1 imatrix | size MiB plain / imatrix |",
            "|---|---|---|---|---|---|---|"]
    for quant, c in info.get("choices", {}).items():
        p, i = c["plain"], c["imatrix"]
        rows.append(f"| {quant} | {c['kept']} | {p['mean_kl']} | {i['mean_kl']} | {p['top1_agreement']} | {i['top1_agreement']} | "
                    f"{p['size_mib']:.1f} / {i['size_mib']:.1f} |")
    experts = info.get("experts")
    if experts:
        missing = experts["without_data"]
        rows += ["", f"Routed experts: each expert's rows come from the tokens the router sent it; {experts['covered']} of "
                 f"{experts['of']} expert matrices got some"
                 + (". No calibration token reached: " + "; ".join(f"`{n}` experts {', '.join(map(str, e))}" for n, e in missing.items())
                    + " (weighted evenly, as without a matrix)." if missing else ".")]
    return rows


def _merged_into(merge: dict) -> str:
    """What the adapter was merged into, in the precision the merged model was saved in."""
    dtype = merge.get("save_dtype")
    if merge.get("base") == "dequantized-nf4":
        return f"merged into the NF4 weights it trained against, dequantized to {dtype or '16 bits'},"
    return f"merged into the base's original {dtype} weights" if dtype else "merged into the base's original weights"


def _adapted(adapter: dict) -> list[str]:
    """One line on what the adapter trained (manifests written before it was recorded have none)."""
    if not adapter.get("target_modules") and not adapter.get("target_parameters"):
        return []
    line = f"LoRA r {adapter['r']} (alpha {adapter['lora_alpha']}) on {', '.join(adapter['target_modules']) or 'no linear module'}"
    if adapter.get("target_parameters"):
        line += (f"; routed experts: {', '.join(adapter['target_parameters'])}, rank {adapter['r']} per expert, "
                 "merged into every expert")
    return [line + "."]


def adapter_lines(manifest: dict) -> list[str]:
    """How to serve the fine-tune as the base plus its adapter, with the figures that proved it; or why the bundle has
    no adapter (manifests written before it was handed off say nothing)."""
    proof = (manifest.get("adapter") or {}).get("hot_swap")
    if not proof:
        return []
    head = ["", "## The adapter, for servers that hot-swap", ""]
    if not proof.get("shipped"):
        return head + [f"Not in this bundle: {proof.get('reason')}. Serve the merged GGUFs above."]
    base, parity, served = proof["base_gguf"], proof["parity"], proof.get("served") or {}
    name, base_name = manifest["model_name"], manifest["base_model"]["name_or_path"]
    return head + [
        f"`{proof['gguf']}` (llama.cpp's `convert_lora_to_gguf.py`, LoRA alpha {proof.get('gguf_lora_alpha')}) and "
        f"`{'` + `'.join(proof['peft'])}` (PEFT: this folder is the adapter directory) apply this fine-tune to the base "
        f"`{base_name}` at serve time, for servers that keep one base and swap fine-tunes.",
        f"Proven before it shipped: llama.cpp on the base converted to {base['outtype']} by {base['made_by']} (sha256 "
        f"`{base['sha256'][:16]}…`), with the adapter applied, against the merged `{parity['against']}` on {parity['positions']} "
        f"held-out positions: mean KL {parity['mean_kl']}, top-1 {parity['top1_agreement']:.1%} (limits {parity['max_mean_kl']} / "
        f"{parity['min_top1']:.0%}); served through llama.cpp's server with the adapter: {served.get('passed')}/"
        f"{served.get('n_prompts')} held-out prompts passed.",
        "",
        "```bash",
        f"python convert_hf_to_gguf.py {base_name} --outtype {base['outtype']} --outfile base-{base['outtype']}.gguf   # the base, once",
        f"llama-server -m base-{base['outtype']}.gguf --lora {proof['gguf']}   # or --lora-init-without-apply and choose per request",
        f"vllm serve {base_name} --enable-lora --lora-modules {name}=.   # in this folder",
        "```",
        "",
        "The Modelfile stays on the merged GGUF (Ollama is reported to refuse ADAPTER lines since its September release).",
    ]


def readme(manifest: dict, modelfile_template: TurnTemplate | None) -> str:
    """The model card: what this is, how it was made and checked, how to run it."""
    files = manifest["files"]
    fid = {f["quant"]: f for f in manifest.get("fidelity", [])}
    smoke = manifest.get("smoke", {})
    rows = ["| file | type | size MiB | fallback tensors | mean KL vs merged | top-1 agreement | smoke pass rate | served: pass rate, "
            "latency, tok/s | sha256 |", "|---|---|---|---|---|---|---|---|---|"]
    for f in files:
        d, s = fid.get(f["quant"], {}), smoke.get(f["quant"], {})
        fell = ", ".join(f"{k} {n}" for k, n in f.get("fallbacks", {}).items())
        v = s.get("served") or {}
        served = f"{v['accuracy']}, {v['mean_latency_s'] * 1000:.0f} ms, {v['completion_tokens_per_s']:.0f}" if v else "-"
        rows.append(f"| `{f['file']}` | {f['quant']} | {f['bytes'] / 2**20:.1f} | {f.get('n_fallback', '-')}{f' ({fell})' if fell else ''} | "
                    f"{d.get('mean_kl', '-')} | {d.get('top1_agreement', '-')} | {s.get('accuracy', '-')} | {served} | `{f['sha256'][:16]}…` |")
    mem = manifest.get("memory_peaks", {})
    mem_rows = markdown_table(mem)
    first = files[0]["file"]
    base = manifest["base_model"]
    train = manifest.get("train", {})
    loss = f"{train.get('first_loss', float('nan')):.4f} -> {train.get('final_loss', float('nan')):.4f}"
    return "\n".join([
        f"# {manifest['model_name']} — {manifest['version']}",
        "",
        f"A {'QLoRA' if manifest['adapter']['method'] == 'qlora' else 'LoRA'} fine-tune of `{base['name_or_path']}` (weights sha256 `{base['sha256'][:16]}…`), "
        f"{_merged_into(manifest.get('merge') or {})} and exported to GGUF by train-and-export.",
        *_adapted(manifest["adapter"]),
        f"Data fingerprint `{manifest['data_fingerprint'][:16]}…`; llama.cpp (llama-cpp-python) {manifest['versions'].get('llama_cpp_python')}; "
        f"Prefect flow run `{manifest.get('prefect_flow_run_id')}`.",
        "",
        "## Files",
        "",
        *rows,
        "",
        "Verify: `sha256sum -c SHA256SUMS`. KL and top-1 compare each file's next-token distribution with the merged "
        "model on held-out texts (llama.cpp on Llama-3-8B, for scale: Q4_K_M KL 0.031, top-1 91.9%).",
        *imatrix_lines(manifest.get("imatrix")),
        *([] if not any(f.get("n_fallback") for f in files) else [
            "",
            "Fallback tensors: K-quants pack 256 values per block, so llama.cpp quantizes a matrix whose rows are not a "
            "multiple of 256 to a 32-value type instead (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), as every published "
            "K-quant of such a model has it; export checked each tensor has the type llama.cpp's rule gives it. These "
            "files are a little larger than the type's name suggests."]),
        "",
        "## Run it",
        "",
        "```bash",
        f"llama-cli -m {first} -cnv                      # llama.cpp; add -ngl 99 to offload every layer to the GPU",
        f"python -c \"from llama_cpp import Llama; print(Llama('{first}', n_gpu_layers=-1).create_chat_completion("
        "messages=[{'role': 'user', 'content': 'Hello'}]))\"",
        "ollama create my-model -f Modelfile && ollama run my-model",
        "```",
        "",
        "With a CUDA build of llama-cpp-python, load the GGUF in a process that has not imported torch or transformers: "
        "on an H200 with llama-cpp-python 0.3.36 such a process segfaulted in the model load, a fresh one did not.",
        "",
        "The chat template is stored in each GGUF (`tokenizer.chat_template`) and used by llama.cpp's chat endpoints. "
        + ("The Modelfile carries the same template as Ollama's Go template, checked against the Jinja rendering"
           + (" (its default system turn included, used when a conversation has no system message)."
              if modelfile_template.default_system else ".")
           if modelfile_template else "The Modelfile leaves TEMPLATE to the one stored in the GGUF."),
        f"Generation stops at: {', '.join(repr(s) for s in manifest.get('stop_tokens', []))}.",
        *adapter_lines(manifest),
        "",
        "## How it was made",
        "",
        f"Training: {train.get('steps')} steps, loss {loss}. Full config: `manifest.json` (`config`).",
        "",
        *mem_rows,
        "",
    ])
