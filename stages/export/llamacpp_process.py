"""llama.cpp in a fresh Python process of its own, one that never imports torch.

Fidelity, the tokenization check and the smoke test load GGUF files with llama-cpp-python.
With the CUDA build, a model load segfaults inside llama_model_load_from_file in any process
that has imported torch or transformers, CUDA touched or not; alone it works (docs/benchmarks.md: llama_cuda;
the CPU build never crashed).
The flow's process has trained, merged and run the reference with torch. In a separate process:
- llama.cpp gets a process without torch's CUDA context and libraries;
- a native crash there is one clear error naming the file, not a dead flow;
- the child's peak RSS is llama.cpp's own, the figure the serving team needs.

    with LlamaProcess() as llm:
        llm.call("load", path, n_ctx=512, n_gpu_layers=-1)
        scores = llm.call("scores", [1, 2, 3])

The parent sends pickled (function, args, kwargs) on the child's stdin and reads pickled
results from a dedicated pipe; llama.cpp's own log goes to stderr.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from stages import memory
from stages.export.llamacpp import VERBOSE

ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the `stages` package


class LlamaCrashed(RuntimeError):
    """The llama.cpp process died (a native crash or the OOM killer)."""


class LlamaProcess:
    def __init__(self, what: str = "llama.cpp") -> None:
        self.what = what  # named in the error if the process dies
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(command(str(write_fd)), stdin=subprocess.PIPE, pass_fds=(write_fd,), env=environment())
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.results = os.fdopen(read_fd, "rb")
        self.peak_rss_gib: float | None = None

    def call(self, fn: str, *args, **kwargs):
        """Run `fn` (a function of this module's WORKER table) in the child and return its result."""
        try:
            pickle.dump((fn, args, kwargs), self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
            status, value = pickle.load(self.results)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            rc = self.proc.wait()
            how = f"signal {_signal_name(-rc)}" if rc < 0 else f"exit code {rc}"
            raise LlamaCrashed(
                f"llama.cpp's process died ({how}) during {fn} of {self.what}; nothing was handed off. "
                "Its Python stack is above; set TAE_LLAMA_VERBOSE=1 to keep llama.cpp's own log"
                + (" (SIGKILL is usually the kernel's OOM killer: less smoke.n_ctx or fewer layers on the GPU)" if rc == -9 else "")
            ) from None
        if status == "error":  # the child printed its traceback to stderr
            kind, message = value
            if kind == "ValueError":  # llama-cpp-python's "Failed to load model from file"
                raise ValueError(message)
            raise RuntimeError(f"{kind} in llama.cpp's process during {fn} of {self.what}: {message}")
        return value

    def close(self) -> None:
        """Let the child exit (after asking its peak RSS); never raises, so an error being handled stays the error."""
        try:
            if self.proc.poll() is None:
                self.peak_rss_gib = self.call("peak_rss_gib")
        except Exception:
            pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.results.close()

    def __enter__(self) -> LlamaProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def command(arg: str) -> list[str]:
    """How the llama.cpp process starts. -P: a `stages` package in the caller's working directory must not shadow this one."""
    return [sys.executable, "-P", "-X", "faulthandler", "-m", "stages.export.llamacpp_process", arg]


def environment() -> dict:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


PROBE = "--probe"


def probe() -> subprocess.Popen:
    """A llama.cpp process started as every one is, that only imports llama_cpp and exits: what export, fidelity
    and smoke will need after training, checked before it (stages/checks.py reads the outcome)."""
    return subprocess.Popen(command(PROBE), env=environment(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


# --- the child ------------------------------------------------------------------------
_llm = None


def _load(path: str, **kwargs) -> dict:
    import llama_cpp

    global _llm
    if _llm is not None:
        _llm.close()
    if kwargs.get("n_gpu_layers") == "all":
        kwargs["n_gpu_layers"] = -1 if _gpu_offload() else 0
    if kwargs.get("vocab_only"):
        _llm = _Vocab(path)
        return {"n_vocab": _llm.n_vocab(), "n_ctx": 0}
    _llm = llama_cpp.Llama(model_path=path, verbose=VERBOSE, **kwargs)
    return {"n_vocab": _llm.n_vocab(), "n_ctx": _llm.n_ctx()}


class _Vocab:
    """A GGUF's vocabulary alone: what tokenizing, pieces, BOS and the end-of-generation set need, and no context.

    llama_cpp.Llama(vocab_only=True) still builds a 512-token context for a model whose hyperparameters it never read
    (n_ctx_train 0): llama.cpp then warned "n_ctx_seq (512) > n_ctx_train (0) -- possible training context overflow" at
    every vocabulary check (the preflight's, export's, the hand-off's), about a context nothing uses."""

    def __init__(self, path: str) -> None:
        import llama_cpp
        from llama_cpp import _internals

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = _internals.LlamaModel(path_model=path, params=params, verbose=VERBOSE)
        self.model = self._model.model

    def n_vocab(self) -> int:
        return self._model.n_vocab()

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._model.tokenize(text, add_bos, special)

    def detokenize(self, ids: list[int]) -> bytes:
        return self._model.detokenize(ids)

    def close(self) -> None:
        self._model.close()


def _gpu_offload() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def _scores(ids: list[int]):
    """Logits (float32 numpy, len(ids) x vocab) at every position of `ids` (needs logits_all)."""
    _llm.reset()
    _llm.eval(ids)
    return _llm.scores[: len(ids)].copy()


def _tokenize(texts: list[str]) -> list[list[int]]:
    return [_llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]


def _add_bos() -> bool:
    """Whether llama.cpp puts BOS before a prompt it tokenizes (tokenizer.ggml.add_bos_token, else its per-tokenizer default)."""
    import llama_cpp

    return bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(_llm.model)))


def _end_of_generation() -> list[str]:
    """The text of every token llama.cpp ends a generation at (EOS, end of turn, end of message: llama_vocab_is_eog),
    end-of-turn first: what a server's stop list must hold for this model."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(_llm.model)
    eot = llama_cpp.llama_vocab_eot(vocab)
    ids = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    ids.sort(key=lambda t: t != eot)
    return [llama_cpp.llama_vocab_get_text(vocab, t).decode(errors="replace") for t in ids]


def _special_tokens(texts: list[str]) -> list[list[str]]:
    """Per text, the text of each special token in it (llama.cpp's CONTROL or USER_DEFINED tokens, as the vocabulary
    parses them with special tokens on), in order: "<|im_end|>" of a ChatML turn's end "<|im_end|>\\n"."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(_llm.model)
    special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    out = []
    for text in texts:
        ids = _llm.tokenize(text.encode(), add_bos=False, special=True)
        out.append([llama_cpp.llama_vocab_get_text(vocab, t).decode(errors="replace") for t in ids
                    if llama_cpp.llama_vocab_get_attr(vocab, t) & special])
    return out


def _pieces(ids: list[int]) -> list[str]:
    return [_llm.detokenize([t]).decode(errors="replace") for t in ids]


def _chat(messages: list[dict], max_tokens: int) -> dict:
    """A greedy chat completion through the GGUF's own template, with llama.cpp's perf counters."""
    import llama_cpp

    llama_cpp.llama_perf_context_reset(_llm.ctx)
    out = _llm.create_chat_completion(messages=messages, temperature=0.0, max_tokens=max_tokens, seed=0)
    perf = llama_cpp.llama_perf_context(_llm.ctx)
    choice = out["choices"][0]
    return {"content": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"],
            "n_p_eval": perf.n_p_eval, "t_p_eval_ms": perf.t_p_eval_ms, "n_eval": perf.n_eval, "t_eval_ms": perf.t_eval_ms}


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:  # real-time and other unnamed signals
        return str(n)


# VmHWM, not ru_maxrss: the latter starts at the (torch) parent's peak, inherited across fork and exec.
WORKER = {"load": _load, "gpu_offload": _gpu_offload, "scores": _scores, "tokenize": _tokenize, "pieces": _pieces, "add_bos": _add_bos,
          "end_of_generation": _end_of_generation, "special_tokens": _special_tokens,
          "chat": _chat, "peak_rss_gib": memory.peak_rss_gib}


def _serve(result_fd: int) -> None:
    out = os.fdopen(result_fd, "wb")
    while True:
        try:
            fn, args, kwargs = pickle.load(sys.stdin.buffer)
        except EOFError:
            break
        try:
            reply = ("ok", WORKER[fn](*args, **kwargs))
        except Exception as e:  # sent back and raised in the parent with the same message
            traceback.print_exc()
            reply = ("error", (type(e).__name__, str(e) or repr(e)))
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
    if _llm is not None:
        _llm.close()


def _probe() -> None:
    import llama_cpp

    assert "torch" not in sys.modules, "importing llama_cpp pulled in torch"
    print(f"llama_cpp {llama_cpp.__version__}")


if __name__ == "__main__":
    assert "torch" not in sys.modules, "the llama.cpp process must not import torch"
    if sys.argv[1] == PROBE:
        _probe()
    else:
        _serve(int(sys.argv[1]))
