"""The ``oprag`` command: ingest, query, delete, clear-session, stats, eval, health.

Installed packages add commands through the entry point group ``oprag.commands`` (name ->
``main(argv) -> int``): the server's distribution adds ``serve`` that way, so ``oprag serve``
works with the full install while this package imports nothing from the server.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import grpc

from .cli_entry import interrupted, plain_sigint, refused_json, settle
from .cli_eval import cmd_eval
from .cli_ingest import cmd_ingest
from .cli_util import (INTERRUPTED, _add_server, _client, _count, _fail, _interrupted, _json_error,  # noqa: F401
                       _positive, _rpc_error, _seconds, _stdout_closed_ok, _weight)
from .client import FUSIONS, MAX_KNOB, MODES
from .metadata import metadata_of


class _Parser(argparse.ArgumentParser):
    """``oprag``'s parser: a refusal is the command's result (a Ctrl-C while it is said changes nothing)."""

    def error(self, message: str):
        settle()
        super().error(message)


class _SubcommandParser(_Parser):
    """A subcommand's parser: an unknown option is reported with this subcommand's usage (exit
    status 2). argparse passes a subparser's leftovers up to the top-level parser, which printed
    ``usage: oprag [-h] {...}`` for ``oprag query --bogus cells`` (trial24)."""

    #: the object a ``--json`` invocation prints on stdout when its arguments are refused (message -> dict)
    json_error = staticmethod(lambda msg: {"error": {"code": "USAGE", "message": msg}})

    def parse_known_args(self, args=None, namespace=None):
        self._json = args is not None and "--json" in args
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def error(self, message: str):
        """Usage and message on stderr, exit status 2; with ``--json`` also one JSON object on stdout (trial39:
        ``oprag ingest --json --format bogus`` printed none, while a refused path printed the summary)."""
        if getattr(self, "_json", False):
            print(json.dumps(self.json_error(message)))
        super().error(message)


def _parser(plugins: dict) -> argparse.ArgumentParser:
    """``oprag``'s parser; ``commands`` (an attribute): its commands' parsers by name, ``eval``'s by suite under
    ``"eval <suite>"`` (plugin commands: an empty parser, theirs parse their options)."""
    ap = _Parser(prog="oprag", description="OpRAG: multi-stage RAG runtime over gRPC")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_SubcommandParser)
    ap.commands = sub.choices

    for name in sorted(set(plugins) - set(COMMANDS)):
        sub.add_parser(name, help=f"see `oprag {name} --help`", add_help=False)

    i = sub.add_parser("ingest", help="stream documents into the service")
    i.json_error = refused_json  # (the summary's keys, as a refused path prints them)
    _add_server(i)
    i.add_argument("--format", choices=["text", "jsonl", "beir", "wikitext", "parquet", "arrow"], default=None,
                   help="input format (default: text: .txt/.md/.rst files of FILE|DIR, id = relative path; a .jsonl, "
                        ".parquet or .arrow file given without --format is refused); jsonl: "
                        "{id, text, title?, metadata?, vector?} lines; parquet / arrow: columns id, text, title?, "
                        "metadata?, vector? (or chunk rows with doc_id); needs pyarrow (pip install 'oprag-client[arrow]')")
    i.add_argument("--vector-column", default=None,
                   help="parquet / arrow: the column of precomputed vectors, which the file must then have "
                        "(default: 'vector' when the file has it)")
    i.add_argument("--docs-per-stream", type=_positive, default=256, help="documents per Ingest stream, each committed all-or-nothing (default: 256)")
    i.add_argument("--json", action="store_true", help="print a JSON summary object last")
    i.add_argument("--no-progress", action="store_true", help="no progress bar")
    i.add_argument("paths", nargs="+", type=Path, help="files or folders to read")

    q = sub.add_parser("query", help="ask a question")
    _add_server(q)
    q.add_argument("--top-k", type=_count, default=0, help="hits to return (0 = the server's default, 5; at most 100)")
    q.add_argument("--mode", choices=list(MODES), default="hybrid",
                   help="retrieval mode (default: hybrid, dense-first; full_hybrid scores every chunk)")
    q.add_argument("--session", default="", help="session id: follow-up questions use this session's earlier turns")
    q.add_argument("--no-memory", action="store_true", help="with --session: do not use or record memory")
    q.add_argument("--max-new-tokens", type=_count, default=0,
                   help="answer length in tokens (0 = the server's default, 64; at most 512)")
    q.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the answer just before this text (repeat for up to 4; the text is not printed)")
    q.add_argument("--candidates", type=_count, default=0,
                   help="dense-first window N (0 = the server's default, 256; max(64, 4 x top-k) for min-max "
                        "hybrid on a flat index; a server's --candidates / --hybrid-candidates change them; at most 4096)")
    q.add_argument("--fusion", choices=list(FUSIONS), default=None,
                   help="how --mode hybrid / full_hybrid combine the dense and the lexical ranking: minmax "
                        "(weighted min-max of the scores, WEIGHTED_MINMAX: the server's default) or rrf "
                        "(reciprocal rank fusion, RRF)")
    q.add_argument("--dense-weight", type=_weight, default=0.0, metavar="W",
                   help="weight of the dense list in the fusion (both weights 0 = the server's defaults, 0.5 "
                        "and 0.5; one given alone leaves the other 0: that list then counts for nothing; "
                        "each 0 or in [1e-12, 1e6])")
    q.add_argument("--lexical-weight", type=_weight, default=0.0, metavar="W",
                   help="weight of the lexical (BM25) list in the fusion, as --dense-weight")
    q.add_argument("--rrf-k", type=_rrf_k, default=0, metavar="K",
                   help="with --fusion rrf: the RRF constant k (0 = the server's default, 60; at most 100000)")
    q.add_argument("--ef-search", type=_knob, default=0, metavar="EF",
                   help="HNSW search beam of a server started with --dense-index hnsw (0 = its default; at most 65536)")
    q.add_argument("--nprobe", type=_knob, default=0,
                   help="IVF lists visited, for a server started with --dense-index ivf (0 = its default; at most 65536)")
    q.add_argument("--no-generate", action="store_true", help="retrieve only")
    q.add_argument("--json", action="store_true",
                   help="print the reply as one JSON object: answer, hits (with dense_rank / lexical_rank), "
                        "retrieval (what the server did: mode, fusion, candidates, certified, ...) and more "
                        "(README: oprag query --json)")
    q.add_argument("question", nargs="+", help="the question (several words need no quotes)")

    cs = sub.add_parser("clear-session", help="drop a session's memory records")
    _add_server(cs)
    cs.add_argument("--json", action="store_true", help='print {"records_removed": N} as one JSON object')
    cs.add_argument("session", help="the session id whose memory records to drop (as given to oprag query --session)")

    d = sub.add_parser("delete", help="delete documents by id")
    _add_server(d)
    d.add_argument("--json", action="store_true",
                   help='print {"documents_deleted", "chunks_deleted", "seq"} as one JSON object')
    d.add_argument("doc_ids", nargs="+", help="ids of the documents to delete, each with all its chunks")

    st = sub.add_parser("stats", help="corpus statistics")
    _add_server(st)
    st.add_argument("--json", action="store_true", help="print the statistics as one JSON line (default: indented)")

    e = sub.add_parser("eval", help="evaluate retrieval")
    esub = e.add_subparsers(dest="suite", required=True)
    eb = esub.add_parser("beir", help="BEIR queries + qrels: nDCG@10, Recall@100, MRR@10")
    _add_server(eb)
    eb.add_argument("--queries", type=Path, required=True)
    eb.add_argument("--qrels", type=Path, required=True)
    eb.add_argument("--mode", choices=list(MODES), default="hybrid")
    eb.add_argument("--top-k", type=_top_docs, default=100,
                    help="documents retrieved per query, 10 to 100 (default 100); Recall is reported at this depth (recall@100)")
    eb.add_argument("--candidates", type=_count, default=0,
                    help="chunk window N (0 = server default); hybrid mode groups documents from it")
    eb.add_argument("--concurrency", type=_positive, default=1)
    eb.add_argument("--limit", type=_count, default=0, help="evaluate only the first N judged queries (0: all)")

    h = sub.add_parser("health", help="grpc.health.v1 status: SERVING (exit status 0), NOT_SERVING, ... (1)")
    _add_server(h)
    h.add_argument("--service", default="", metavar="NAME",
                   help="the health service name to ask for (default: '', the whole server); oprag.v1.OpRAG.Ingest "
                        "is NOT_SERVING while writes fail or a shard is down, as queries go on")
    h.add_argument("--json", action="store_true", help='print {"service", "status"} as one JSON object')
    ap.commands = {**sub.choices, **{f"eval {name}": p for name, p in esub.choices.items()}}
    return ap


def _hit_json(h) -> dict:
    return {
        "chunk_id": h.chunk_id,
        "doc_id": h.doc_id,
        "title": h.title,
        "text": h.text,
        "score": h.score,
        "dense_score": h.dense_score,
        "lexical_score": h.lexical_score,
        "shard": h.shard,
        # 1-based ranks in the retrieval window's dense and lexical lists; 0: not in that list
        "dense_rank": h.dense_rank,
        "lexical_rank": h.lexical_rank,
        # typed (integers, floats and booleans as JSON numbers and booleans), keys sorted: the wire's maps have no order
        "metadata": dict(sorted(metadata_of(h).items())),
    }


def _retrieval_json(r) -> dict | None:
    """The reply's ``retrieval`` (RetrievalInfo: what the retrieve operator did) with every field
    under its proto name, defaults included (repeated fields as lists); None when the reply has none."""
    if not r.HasField("retrieval"):
        return None
    info = r.retrieval
    return {f.name: list(getattr(info, f.name)) if f.is_repeated else getattr(info, f.name)
            for f in info.DESCRIPTOR.fields}


def _fusion_kw(a) -> dict:
    """The fusion keywords of ``oprag query``'s options (none when no fusion option was given).

    :raises ValueError: a fusion option with ``--mode dense`` or ``lexical`` (which rank one list:
        the server would ignore it), ``--rrf-k`` without ``--fusion rrf``.
    """
    given = [flag for flag, v in (("--fusion", a.fusion), ("--dense-weight", a.dense_weight),
                                  ("--lexical-weight", a.lexical_weight), ("--rrf-k", a.rrf_k)) if v]
    if given and a.mode not in ("hybrid", "full_hybrid"):
        raise ValueError(f"{', '.join(given)}: fusion applies to --mode hybrid and full_hybrid only "
                         f"(--mode {a.mode} ranks one list)")
    if a.rrf_k and a.fusion != "rrf":
        raise ValueError("--rrf-k needs --fusion rrf (min-max fusion has no k)")
    if not given:
        return {}
    return dict(fusion=a.fusion or "minmax", dense_weight=a.dense_weight, lexical_weight=a.lexical_weight,
                rrf_k=a.rrf_k)


def _unused_options(a) -> None:
    """:raises ValueError: an ``oprag query`` option that would do nothing: ``--max-new-tokens`` or ``--stop``
    with ``--no-generate`` (nothing is generated), ``--no-memory`` without ``--session`` (memory
    is kept per session: without one there is none to use or record), ``--candidates`` with
    ``--mode dense`` or ``lexical`` (shards return the top-k of the one list), ``--ef-search`` / ``--nprobe`` with
    ``--mode lexical`` or ``full_hybrid`` (no approximate index is searched)."""
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--stop", a.stop)):
        if a.no_generate and value:
            raise ValueError(f"{flag}: --no-generate generates no answer (drop one of the two)")
    if a.no_memory and not a.session:
        raise ValueError("--no-memory needs --session (memory is kept per session; a query without one uses none)")
    if a.candidates and a.mode in ("dense", "lexical"):  # (accepted and echoed, hits unchanged: trial35)
        raise ValueError(f"--candidates: the window N applies to --mode hybrid and full_hybrid only (--mode {a.mode} "
                         "ranks one list: its top-k)")
    for flag, value in (("--ef-search", a.ef_search), ("--nprobe", a.nprobe)):  # (trial46 #6)
        if value and a.mode in ("lexical", "full_hybrid"):
            raise ValueError(f"{flag}: the approximate dense search's knob applies to --mode hybrid and dense only "
                             f"(--mode {a.mode} searches no approximate index)")


def cmd_query(a) -> int:
    _unused_options(a)
    question = " ".join(a.question)
    kw = dict(top_k=a.top_k, mode=a.mode, session_id=a.session, candidates=a.candidates,
              disable_memory=a.no_memory, ef_search=a.ef_search, nprobe=a.nprobe, **_fusion_kw(a))
    try:
        with _client(a) as c:
            if a.no_generate:
                r = c.retrieve(question, **kw)
                answer = None
            else:
                r = c.query(question, max_new_tokens=a.max_new_tokens, stop=a.stop, **kw)
                answer = r.answer
    except grpc.RpcError as exc:
        return _rpc_error(exc, a)
    if a.json:
        out = {"answer": answer, "hits": [_hit_json(h) for h in r.hits], "timings_ms": dict(r.timings_ms),
               "request_id": r.request_id, "memory_context": r.memory_context, "memory_used": r.memory_used,
               "resolved_query": r.resolved_query, "retrieval": _retrieval_json(r),
               "missing_shards": list(r.retrieval.missing_shards),  # (also in retrieval; kept for older readers)
               # why the answer ended: "stop", "length", "no_sources", "no_generator"; None: --no-generate
               "finish_reason": r.finish_reason if answer is not None else None}
        out["sources"] = None if answer is None else [  # (None with --no-generate, as finish_reason: trial39)
            {"number": s.number, "chunk_id": s.chunk_id, "doc_id": s.doc_id, "title": s.title,
             "truncated": s.truncated} for s in r.sources]
        print(json.dumps(out, ensure_ascii=False))
        return _partial(r)
    if r.memory_context:
        print(f"(memory: {r.memory_context})")
    if answer is not None and getattr(r, "finish_reason", "") == "no_generator":
        print("(no answer: the server runs without a generator, --generator none; the hits follow)")
        answer = None
    elif answer is not None and getattr(r, "finish_reason", "") == "no_sources":
        print("(no answer: nothing retrieved to answer from -- the store is empty or no document matches; "
              "the server answers only from sources)")
        answer = None
    if answer is not None:
        print(answer.strip() or "(empty answer)")
        print()
        print("Sources:")
        for s in r.sources:
            print(f"  [{s.number}] {s.title or s.doc_id}  ({s.chunk_id}{', truncated' if s.truncated else ''})")
    elif not r.hits:  # (it printed nothing, trial22)
        print("(no hits: the store is empty or no document matches)")
    else:
        for i, h in enumerate(r.hits, 1):
            snippet = " ".join(h.text.split())[:160]
            print(f"{i:>2}. {h.score:.4f}  {h.chunk_id}  [{h.title}]  {snippet}")
    return _partial(r)


def _partial(r) -> int:
    """1, said on stderr, when shards did not answer (``retrieval.partial``): the hits then leave
    out the documents those shards hold (README: never a silently incomplete result); else 0."""
    if not (r.retrieval.partial or r.retrieval.missing_shards):
        return 0
    return _fail(f"shard(s) {', '.join(map(str, r.retrieval.missing_shards)) or '?'} did not answer (down, being "
                 "restarted): these results leave out the documents they hold; ask again shortly")


def cmd_clear_session(a) -> int:
    try:
        with _client(a) as c:
            r = c.clear_session(a.session)
    except grpc.RpcError as exc:
        return _rpc_error(exc, a)
    removed = r.records_removed
    print(json.dumps({"records_removed": removed}) if a.json else f"removed {removed} memory records")
    return 0


def cmd_delete(a) -> int:
    try:
        with _client(a) as c:
            r = c.delete(a.doc_ids)
    except grpc.RpcError as exc:
        return _rpc_error(exc, a)
    out = {"documents_deleted": r.documents_deleted, "chunks_deleted": r.chunks_deleted, "seq": r.seq}
    print(json.dumps(out) if a.json else f"deleted {r.documents_deleted} documents ({r.chunks_deleted} chunks)")
    return 0


def cmd_stats(a) -> int:
    try:
        with _client(a) as c:
            r = c.stats()
    except grpc.RpcError as exc:
        return _rpc_error(exc, a)
    out = {
        "documents": r.documents,
        "chunks": r.chunks,
        "memory_records": r.memory_records,
        "seq": r.seq,
        "embedder": r.embedder,
        "generator": r.generator,
        # every ShardStats field under its proto name: counts, applied_seq, the memory estimates in
        # bytes (postings_bytes ... chunks_bytes), ann_pending, merge_pending, segment_unsaved_bytes, seeds_pending
        "shards": [{f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields} for s in r.shards],
        "missing_shards": list(r.missing_shards),
    }
    print(json.dumps(out, indent=None if a.json else 2))
    if r.missing_shards:  # the totals are then those of the answering shards only
        print(f"oprag: shard(s) {', '.join(map(str, r.missing_shards))} did not answer (down, being restarted): "
              "the totals count the other shards only", file=sys.stderr)
        return 1
    return 0


#: the server's largest RRF constant (oprag_server.service.convert.MAX_RRF_K; a fixed limit, not a flag)
MAX_RRF_K = 100_000


def _count_at_most(most: int):
    """An argparse type: :func:`_count` in [0, ``most``], the server's fixed limit of the option
    (``--rrf-k``: above it the server refused with INVALID_ARGUMENT, and above 2^32 the client said
    "rrf_k must be between 0 and 4294967295": two limits for one option, trial35)."""
    def parse(text: str) -> int:
        v = _count(text)
        if v > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {v}")
        return v
    return parse


_rrf_k, _knob = _count_at_most(MAX_RRF_K), _count_at_most(MAX_KNOB)


def _top_docs(text: str) -> int:
    """``eval --top-k``: documents retrieved per query, in [10, 100]; Recall is reported at that
    depth (``recall@<top-k>``). History: below 100 it was raised to 100 silently, then refused with
    "at least 100" (Recall@100 was always reported); above 100 every query then failed with the
    server's "top_k must be in [1, 100]" and was refused with "at most 100": 100 was the only value
    (trial22). nDCG@10 and MRR@10 need the top 10; the server returns at most 100."""
    v = _count(text)
    if not 10 <= v <= 100:
        raise argparse.ArgumentTypeError(f"must be in [10, 100] (nDCG@10 and MRR@10 rank the top 10 documents, "
                                         f"Recall is measured at --top-k, and the server returns at most 100), got {v}")
    return v


#: the health service names an OpRAG server sets: the whole server, its service, queries, writes (README: Operations)
HEALTH_NAMES = ("", "oprag.v1.OpRAG", "oprag.v1.OpRAG.Ingest", "oprag.v1.OpRAG.Query")


def cmd_health(a) -> int:
    """``oprag health [--service NAME] [--json]``: the status (``{"service", "status"}`` with --json); exit 0 when
    SERVING, else 1."""
    try:
        with _client(a) as c:
            status = c.health(a.service, timeout=a.timeout or 5.0)
    except grpc.RpcError as exc:
        msg = None
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # a name the server does not set (gRPC's details are empty)
            msg = (f"NOT_FOUND: the server has no health service {a.service!r} (an OpRAG server's names: "
                   f"{', '.join(map(repr, HEALTH_NAMES))})")
        return _rpc_error(exc, a, msg)
    print(json.dumps({"service": a.service, "status": status}) if a.json else status)
    return 0 if status == "SERVING" else 1


#: Entry point group of commands that other installed distributions add (``serve``).
PLUGIN_GROUP = "oprag.commands"
SERVER_MISSING = ("`oprag serve` comes with the server: install the full package (`make install`, or "
                  "`pip install .` at the repository root); this client-only install cannot serve")


def _plugins() -> dict:
    """Commands added by other installed distributions: name -> ``importlib.metadata.EntryPoint``."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def main(argv: list[str] | None = None) -> int:
    """The ``oprag`` command line (``argv``, default ``sys.argv[1:]``): the exit status. The console script runs it
    through :func:`oprag_client.cli_entry.main` (Ctrl-C while it starts, and after its result)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    plugins = _plugins()
    if argv and argv[0] in plugins and argv[0] not in COMMANDS:
        try:
            command = plugins[argv[0]].load()
        except ImportError as exc:  # registered, but its distribution is gone or broken
            if interrupted(exc):  # (or a Ctrl-C cut its import short)
                raise KeyboardInterrupt from exc
            return _fail(f"{SERVER_MISSING} ({exc})", 2)
        plain_sigint()  # (the command handles Ctrl-C itself: `oprag serve` shuts down gracefully)
        status = command(argv[1:])
        settle()
        return status
    if argv and argv[0] == "serve":
        return _fail(SERVER_MISSING, 2)
    ap = _parser(plugins)
    if (first := _options_first(argv, ap, plugins)) is not None:
        cmd, msg = first
        if "--json" in argv:  # (as the command's own parser prints a refusal)
            settle()
            print(json.dumps(refused_json(msg) if cmd == "ingest" else _SubcommandParser.json_error(msg)))
        ap.error(msg)  # (exit status 2)
    a = ap.parse_args(argv)
    try:
        with _stdout_closed_ok():  # `oprag stats | head -c 10`: the exit status is still the command's
            try:
                status = COMMANDS[a.cmd](a)
            except KeyboardInterrupt:  # Ctrl-C: no traceback (ingest says what its streams stored itself)
                return _interrupted(a, refused_json(INTERRUPTED, "CANCELLED") if a.cmd == "ingest" else None)
            settle()  # (a Ctrl-C as it ends changes nothing)
            return status
    except ValueError as exc:  # an argument the client refuses before sending (a traceback before)
        hint = (" (the command line holds bytes that are not UTF-8: use a UTF-8 locale or re-encode the argument)"
                if "surrogate" in str(exc) else "")
        if getattr(a, "json", False):
            _json_error("USAGE", f"{exc}{hint}")
        return _fail(f"{exc}{hint}", 2)


def _option(parser: argparse.ArgumentParser, token: str) -> argparse.Action | None:
    """The action of ``parser`` that the option ``token`` names (``--name``, ``--name=value``, or a prefix of one
    long option, as argparse takes it); None when it names none."""
    name = token.split("=", 1)[0] if token.startswith("--") else token
    actions = parser._option_string_actions  # (argparse's table of option strings)
    if name in actions:
        return actions[name]
    if name.startswith("--") and parser.allow_abbrev:
        hits = {id(a): a for o, a in actions.items() if o.startswith(name)}
        if len(hits) == 1:
            return next(iter(hits.values()))
    return None


def _plugin_parser(ep) -> argparse.ArgumentParser | None:
    """The parser of a plugin command (``serve``), when its module has a ``build_parser()`` beside the command's
    ``main`` (the server's does); None when it cannot be had."""
    try:
        command = ep.load()
        build = getattr(sys.modules.get(getattr(command, "__module__", ""), None), "build_parser", None)
        return build() if callable(build) else None
    except Exception:  # noqa: BLE001  (a broken plugin: its options are not checked here)
        return None


def _options_first(argv: list[str], ap: argparse.ArgumentParser, plugins: dict) -> tuple[str | None, str] | None:
    """``(command, message)`` when ``argv`` starts with options (every option belongs to a command, trial51:
    ``oprag --server H:P query x`` said "argument cmd: invalid choice: 'H:P'"); else None. The message gives the
    command line with those options moved after the command (after ``eval``'s suite) only when that command accepts
    each of them (trial51b: ``oprag --server 1:2 serve`` suggested ``oprag serve --server 1:2``, which serve has
    not, and ``oprag -v query x`` suggested ``oprag query -v x``); else it names the options the command has not
    (unknown to every command, or to this one), or says the command is missing."""
    if not argv or not argv[0].startswith("-") or argv[0] in ("-h", "--help"):
        return None
    known = list(ap.commands.values())  # (the client's commands; a plugin's options are checked by its own parser)
    names = [*COMMANDS, *sorted(set(plugins) - set(COMMANDS))]
    commands = {*names, "serve"}
    opts, at = [], 0  # the options before the command (each with its value), and where the command is
    while at < len(argv) and argv[at].startswith("-") and argv[at] != "--":
        tok, nxt = argv[at], argv[at + 1] if at + 1 < len(argv) else None
        actions = [x for p in known if (x := _option(p, tok)) is not None]
        takes = (any(x.nargs != 0 for x in actions) if actions  # (store_true and help take none)
                 else nxt is not None and not nxt.startswith("-") and nxt not in commands)  # (unknown: what follows)
        n = 2 if takes and "=" not in tok and nxt is not None else 1
        opts.append((tok.split("=", 1)[0] if tok.startswith("--") else tok, bool(actions)))
        at += n
    if at >= len(argv) or argv[at] == "--":
        return None, (f"a command is missing (options go after it): oprag COMMAND {shlex.join(argv)}, COMMAND one "
                      f"of: {', '.join(names)}")
    cmd = argv[at]
    if cmd not in names:
        if cmd == "serve":
            return cmd, SERVER_MISSING
        return cmd, f"argument cmd: invalid choice: {cmd!r} (choose from {', '.join(map(repr, names))})"
    head, full = at + 1, cmd
    if cmd == "eval" and at + 1 < len(argv) and f"eval {argv[at + 1]}" in ap.commands:
        head, full = at + 2, f"eval {argv[at + 1]}"
    parser = _plugin_parser(plugins[cmd]) if cmd not in COMMANDS else ap.commands.get(full) if full != "eval" else None
    if parser is None:  # (a plugin whose options cannot be checked here, or eval without its suite)
        return cmd, f"options go after the command: see oprag {full} --help"
    unknown = [name for name, k in opts if not k and _option(parser, name) is None]  # (no command's)
    foreign = [name for name, k in opts if k and _option(parser, name) is None]  # (other commands')
    if not unknown and not foreign:
        return cmd, f"options go after the command: {shlex.join(['oprag', *argv[at:head], *argv[:at], *argv[head:]])}"
    said = [f"{what}{'s' if len(which) > 1 else ''} {', '.join(which)}{where}" for what, which, where in (
        ("unknown option", unknown, f" before the command {full}"), (f"oprag {full} has no option", foreign, ""))
        if which]
    return cmd, f"{'; '.join(said)}: see oprag {full} --help"


COMMANDS = {
    "ingest": cmd_ingest,
    "query": cmd_query,
    "delete": cmd_delete,
    "clear-session": cmd_clear_session,
    "stats": cmd_stats,
    "eval": cmd_eval,
    "health": cmd_health,
}


if __name__ == "__main__":  # python -m oprag_client.cli: as the console script, through its entry point
    from oprag_client.cli_entry import main as _entry

    sys.exit(_entry())
