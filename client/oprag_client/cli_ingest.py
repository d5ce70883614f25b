"""``oprag ingest``: files -> loaders -> Ingest streams of ``--docs-per-stream`` documents, with a
progress bar and a summary (README: "oprag ingest")."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import grpc

from .cli_entry import _TOTALS0, _summary, interrupted, refused_json, settle  # noqa: F401  (refused_json: cli)
from .cli_util import INTERRUPTED, INTERRUPTED_STATUS, _client, _fail, _rpc_message
from .retry import nothing_stored


def _fitting(numbered, max_message_bytes: int, rejected: list[dict]):
    """The ``(input position, wire Document)`` pairs of ``numbered`` that fit in one Ingest message
    (each converted once here: the client sends the converted one as it is); each that does not is
    added to ``rejected`` (as the server's rejections: index, id, reason) instead of failing its
    whole stream (trial35: a 40 MB document stopped the stream, a 9 MB one was the server's
    per-document rejection)."""
    from .client import _as_pb, oversized, too_large

    for i, d in numbered:
        pb = _as_pb(d)
        size = oversized(pb, max_message_bytes)
        if size is None:
            yield i, pb
            continue
        rejected.append({"index": i, "id": pb.id, "reason": f"document {too_large(size, max_message_bytes)}"})


def _batches(it, n):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


#: a failed stream whose outcome the client cannot know: its deadline passed (or it was cancelled)
#: perhaps after its final message, while the server committed it (README: "Ingest semantics")
UNKNOWN_OUTCOME = ("DEADLINE_EXCEEDED", "CANCELLED")


def outcome_unknown(exc: grpc.RpcError) -> bool:
    """Whether the stream that failed with ``exc`` may have been committed: a status of
    :data:`UNKNOWN_OUTCOME`, or ``UNAVAILABLE`` once gRPC had the stream's final message (the
    connection lost or the server gone while it committed: trial35 found a stream reported
    "stored nothing" that a kill -9 during its commit had stored). Any other status is the server's refusal:
    nothing stored. What :func:`.retry.nothing_stored` finds (the server's trailer ``oprag-stored: none``, a
    connection never made, gRPC's own size refusal) stored nothing, whatever its code."""
    if nothing_stored(exc):
        return False
    code = exc.code().name
    if code in UNKNOWN_OUTCOME:
        return True
    return code == "UNAVAILABLE" and getattr(exc, "final_message_sent", True)


def _committed_before_failure(n: int, sent: int, seq: int, code: str | None = None, unknown: bool | None = None,
                              first: int | None = None) -> None:
    """Say what a failed ``oprag ingest`` stored: the streams before stream ``n`` committed (``sent``
    documents of the input), stream ``n`` stored nothing (an ingest stream is all-or-nothing) --
    or, when its outcome is ``unknown`` (:func:`outcome_unknown`; None: ``code`` is in
    :data:`UNKNOWN_OUTCOME`), stored whole or nothing; RESOURCE_EXHAUSTED: the server refused it
    before it started (no ingest slot came free): it stored nothing, retry later."""
    if unknown is None:
        unknown = code in UNKNOWN_OUTCOME
    if n > 1:
        done = "stream 1 was" if n == 2 else f"streams 1-{n - 1} were"
        done = f"{done} committed (the first {sent} documents of the input, seq {seq})"
    else:
        done = "no stream was committed"
    failed = f"stream {n} (its document 0 is input document #{sent if first is None else first})"
    if unknown:
        how = (" after its final message was sent (the connection was lost, or the server failed while it "
               "committed)" if code == "UNAVAILABLE" else " before the server answered")
        failed += (f" ended {code}{how}: it is stored whole or not at all (read it back, or send it again: "
                   "re-ingesting an id replaces it); the rest stored nothing")
    elif code == "RESOURCE_EXHAUSTED":  # (the server's ingest slots were all taken: README "Ingest streams")
        failed += (" was refused before the server started it: it and the rest stored nothing; retry later (the "
                   "streams already committed may be sent again: re-ingesting an id replaces it)")
    else:
        failed += " and the rest stored nothing"
    print(f"oprag: {done}; {failed}", file=sys.stderr)


#: file name suffixes that --format text (the default) would store as text, and the format they hold
_SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow"}

#: what --format jsonl / wikitext read, files only (a folder was "[Errno 21] Is a directory"), and an example name
_FILES = {"jsonl": ("JSON-lines files", "*.jsonl"), "wikitext": ("WikiText files", "valid.txt")}


def _not_a_file(paths: list[Path], fmt: str) -> str | None:
    """The message for a folder given where ``--format fmt`` reads a file (a ``beir`` folder must
    hold ``corpus.jsonl``), else None."""
    for p in map(Path, paths):
        if not p.is_dir():
            continue
        if fmt in _FILES:
            what, example = _FILES[fmt]
            return (f"{p} is a folder: --format {fmt} reads {what}; give the file(s) in it, e.g. {p / example} "
                    "(--format text, parquet and arrow read folders)")
        if fmt == "beir" and not (p / "corpus.jsonl").is_file():
            return (f"{p} is a folder without corpus.jsonl: --format beir reads a BEIR corpus.jsonl, or a folder "
                    "holding one; give the corpus file")
    return None


def cmd_ingest(a) -> int:
    """``oprag ingest``. With ``--json`` one JSON object on stdout, also when a stream fails
    (README: "oprag ingest"): the totals of the committed streams, ``streams`` (one entry per
    committed stream) and, on a failure, ``error`` (the stream that failed and why); exit 1 then."""
    from tqdm import tqdm

    from .loaders import LOADERS

    def refuse(msg: str, status: int = 2) -> int:  # nothing sent; with --json also one object on stdout (trial36),
        if a.json:  # with the keys of every other summary (trial38b); status 2: the arguments (code USAGE)
            print(json.dumps(refused_json(msg, "USAGE" if status == 2 else None)))
        return _fail(msg, status)

    # an argument refused (a missing path, a folder or an option the format does not take): USAGE, exit status 2
    missing = [str(p) for p in a.paths if not Path(p).exists()]
    if missing:  # (README groups it with a wrong --format; was exit status 1 and code null: trial51)
        return refuse(f"no such file or directory: {', '.join(missing)}")
    if a.format is None:  # (the default, text, stored a .jsonl file as one text document: trial35)
        other = [(p, _SUFFIX_FORMATS[Path(p).suffix.lower()]) for p in a.paths
                 if Path(p).is_file() and Path(p).suffix.lower() in _SUFFIX_FORMATS]
        if other:
            p, fmt = other[0]
            return refuse(f"{p} looks like --format {fmt} input, and without --format it would be stored as one text "
                         f"document: give --format {fmt} (or --format text to store it as text)")
        a.format = "text"
    wrong = _not_a_file(a.paths, a.format)
    if wrong:
        return refuse(wrong)
    if a.vector_column is not None and a.format not in ("parquet", "arrow"):
        return refuse(f"--vector-column is for --format parquet or arrow, not {a.format}")
    docs = LOADERS[a.format](a.paths, a.vector_column) if a.format in ("parquet", "arrow") else LOADERS[a.format](a.paths)
    totals = {**_TOTALS0, "rejected": []}
    streams: list[dict] = []  # one per committed stream (its acknowledgement)
    error, cut, unknown = None, False, None
    t0 = time.perf_counter()
    bar = tqdm(unit="doc", disable=a.no_progress, file=sys.stderr, dynamic_ncols=True)
    sent = 0  # documents of the input in the committed streams (a rejection's index is its position)
    nxt = 0  # the input position of the first document of the stream in flight
    try:
        with _client(a) as c:
            fit = _fitting(enumerate(docs), c.max_message_bytes, totals["rejected"])
            for n, batch in enumerate(_batches(fit, max(1, a.docs_per_stream)), 1):
                # the bar advances when a stream commits; say what is in flight meanwhile
                own = all(len(d.vector) or len(d.chunks) or d.vectors_f32 for _, d in batch)  # (own vectors: none embedded)
                bar.set_postfix_str(f"stream {n}: {len(batch)} documents sent, {'' if own else 'embedding and '}committing")
                nxt = batch[0][0]
                r = c.ingest([d for _, d in batch])
                offset, sent = nxt, batch[-1][0] + 1
                totals["documents"] += r.documents_written
                totals["chunks"] += r.chunks_written
                totals["replaced"] += r.documents_replaced
                totals["chunks_split"] += r.chunks_split
                totals["reused"] += r.chunks_reused
                totals["seq"] = r.seq
                totals["rejected"] += [{"index": batch[x.index][0], "id": x.id, "reason": x.reason} for x in r.rejected]
                # a loader error while the next stream is read fails that one, not this one
                streams.append({"stream": n, "first_index": offset, "documents_sent": len(batch),
                                "documents_written": r.documents_written, "chunks_written": r.chunks_written,
                                "rejected": len(r.rejected), "seq": r.seq})
                bar.update(len(batch))
                nxt = sent
                el = time.perf_counter() - t0
                bar.set_postfix(chunks=str(totals["chunks"]), chunks_per_s=f"{totals['chunks'] / el:.1f}")
    except grpc.RpcError as exc:
        error, unknown = {"code": exc.code().name, "message": _rpc_message(exc)}, outcome_unknown(exc)
        at = re.match(r"(?:[A-Z_]+: )?document (\d+) \(", error["message"])  # its position in the failed stream
        if at:  # (the server counts from the stream's first document: say which input document that is, trial28b)
            error["message"] += f" (document {at.group(1)} of stream {len(streams) + 1} is input document " \
                                f"#{nxt + int(at.group(1))})"
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and a.timeout:
            error["message"] += (f" (--timeout {a.timeout:g} s is each stream's deadline: its documents (up to "
                                 f"--docs-per-stream {a.docs_per_stream}) are embedded and committed within it; "
                                 "give a larger --timeout, or none)")
    except (ValueError, TypeError, FileNotFoundError, OSError, ImportError, KeyboardInterrupt) as exc:
        if interrupted(exc):  # Ctrl-C (or a lazy import it cut short): the stream in flight is cancelled (the channel
            # closed); say what was stored (was a traceback and no summary: trial28b)
            error, cut = {"code": "CANCELLED", "message": INTERRUPTED}, True
        else:
            error = {"code": None, "message": str(exc)}  # the input (or a local file) could not be read
    settle()  # (the outcome is known: a Ctrl-C while it is said changes nothing)
    bar.close()
    el = time.perf_counter() - t0
    if error is None and totals["documents"] == 0 and not totals["rejected"]:
        return refuse(f"no documents found in {' '.join(map(str, a.paths))} with --format {a.format}", 1)
    summary = _summary(totals, streams, el)
    for r in totals["rejected"]:
        print(f"rejected #{r['index']} {r['id']!r}: {r['reason']}", file=sys.stderr)
    if error is not None:  # the committed streams stay stored; the failed one: nothing, or unknown (UNKNOWN_OUTCOME)
        # also for an input error in stream 1 (said only the error, and not whether anything was stored: trial26)
        if unknown is None:  # (not a gRPC status: an input error, or Ctrl-C)
            unknown = error["code"] in UNKNOWN_OUTCOME
        _committed_before_failure(len(streams) + 1, sent, totals["seq"], error["code"], unknown, nxt)
        _fail(error["message"])
        if a.json:  # stored: false, or null when unknown
            stored = None if unknown else False
            print(json.dumps({**summary, "error": {"stream": len(streams) + 1, "first_index": nxt, **error,
                                                   "stored": stored}}))
        return INTERRUPTED_STATUS if cut else 1
    if a.json:
        print(json.dumps(summary))
    else:
        replaced = f" ({summary['replaced']} of them replaced documents with the same id)" if summary.get("replaced") else ""
        print(f"ingested {summary['documents']} documents{replaced}, {summary['chunks']} chunks in {el:.1f} s "
              f"({summary['chunks_per_s']} chunks/s); {len(summary['rejected'])} rejected")
    if totals["documents"] == 0:  # every document rejected: nothing stored is a failure (some rejected: not)
        return _fail(f"nothing stored: all {len(totals['rejected'])} documents were rejected (reasons above)")
    return 0
