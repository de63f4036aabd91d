"""The OpenAI server against hostile or failing conditions, on a real server subprocess on
127.0.0.1 (a tiny random checkpoint, CPU) started with small bounds:

1. a chat template sent with a request is refused (the server does not trust request templates
   unless told to), the model's own renders;
2. a body over --max-request-body-bytes is a 413, declared or streamed;
3. connections that send part of a request's head, or part of its body, and stop are closed
   within the bounds (--request-header-timeout, --request-body-timeout), and others are served;
4. /health fails (503) while the engine's process is stopped (SIGSTOP), and recovers;
5. when the engine's process dies, the server exits with a non-zero code and says why (last).

In process: /health's "no progress with requests in it", and uvicorn's settings. Every loop is
bounded in count and time.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, os.path.dirname(__file__))

from helpers import BLOCK, tiny_checkpoint  # noqa: E402

from nanovllm.serve.launcher import ServerProcess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_BODY = 64 << 10
STALL_S = 2.0
ARGS = ["--device", "cpu", "--kvcache-block-size", str(BLOCK), "--num-kvcache-blocks", "64", "--log-level", "warning",
        "--preparer-workers", "1", "--max-request-body-bytes", str(MAX_BODY), "--request-header-timeout", "1",
        "--request-body-timeout", "1", "--engine-stall-timeout", str(STALL_S)]
MESSAGES = [{"role": "user", "content": "hi"}]
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's nanovllm
    proc = ServerProcess(tiny_checkpoint(tmp_path_factory, "gqa"), ARGS, timeout=180, cwd=ROOT, env=env)
    yield proc
    proc.stop(30)


def post(server, route: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=DEADLINE_S, **kw)


def served(server) -> bool:
    r = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_a_request_chat_template_is_refused_without_trust(server):
    evil = "{% for i in range(600) %}{% for j in range(600) %}{% endfor %}{% endfor %}"
    for route, body in [("/v1/chat/completions", {"messages": MESSAGES, "chat_template": evil}),
                        ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": evil}}),
                        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": evil}}),
                        ("/tokenize", {"messages": MESSAGES, "chat_template": evil})]:
        t = time.monotonic()
        r = post(server, route, body)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "chat_template" and time.monotonic() - t < 10
    assert post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}).status_code == 200
    assert post(server, "/tokenize", {"messages": MESSAGES}).json()["count"] > 0


def test_a_body_over_the_limit_is_a_413(server):
    big = {"prompt": "x", "user": "u" * MAX_BODY}
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"], r.text

    def chunks():  # no content-length: the body is counted as it arrives
        for _ in range(MAX_BODY // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=DEADLINE_S,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert served(server)


def _half_sent(server, with_head: bool) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    if with_head:  # the whole head, 10 of 1,000 bytes of the body
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\":")
    else:  # part of the head
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    return sock


def test_half_sent_requests_are_dropped_in_bounded_time(server):
    socks = [_half_sent(server, with_head=i % 2 == 1) for i in range(40)]
    t0 = time.monotonic()
    try:
        assert served(server)  # (meanwhile)
        answers = []
        for sock in socks:
            data = b""
            sock.settimeout(max(0.1, t0 + 20 - time.monotonic()))
            while chunk := sock.recv(65536):  # (a timeout here: the server kept the connection open)
                data += chunk
            answers.append(data)
    finally:
        for sock in socks:
            sock.close()
    assert time.monotonic() - t0 < 20
    # a half-sent body is answered 408 before the connection closes; a half-sent head just closes
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers[1::2]), answers[1]
    assert all(a == b"" for a in answers[::2]), answers[0]
    assert served(server)


def test_health_fails_while_the_engine_is_stopped_and_recovers(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    os.kill(server.engine_pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + STALL_S + 20
        while (r := httpx.get(server.url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health did not see the stopped engine"
            time.sleep(0.2)
        assert r.status_code == 503 and "not answered" in r.json()["reason"], r.text
    finally:
        os.kill(server.engine_pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while httpx.get(server.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "/health did not recover"
        time.sleep(0.2)
    assert served(server)


def test_health_fails_when_requests_make_no_progress():
    """The other stall: the engine answers (its heartbeat) but its loop has not moved for longer
    than the bound while requests are in it (a hung step). In process, on a stand-in engine."""
    from nanovllm.serve.async_engine import EngineStats
    from nanovllm.serve.routes import OpenAIServer, ServeOptions

    class Engine:
        running, heard_at = True, time.monotonic()
        stats = EngineStats(8, 6, running=1, waiting=0, requests=1, steps=5, progress_at=time.monotonic() - 10)

    server = OpenAIServer(Engine(), "m", options=ServeOptions(engine_stall_s=5.0))
    r = server.health()
    assert r.status_code == 503 and b"no progress for 1" in r.body
    Engine.stats = EngineStats(8, 8, 0, 0, 0, 5, progress_at=time.monotonic() - 100)  # idle: fine
    assert server.health().status_code == 200
    Engine.heard_at = time.monotonic() - 6
    assert server.health().status_code == 503


def test_uvicorn_gets_the_connection_bounds():
    from nanovllm.serve.http_server import MAX_HEADER_BYTES, uvicorn_config

    config = uvicorn_config(object(), "warning", 5.0, head_timeout=3.0, keep_alive=4.0, limit_concurrency=None)
    assert config.limit_concurrency >= 64 and config.timeout_keep_alive == 4.0
    assert config.h11_max_incomplete_event_size == MAX_HEADER_BYTES and config.http.__name__ == "HeadDeadline"
    assert uvicorn_config(object(), "warning", 5.0, 3.0, 4.0, limit_concurrency=7).limit_concurrency == 7


def test_the_server_exits_non_zero_when_its_engine_dies(server):  # (last: it ends the module's server)
    os.kill(server.engine_pid, signal.SIGKILL)
    try:
        code = server.proc.wait(30)
    except Exception:
        pytest.fail("the server outlived its engine: " + "\n".join(list(server.log)[-20:]))
    assert code != 0
    assert any("engine died" in line for line in server.log), "\n".join(server.log)
