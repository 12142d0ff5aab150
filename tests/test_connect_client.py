"""``Client.submit`` against a real local HTTP server: at most ``concurrency`` requests in flight, per call."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from paged.connect.server import Client


class _Completions(BaseHTTPRequestHandler):
    in_flight = peak = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        time.sleep(0.15)
        with cls.lock:
            cls.in_flight -= 1
        out = json.dumps({"choices": [{"text": body["prompt"][::-1]}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_each_submit_keeps_its_own_concurrency(server):
    client = Client(server, "m")
    try:
        for concurrency in (1, 3, 1):
            _Completions.peak = 0
            answers = client.submit([f"p{i}" for i in range(6)], 4, concurrency=concurrency).result(timeout=30)
            assert [a["choices"][0]["text"] for a in answers] == [f"{i}p" for i in range(6)]  # in order
            assert _Completions.peak == concurrency
    finally:
        client.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("paged-vllm-client") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("paged-vllm-client")]  # no thread left


def test_a_failed_request_fails_the_future_and_nothing_hangs(server):
    client = Client(server + "/nowhere", "m")  # POSTs to /nowhere/v1/completions: HTTP 404
    try:
        with pytest.raises(Exception, match="HTTP 404"):
            client.submit(["a", "b"], 2, concurrency=2).result(timeout=30)
        assert client.submit([], 2).result(timeout=1) == []
    finally:
        client.close()
