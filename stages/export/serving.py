"""The smoke test the serving team's way: llama.cpp's OpenAI-compatible server on loopback, asked with the official
`openai` client.

The serving team does not load a GGUF with `Llama(...)` in a script: they run a server (llama-cpp-python's
`llama_cpp.server`, llama.cpp's `llama-server`, Ollama) and call its chat completions. That path applies the
GGUF's own chat template and stops at its end-of-turn token server-side, so a template or stop-token problem the
in-process check cannot see shows here. The server runs in its own torch-free process (as every llama.cpp load in
this project: the CUDA build crashes beside torch), on a free loopback port, and is always stopped.

    result = serving.ask(gguf, cfg.smoke, prompts, n_gpu_layers=plan.n_gpu_layers, log=smoke_dir / "server-Q4_K_M.log")
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stages.config import SmokeSection
from stages.errors import UserError

START_TIMEOUT_S = 180     # loading a 7B GGUF from a cold page cache
REQUEST_TIMEOUT_S = 300   # one chat completion of max_tokens on a CPU


class ServingError(UserError, RuntimeError):
    """The GGUF did not serve through llama.cpp's OpenAI-compatible server."""


@dataclass
class Served:
    """What the served endpoint answered: checked like the in-process answers, timed per request."""

    n_prompts: int
    passed: int
    accuracy: float
    stopped_at_eot: int              # answers that ended at the end-of-turn/EOS token (finish_reason "stop")
    mean_latency_s: float            # per chat completion, client side
    completion_tokens_per_s: float   # completion tokens / summed request time
    start_s: float                   # until the server answered /v1/models
    examples: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(gguf: Path, s: SmokeSection, prompts: list, *, n_gpu_layers: int, log: Path, lora: Path | None = None) -> Served:
    """Start `llama_cpp.server` on the GGUF (with the adapter GGUF `lora` applied, as `llama-server --lora` does), ask
    every held-out prompt through `openai`'s chat completions, stop it."""
    import openai

    port = free_port()
    cmd = [sys.executable, "-P", "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(s.n_ctx), "--n_gpu_layers", str(n_gpu_layers), "--seed", "0", *(("--lora_path", str(lora)) if lora else ())]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTHONPATH"))}  # torch-free, Prefect-free
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local", timeout=REQUEST_TIMEOUT_S, max_retries=0)
            start = _wait_ready(proc, client, log)
            return _ask_all(client, s, prompts, start)
        finally:
            _stop(proc)


def _wait_ready(proc: subprocess.Popen, client, log: Path) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise ServingError(f"llama.cpp's server exited with {proc.returncode} before answering ({' | '.join(tail)}); "
                               f"its log: {log}; install the server extra (`pip install llama-cpp-python[server]`, "
                               "bash scripts/install.sh does) or fix what the log names")
        try:
            client.models.list()
            return time.perf_counter() - t0
        except Exception:  # not listening yet
            time.sleep(0.2)
    raise ServingError(f"llama.cpp's server did not answer within {START_TIMEOUT_S} s; its log: {log}")


def _ask_all(client, s: SmokeSection, prompts: list, start_s: float) -> Served:
    passed = stopped = 0
    spent = tokens = 0.0
    examples = []
    for sample in prompts:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="local", messages=list(sample.prompt_messages), max_tokens=s.max_tokens,
                                           temperature=0.0, seed=0)
        spent += time.perf_counter() - t0
        choice = r.choices[0]
        got = (choice.message.content or "").strip()
        ends = choice.finish_reason == "stop"
        ok = got == sample.answer.strip() if s.check == "exact" else (bool(got) and ends)
        passed, stopped = passed + ok, stopped + ends
        tokens += r.usage.completion_tokens if r.usage else 0
        if len(examples) < 5 or (not ok and len(examples) < 10):
            examples.append({"id": sample.id, "expected": sample.answer, "got": got, "finish_reason": choice.finish_reason, "ok": ok})
    n = len(prompts)
    return Served(n, passed, passed / n if n else 0.0, stopped, round(spent / n, 4) if n else 0.0,
                  round(tokens / spent, 1) if spent else 0.0, round(start_s, 3), examples)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s: the server never outlives the stage."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
