"""outlines-core's JSON-schema-to-regex, run in a child process with bounded memory and time.

Its construction is exponential on some real schemas: an object of many optional properties, some
of them free-form objects, writes each property's pattern into every ordering of the ones after
it (MaskBench's Github_medium o33692, 17 optional properties: 2.3 MB of regex at 10, 615 MB at 13,
then an allocation the process dies of). In the server's own process that would take the server
down; here the child dies alone and the schema is refused by name for the device tables (the host
backend, which needs no regex, takes it).

    regex_from_schema(schema_text, whitespace, field) -> str     DecodeConfigError when too large
"""

from __future__ import annotations

import multiprocessing
import threading

from decode.config import DecodeConfigError

MEMORY_LIMIT = 2 << 30        # bytes of address space the child may map
TIMEOUT_S = 20.0              # seconds one schema may take
MAX_REGEX_CHARS = 4_000_000   # longer regexes are not sent back (no device table is built of one)


def _limit_memory() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _in_place(schema_text: str, whitespace: str):
    from outlines_core.json_schema import build_regex_from_schema
    try:
        regex = build_regex_from_schema(schema_text, whitespace)
    except (ValueError, TypeError) as e:
        return "bad", str(e)
    return ("ok", regex) if len(regex) <= MAX_REGEX_CHARS else ("long", len(regex))


def _serve(conn) -> None:
    """The child: (schema text, whitespace) in, ("ok", regex) / ("long", chars) / ("bad", message)
    out, until None."""
    _limit_memory()
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(_in_place(*job))


class Builder:
    """One child process, started on first use and again after it dies or overruns."""

    def __init__(self):
        self.lock, self.proc, self.conn = threading.Lock(), None, None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True,
                                name="schema-regex")
        self.proc.start()
        child.close()

    def _stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(5)
        self.proc = self.conn = None

    def build(self, schema_text: str, whitespace: str, timeout_s: float = TIMEOUT_S):
        """("ok", regex) | ("long", chars) | ("bad", message) | ("died", None) | ("slow", None).
        A daemonic process may not start children: there the build runs in place, unbounded."""
        if multiprocessing.current_process().daemon:
            return _in_place(schema_text, whitespace)
        with self.lock:
            if self.proc is None or not self.proc.is_alive():
                self._start()
            try:
                self.conn.send((schema_text, whitespace))
                if not self.conn.poll(timeout_s):
                    self._stop()
                    return "slow", None
                return self.conn.recv()
            except (EOFError, OSError):
                self._stop()
                return "died", None


BUILDER = Builder()


def regex_from_schema(schema_text: str, whitespace: str, field: str) -> str:
    """The schema's regular expression; a DecodeConfigError naming `field` when outlines-core
    refuses it, or its regex outgrows the memory, the time or MAX_REGEX_CHARS."""
    status, value = BUILDER.build(schema_text, whitespace)
    if status == "ok":
        return value
    if status == "bad":
        raise DecodeConfigError(f"{field}: unsupported JSON schema ({value})", field)
    size = (f"{value:,} characters" if status == "long" else
            f"over {MEMORY_LIMIT >> 30} GiB" if status == "died" else f"over {TIMEOUT_S:g} s")
    raise DecodeConfigError(f"{field}: the schema's regular expression for the device tables is "
                            f"too large ({size}; optional properties multiply it); the host "
                            f"backend takes it", field)
