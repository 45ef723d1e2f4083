"""wedlm-serve from launch to ready: the port opens at once, the checkpoint loads and the programs
compile on a thread behind it (decode/serving/serve.py), and `Startup` answers meanwhile.

    startup = Startup()                  # the ASGI app uvicorn serves from launch
    startup.phase("reading the checkpoint")
    startup.progress(name, seconds)      # a program compiled: a log line, the bar on a terminal
    startup.ready(engine, app, parser_programs)   # from now on every request goes to `app`

Probes: GET /health is liveness, 200 from launch (its `status` says "starting" until ready, then
the engine's health report as before); GET /ready is readiness, 503 with Retry-After until every
program is compiled, then 200 while the engine accepts work; its `host_parser_programs` says
whether the programs with the host constraint parser's call, compiled after ready, are
"compiling" (the requests that need them wait in the queue), "compiled", or left to compile "on
first use". Before ready every other path is 503 with Retry-After and an OpenAI error body (code
"unavailable"), never a refused connection.
"""

from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("wedlm-serve")
RETRY_AFTER_S = 5


class Startup:
    """The ASGI application of wedlm-serve: answers while loading, then hands every request to
    the real application (`ready`)."""

    def __init__(self, total_programs: int = 0):
        self.t0 = time.monotonic()
        self.app = None
        self.engine = None
        self.what = "starting"
        self.done = 0
        self.total = total_programs
        self.bar = None
        self.parser_programs = None      # decode.engine.runtime.parser_programs.ParserPrograms, or None

    @property
    def is_ready(self) -> bool:
        return self.app is not None

    def phase(self, what: str) -> None:
        self.what = what
        log.info("%s (%.1f s since launch)", what, self.elapsed())

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def expect(self, total_programs: int) -> None:
        """The number of programs the warm-up compiles (the bar's length, on a terminal)."""
        self.total = total_programs
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_programs, unit="program", desc="wedlm-serve compile",
                            file=sys.stderr, dynamic_ncols=True, leave=False)

    def progress(self, name: str, seconds: float) -> None:
        """One program compiled (run once): logged with its time, the bar moved."""
        self.done += 1
        self.what = f"compiling ({self.done}/{self.total or '?'} programs)"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(name)
        log.info("compiled %s in %.1f s (%d/%s)", name, seconds, self.done, self.total or "?")

    def ready(self, engine, app, parser_programs=None) -> None:
        if self.bar is not None:
            self.bar.close()
        self.parser_programs = parser_programs
        self.engine = engine
        self.app = app
        log.info("ready %.1f s after launch", self.elapsed())

    def _state(self) -> dict:
        return {"status": "starting", "phase": self.what, "programs_compiled": self.done,
                "programs": self.total, "seconds_since_launch": round(self.elapsed(), 1)}

    def readiness(self) -> tuple[dict, int]:
        """(body, status) of GET /ready."""
        if not self.is_ready:
            return {**self._state(), "ready": False}, 503
        ok = self.engine.accepting
        body = {"status": "ok" if ok else "stopping", "ready": ok,
                "seconds_since_launch": round(self.elapsed(), 1)}
        family = self.parser_programs
        if family is not None:
            body["host_parser_programs"] = ("compiled" if family.ready and not family.error else
                                            "compiling" if family.holding else "on first use")
        return body, 200 if ok else 503

    def unavailable(self) -> dict:
        """The OpenAI error body of a request that came before ready."""
        return {"error": {"message": f"the server is starting ({self.what}, "
                                     f"{self.elapsed():.0f} s since launch); retry after "
                                     f"{RETRY_AFTER_S} s or wait for GET /ready to answer 200",
                          "type": "server_error", "param": None, "code": "unavailable"}}

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and path == "/ready":
            body, status = self.readiness()
            return await _answer(send, status, body)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":      # lifespan is off; a websocket is not served
            return None
        if path == "/health":
            return await _answer(send, 200, self._state())
        return await _answer(send, 503, self.unavailable())


async def _answer(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
