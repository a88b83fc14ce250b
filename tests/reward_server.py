"""A real reward server on 127.0.0.1 for the tests (a thread of the test process), scripted per
request: each request takes the next behaviour of ``script`` (the last one repeats):

* ``ok``: ``{"scores": [len(completion) % 2 == 0 ...]}`` (1.0 / 0.0; null for an empty completion);
* ``slow``: the same after ``delay`` seconds; ``hang``: never answers (until the server stops);
* ``500`` / ``404``: that status; ``garbage``: a body that is not JSON; ``short``: one score too few.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Local:
    """A ThreadingHTTPServer on 127.0.0.1 serving ``handler`` in a thread while the ``with`` block runs."""

    def _serve(self, handler, path: str) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.stopping = threading.Event()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class RewardServer(_Local):
    """A reward server (alignment/rewards/remote.py's protocol) following ``script`` request by request; with
    ``key``, a request without ``Authorization: Bearer <key>`` is answered 401 (``headers``: every request's)."""

    def __init__(self, script: list[str], delay: float = 2.0, key: str | None = None):
        self.script, self.delay, self.requests, self.key, self.headers = list(script), delay, [], key, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.headers.append(dict(self.headers))
                if server.key is not None and self.headers.get("Authorization") != f"Bearer {server.key}":
                    self.send_error(401)
                    return
                server.requests.append(body)
                what = server.script[min(len(server.requests), len(server.script)) - 1]
                if what == "hang":
                    server.stopping.wait(60)
                    return
                if what in ("500", "404"):
                    self.send_error(int(what))
                    return
                if what == "slow":
                    time.sleep(server.delay)
                scores = [None if not c else float(len(c) % 2 == 0) for c in body["completions"]]
                data = b"<html>oops" if what == "garbage" else json.dumps(
                    {"scores": scores[:-1] if what == "short" else scores}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._serve(Handler, "/score")


class ScriptedJudge(_Local):
    """An OpenAI-compatible endpoint (``GET /v1/models``, ``POST /v1/chat/completions``) on 127.0.0.1
    whose reply is ``reply(user_message)``; ``fail``: answer every completion request with a 500."""

    def __init__(self, reply, model: str = "judge-1", fail: bool = False):
        self.reply, self.requests = reply, []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: dict, status: int = 200):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._send({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                        "owned_by": "test"}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append(body)
                if fail:
                    self._send({"error": {"message": "overloaded"}}, 500)
                    return
                text = judge.reply(body["messages"][-1]["content"])
                self._send({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": text}}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self._serve(Handler, "/v1")


def shorter_wins(message: str) -> str:
    """A pairwise judge's reply to ``alignment.rewards.judge.PAIR_TEMPLATE``: the shorter answer is better
    (``[[A]]`` / ``[[B]]``), equal lengths tie (``[[C]]``)."""
    a = message.split("[Answer A]\n", 1)[1].split("\n[Answer B]\n", 1)
    b = a[1].rsplit("\nReply [[A]]", 1)[0]
    return "[[C]]" if len(a[0]) == len(b) else ("Verdict: [[A]]" if len(a[0]) < len(b) else "[[B]] is better")
