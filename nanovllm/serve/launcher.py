"""`python -m nanovllm.serve` as a subprocess on 127.0.0.1, for tests and benchmarks."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import threading
import time
import urllib.request

URL_LINE = "nanovllm.serve: "  # (cli.main prints "... engine pid N", then "... MODEL on http://HOST:PORT")


class ServerProcess:
    """`python -m nanovllm.serve MODEL ARGS... --port 0` as a subprocess on 127.0.0.1: started
    and healthy (GET /health) within `timeout` seconds, else a RuntimeError with the end of its
    log; `url` is its base URL ("http://127.0.0.1:PORT"), `engine_pid` its engine process's id,
    `log` the last lines of its output. `stop()` sends SIGTERM and returns the exit code
    (SIGKILL after `timeout`). A context manager. Standard library only."""

    def __init__(self, model: str, args: list[str] = (), timeout: float = 120.0, cwd: str | None = None,
                 env: dict | None = None):
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", model, "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=cwd, env=env)
        self._port = threading.Event()
        self.url = ""
        self.engine_pid: int | None = None
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop(10)
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if self._port.is_set() or not line.startswith(URL_LINE):
                continue
            if line.startswith(URL_LINE + "engine pid "):
                self.engine_pid = int(line.rsplit(" ", 1)[1])
            elif " on http://" in line:
                self.url = line.rsplit(" on ", 1)[1].strip()
                self._port.set()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n" + "\n".join(self.log))
            if self._port.wait(0.1):
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
        raise RuntimeError(f"the server was not healthy within {timeout} s:\n" + "\n".join(self.log))

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
