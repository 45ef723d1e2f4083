"""Ctrl-C for the commands (wedlm-decode, wedlm-serve, wedlm-train): at any moment the process
exits 130 with one line on stderr, never a swallowed interrupt, a run that goes on, or a crash.

    early(prog, __name__)          at the top of a command's module, before its heavy imports:
                                   when it runs as the command, Ctrl-C from then on ends it
    with guard(prog, line):        main's body: Ctrl-C prints `line` and ends the process at once
                                   (os._exit(130) after flushing stdio), even in native code
    say(line)                      the line a Ctrl-C prints from now on (the phase in words)
    with graceful():               a loop that stops itself at its safe points: Ctrl-C only asks
                                   (`check()` raises KeyboardInterrupt there); a second one ends
                                   the process at once
    check()                        at a safe point: KeyboardInterrupt when a stop was asked

Python's own Ctrl-C raises KeyboardInterrupt wherever the interpreter happens to be, a garbage
collector callback included (where it is printed as "Exception ignored" and lost) or an import
half done. Here the Python-level handler never raises: it ends the process or records the ask.
A SIGINT that arrives while the main thread is inside a long native call (a compile) is seen at
once by a watcher thread reading the signal wakeup pipe, which ends the process the same way
unless another handler (uvicorn's, the training loop's) owns SIGINT then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

EXIT_CODE = 130
_lock = threading.Lock()
_state = {"prog": None, "line": "", "graceful": False, "asked": False, "exiting": False,
          "watcher": None}


def _line() -> str:
    return _state["line"] or f"{_state['prog']}: interrupted (Ctrl-C)"


def exit_now() -> None:
    """Print the current line and end the process with 130 (once, whichever thread comes first)."""
    with _lock:
        if _state["exiting"]:
            return
        _state["exiting"] = True
    if threading.current_thread() is threading.main_thread():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, ("\n" + _line() + "\n").encode())
    os._exit(EXIT_CODE)


def _handler(signum, frame) -> None:
    if _state["graceful"] and not _state["asked"]:
        _state["asked"] = True
        return
    exit_now()


def _watch(read_fd: int) -> None:
    """The watcher thread: each byte is a signal's number, written by the C-level handler even
    while the main thread runs native code."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if (signal.SIGINT in data and signal.getsignal(signal.SIGINT) is _handler
                and not _state["graceful"]):
            exit_now()


def _install(prog: str) -> None:
    _state["prog"] = _state["prog"] or prog
    signal.signal(signal.SIGINT, _handler)
    if _state["watcher"] is None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:          # not the main thread: the Python-level handler alone
            os.close(read_fd)
            os.close(write_fd)
            return
        thread = threading.Thread(target=_watch, args=(read_fd,), name="ctrl-c", daemon=True)
        thread.start()
        _state["watcher"] = (read_fd, write_fd)


def early(prog: str, module_name: str) -> None:
    """Ctrl-C ends the process (one line, 130) from now on, when `module_name` runs as the
    command `prog` (python -m, or its console script); a module imported by others is left alone."""
    if module_name == "__main__" or os.path.basename(sys.argv[0] or "") == prog:
        _install(prog)


def say(line: str) -> None:
    """The line a Ctrl-C prints from now on."""
    _state["line"] = line


@contextlib.contextmanager
def guard(prog: str, line: str = ""):
    """Within: Ctrl-C prints `line` (or what `say` set since) and exits 130 at once. On leaving,
    the handlers of before come back (a caller in the same process keeps its own Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    watcher, prog_before = _state["watcher"], _state["prog"]
    _state["prog"], _state["line"] = prog, line
    _install(prog)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
        _state["prog"] = prog_before
        if watcher is None and _state["watcher"] is not None:
            signal.set_wakeup_fd(-1)
            os.close(_state["watcher"][1])      # the watcher's read ends: it returns
            _state["watcher"] = None


@contextlib.contextmanager
def graceful():
    """Within: the first Ctrl-C asks the loop to stop (`check()` raises KeyboardInterrupt at its
    next safe point), a second ends the process at once. Outside a `guard`, Python's own
    KeyboardInterrupt stays as it was."""
    if signal.getsignal(signal.SIGINT) is not _handler:
        yield
        return
    _state["graceful"], _state["asked"] = True, False
    try:
        yield
    finally:
        _state["graceful"] = False


def check() -> None:
    """KeyboardInterrupt when a Ctrl-C asked the loop to stop (inside `graceful()`)."""
    if _state["graceful"] and _state["asked"]:
        raise KeyboardInterrupt
