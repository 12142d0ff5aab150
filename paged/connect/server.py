"""Start a real vLLM CPU server beside ours, from its own venv (``make vllm``), and talk to it.

    with VLLMServer(export_dir, block_size=32, num_gpu_blocks=20) as srv:   # waits for /health
        srv.complete([1, 2, 3], max_tokens=8)       # POST /v1/completions with token ids, greedy
        src = paged.connect.connect(events=srv.events_endpoint, metrics=srv.metrics_url,
                                    replay=srv.replay_endpoint)
    # stopped: its whole process group, SIGTERM then SIGKILL

The server runs as ``nice -n 10 python -m vllm.entrypoints.openai.api_server`` in its own process group
(and, unless ``new_session=False``, its own session), HTTP on 127.0.0.1 only, KV events on ipc:// sockets
in a private temporary directory (vLLM binds tcp only on every interface, ``tcp://*:PORT``; ipc stays on
this machine), its output in a log file. ``paged`` never imports vllm: this module only starts a process.
Facts from /work/shared/VLLM_CPU.md: block sizes must be multiples of 32 on CPU;
``--enforce-eager`` skips ~30 s of compilation; start-up takes 1-3 minutes on a loaded 2-core VM.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from paged.errors import ConfigError, ConnectError

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The vLLM venv's python: ``$PAGED_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python`` (``make vllm``)."""
    p = Path(os.environ.get("PAGED_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not p.is_file():
        raise ConfigError(f"no vLLM python at {p}; build the venv with `make vllm` (or set PAGED_VLLM_PYTHON)")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - our own local server
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        raise ConnectError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ConnectError(f"{url}: {getattr(e, 'reason', e)}") from None
    return json.loads(text) if text.strip() else None


def _gather(futures: list[Future]) -> "Future[list]":
    """One future of every result in order, set when the last of ``futures`` ends (no thread waits on them;
    a failed or cancelled one fails it)."""
    out: Future = Future()
    left, lock = [len(futures)], threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result([f.result() for f in futures])
        except BaseException as e:  # handed to the caller through the future
            out.set_exception(e)
    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(one_done)
    return out


class Client:
    """Requests to an OpenAI-compatible vLLM server at ``base_url`` (ours starts one; or one you run,
    on a GPU machine elsewhere): ``complete``, ``submit`` (in the background), ``reset_prefix_cache``."""

    def __init__(self, base_url: str, served_model_name: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.served_model_name = served_model_name
        self._pools: dict[int, ThreadPoolExecutor] = {}  # concurrency -> its pool of that many threads

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    def complete(self, prompt: Sequence[int] | str, max_tokens: int = 16, *, temperature: float = 0.0,
                 logprobs: int | None = None, timeout: float = 120.0, **extra: Any) -> dict:
        """POST /v1/completions (token ids or text); the JSON answer, ``ignore_eos`` by default, plus
        ``answer["paged"]``: the wall-clock times the request was sent and answered."""
        body = {"model": self.served_model_name, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
                "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True,
                "return_token_ids": True, **extra}
        if logprobs is not None:
            body["logprobs"] = logprobs
            body["return_tokens_as_token_ids"] = True
        sent = time.time()
        answer = _post(f"{self.base_url}/v1/completions", body, timeout)
        answer["paged"] = {"sent": sent, "done": time.time()}  # wall-clock times (time.time()) of this call
        return answer

    def submit(self, prompts: Sequence[Sequence[int] | str], max_tokens: int = 16, *, concurrency: int = 8,
               **kw: Any) -> "Future[list[dict]]":
        """Send ``prompts`` (at most ``concurrency`` at a time) in the background; a future of the
        answers, in order (a failed request fails the future)."""
        n = max(1, concurrency)
        pool = self._pools.get(n)
        if pool is None:
            pool = self._pools[n] = ThreadPoolExecutor(n, thread_name_prefix=f"paged-vllm-client{n}")
        return _gather([pool.submit(self.complete, p, max_tokens, **kw) for p in prompts])

    def close(self) -> None:
        """Cancel what ``submit`` has not sent yet and let its threads go (idempotent)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()

    def reset_prefix_cache(self, timeout: float = 30.0) -> None:
        """POST /reset_prefix_cache (needs ``VLLM_SERVER_DEV_MODE=1`` on the server; ours sets it)."""
        _post(f"{self.base_url}/reset_prefix_cache", None, timeout)


class VLLMServer(Client):
    """One vLLM OpenAI-compatible server process (see the module docstring)."""

    def __init__(self, model: str | os.PathLike[str], *, block_size: int = 32, num_gpu_blocks: int | None = None,
                 max_model_len: int = 512, dtype: str = "float32", kv_cache_space_gib: int = 1,
                 enable_prefix_caching: bool = True, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, served_model_name: str = "smollm2",
                 port: int | None = None, topic: str = "kv-events",
                 env: dict[str, str] | None = None, nice: int = 10, startup_timeout: float = 420.0,
                 log_path: str | os.PathLike[str] | None = None, python: str | os.PathLike[str] | None = None,
                 new_session: bool = True) -> None:
        if block_size % 32:
            raise ConfigError(f"vLLM on CPU needs a block size that is a multiple of 32, got {block_size}")
        self.model, self.block_size, self.num_gpu_blocks = str(Path(model).resolve()), block_size, num_gpu_blocks
        self.python = Path(python) if python is not None else vllm_python()
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}", served_model_name)
        self._dir = Path(tempfile.mkdtemp(prefix="pvllm-"))
        self.events_endpoint = f"ipc://{self._dir}/events"
        self.replay_endpoint = f"ipc://{self._dir}/replay"
        self.topic = topic
        self.log_path = Path(log_path) if log_path is not None else self._dir / "server.log"
        self.startup_timeout = startup_timeout
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events_endpoint,
                     "replay_endpoint": self.replay_endpoint, "topic": topic}
        args = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", served_model_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(max_model_len), "--block-size", str(block_size), "--dtype", dtype,
                "--enforce-eager", "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
                "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching"]
        for flag, value in (("--num-gpu-blocks-override", num_gpu_blocks), ("--max-num-seqs", max_num_seqs),
                            ("--max-num-batched-tokens", max_num_batched_tokens)):
            if value is not None:
                args += [flag, str(value)]
        self.args = (["nice", "-n", str(nice)] if nice else []) + args
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), "VLLM_SERVER_DEV_MODE": "1",
                    "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": os.environ.get(
                        "VLLM_OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2")), **(env or {})}
        self.env.pop("PYTHONPATH", None)  # the vLLM venv must not import this checkout's packages
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.new_session = new_session

    @property
    def workdir(self) -> Path:
        """The server's private temporary directory (its ipc sockets; its log unless given a path)."""
        return self._dir

    # ---- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "VLLMServer":
        if self.proc is not None:
            return self
        self._log = open(self.log_path, "wb")
        # its own process group either way (stopped as a group); a session of its own by default, or ours
        # (Linux autogroup shares CPU fairly between sessions: a benchmark keeps the server in its own)
        group = {"start_new_session": True} if self.new_session else {"process_group": 0}
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(self._dir), **group)
        self._t_start = time.monotonic()
        self.wait_ready()
        return self

    def wait_ready(self) -> float:
        """Block until ``/health`` answers 200 (returns seconds since start); ConnectError with the
        log's tail when the process exits or ``startup_timeout`` passes (the server is stopped and its
        temporary directory removed)."""
        deadline = self._t_start + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                why = f"exited with code {self.proc.returncode} during start-up"
                break
            with contextlib.suppress(urllib.error.URLError, OSError, TimeoutError), \
                    urllib.request.urlopen(f"{self.base_url}/health", timeout=2.0) as r:  # noqa: S310
                if r.status == 200:
                    self.startup_s = time.monotonic() - self._t_start
                    return self.startup_s
            if time.monotonic() > deadline:
                why = f"did not answer /health within {self.startup_timeout:g} s"
                break
            time.sleep(1.0)
        try:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        except OSError:
            tail = ""
        self.cleanup()
        raise ConnectError(f"the vLLM server {why}:\n{tail}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``timeout`` (idempotent)."""
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout)
        if p is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # workers left in the group
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def cleanup(self) -> None:
        """Stop, then remove the temporary directory (sockets, and the log unless given a path)."""
        self.stop()
        self.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


def output_ids(answer: dict) -> list[int]:
    """The generated token ids of a /v1/completions answer (``return_token_ids``)."""
    ids = answer["choices"][0].get("token_ids")
    if ids is None:
        raise ConnectError("the answer has no token_ids; this vLLM does not support return_token_ids")
    return list(ids)


def cached_tokens(answer: dict) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hit tokens) when the server reports it."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    v = details.get("cached_tokens")
    return None if v is None else int(v)


def top_logprobs(answer: dict) -> list[dict[int, float]]:
    """Per generated token, {token id: logprob} of the top candidates (``logprobs=k`` with
    ``return_tokens_as_token_ids``: keys arrive as 'token_id:123')."""
    lp = answer["choices"][0].get("logprobs") or {}
    return [{int(k.split(":", 1)[1]) if isinstance(k, str) and k.startswith("token_id:") else k: v
             for k, v in (d or {}).items()} for d in lp.get("top_logprobs") or []]
