"""A stub OpenAI-compatible judge on 127.0.0.1 that answers at random: ``/v1/chat/completions`` replies
"score: N" with N drawn from the OS's entropy (never the same twice, as a hosted judge need not be), after a
random delay; it counts the requests it answered."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RANDOM = random.SystemRandom()


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        time.sleep(_RANDOM.random() * 0.02)
        content = f"score: {_RANDOM.randrange(0, 10)}" if self.server.parseable else "I cannot say."
        reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        with self.server.lock:
            self.server.requests.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


class StubJudge:
    """``with StubJudge() as stub: stub.url`` — the API base of a running stub."""

    def __init__(self, parseable: bool = True):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.requests, self.server.lock, self.server.parseable = [], threading.Lock(), parseable
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @property
    def requests(self) -> list:
        return self.server.requests

    def __enter__(self) -> StubJudge:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
