"""The ``oprag`` console script's entry point (``[project.scripts] oprag = "oprag_client.cli_entry:main"``).

It is reached before the command line's heavy imports (grpc, the client, argparse: 0.3-3 s on a loaded machine), so a
Ctrl-C (SIGINT) during them ends the command as one during its call does (README: ``oprag: interrupted (Ctrl-C)`` on
stderr, no traceback, exit status 130, with ``--json`` the ``CANCELLED`` object; trial51b F1: a traceback ending in
KeyboardInterrupt, and death by SIGINT). Hence this module imports only the standard library's ``signal`` and ``sys``
at module level, and the package's ``__init__`` imports nothing. Once a command has its result (said it on stdout or
stderr), a late Ctrl-C changes neither its output nor its exit status (:func:`settle`; F2: a SIGINT as ``oprag stats
--json`` exited after printing UNAVAILABLE killed it: ``$?`` said interrupted, the output UNAVAILABLE).
"""

from __future__ import annotations

import signal
import sys

#: what a command cut short by Ctrl-C (SIGINT) says (``code`` ``CANCELLED`` with ``--json``), and its exit status
#: (128 + SIGINT, as a shell reports a command the signal ended)
INTERRUPTED, INTERRUPTED_STATUS = "interrupted (Ctrl-C)", 130

_sigint = False  # a SIGINT came while this entry point's handler was installed
_settled = False  # the command has its result: a SIGINT now is ignored (under this entry point's handler)


def _on_sigint(signum, frame) -> None:
    """The SIGINT handler from the first moment of :func:`main`: KeyboardInterrupt as Python's own handler raises it,
    remembered (an interrupted import may surface as an ImportError instead), or nothing once :func:`settle` ran."""
    global _sigint
    if _settled:
        return
    _sigint = True
    raise KeyboardInterrupt


def settle() -> None:
    """The command has its result (it is printing it): under :func:`main`, a Ctrl-C from now on is ignored, so it
    neither prints a second object nor changes the exit status. Called by the commands' output paths (``cli_util``);
    does nothing visible where :func:`main` did not install its handler (``cli.main`` called as a library)."""
    global _settled
    _settled = True


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C: a KeyboardInterrupt, or an ImportError raised after a SIGINT came (an extension
    module interrupted while it initialised: "Failed to import 'zlib.decompress' - cannot initialise module strings",
    seen during grpc's import)."""
    return isinstance(exc, KeyboardInterrupt) or (isinstance(exc, ImportError) and _sigint)


def plain_sigint() -> None:
    """Python's own SIGINT handler again (before a plugin command such as ``serve`` runs: ``asyncio.run`` installs its
    Ctrl-C handling only over that one, and the server handles its signals itself)."""
    if signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _set_sigint(handler) -> None:
    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no handler of its own
        pass


#: the totals of an ingest before its first stream
_TOTALS0 = {"documents": 0, "chunks": 0, "replaced": 0, "reused": 0, "rejected": (), "chunks_split": 0, "seq": 0}


def _summary(totals: dict, streams: list, el: float) -> dict:
    """``oprag ingest --json``'s object (README), from the totals of the committed streams (here, not in
    ``cli_ingest``, so that an ingest interrupted before grpc was imported prints it too)."""
    return {
        "documents": totals["documents"],
        "chunks": totals["chunks"],
        "replaced": totals["replaced"],
        "chunks_split": totals["chunks_split"],
        "chunks_reused": totals["reused"],
        "rejected": list(totals["rejected"]),
        "elapsed_s": round(el, 3),
        "documents_per_s": round(totals["documents"] / el, 2) if el else 0.0,
        "chunks_per_s": round(totals["chunks"] / el, 2) if el else 0.0,
        "seq": totals["seq"],
        "streams": streams,
    }


def refused_json(msg: str, code: str | None = "USAGE", stored: bool | None = False) -> dict:
    """``oprag ingest --json``'s object for an ingest that sent nothing: every key of a summary (zeros) and ``error``
    (``stream`` 0). ``code`` ``USAGE``: its arguments were refused (exit status 2, as every command's: trial51, was
    null); None: its input held no document."""
    return {**_summary(_TOTALS0, [], 0.0), "error": {"stream": 0, "first_index": 0, "code": code, "message": msg,
                                                      "stored": stored}}


def _report_interrupt(argv: list[str]) -> int:
    """What a command interrupted outside its own handling (while starting) says: ``oprag: interrupted (Ctrl-C)``, exit
    status 130, with ``--json`` the ``CANCELLED`` object (ingest: its summary; nothing was sent: ``stored`` false)."""
    settle()  # (a second Ctrl-C while this is said changes nothing)
    if "--json" in argv:
        import json  # noqa: PLC0415

        command = next((t for t in argv if not t.startswith("-")), None)
        obj = (refused_json(INTERRUPTED, "CANCELLED") if command == "ingest"
               else {"error": {"code": "CANCELLED", "message": INTERRUPTED}})
        try:
            print(json.dumps(obj), flush=True)
        except (BrokenPipeError, OSError):  # (the reader has gone)
            pass
    print(f"oprag: {INTERRUPTED}", file=sys.stderr, flush=True)
    return INTERRUPTED_STATUS


def main(argv: list[str] | None = None) -> int:
    """The ``oprag`` command: :func:`oprag_client.cli.main`, imported and run with this module's SIGINT handler (a
    Ctrl-C from the first import on is the interrupt README describes); once it returned, SIGINT is ignored, so that
    the interpreter's exit (grpc's shutdown: ~0.3 s) keeps its exit status."""
    global _sigint, _settled
    _sigint = _settled = False
    _set_sigint(_on_sigint)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        from .cli import main as run  # noqa: PLC0415

        return run(argv)
    except (KeyboardInterrupt, ImportError) as exc:
        if not interrupted(exc):
            raise
        return _report_interrupt(argv)
    finally:
        _settled = True
        _set_sigint(signal.SIG_IGN)


if __name__ == "__main__":  # python -m oprag_client.cli_entry, as the console script (the module, not __main__: its
    from oprag_client.cli_entry import main as _main  # handler and settle() must share one state)

    sys.exit(_main())
