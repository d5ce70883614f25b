"""Generation on an inference engine that speaks the OpenAI HTTP API (vLLM, SGLang, TGI,
llama.cpp's server, ``transformers serve``): :class:`OpenAIGenerator`.

It implements :class:`~oprag_server.models.protocols.EngineGenerator`: the text helpers the
context operator needs (chat template, token counting, truncation) and :meth:`stream`, one
chat completion streamed over HTTP with ``aiohttp`` (extra ``engine``), the server-sent events
parsed line by line (``data: {json}``, ending with ``data: [DONE]``). The official ``openai``
client cost about 0.3 ms of CPU per streamed chunk in the server's event loop (request
transformation and a pydantic object per chunk; bench/RESULTS.md, Serving), which with
many short answers in flight was the frontend's largest cost. The engine batches by itself (continuous batching), so requests are sent
one by one as soon as their prompt exists (:mod:`oprag_server.engine.dispatch`).

Token counting: with a local tokenizer (``tokenizer_dir``, e.g. the directory the engine
serves), exact, with the tokenizer's chat template. Without one, an estimate:
``ceil(utf8_bytes / 3) + 8`` per text. English BPE tokenizers (GPT-2, Llama, SmolLM2) average
about 4 bytes per token on prose, so 3 bytes per token over-counts by about a third -- the
safety margin that keeps the prompt under the engine's window; 8 tokens cover a chat turn's
role markers.

Errors: :class:`~oprag_server.models.protocols.EngineUnavailable` (engine unreachable, 5xx,
429, or the connection broke mid-stream; ``retry_after_s`` from the engine's ``Retry-After``
when given), :class:`~oprag_server.models.protocols.EngineTimeout` (``timeout_s`` passed),
:class:`~oprag_server.models.protocols.EngineRejected` (HTTP 400/413/422; other 4xx such as
401/404 mean a misconfigured engine: ``EngineUnavailable``). A request is retried only before
its first token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .protocols import EngineRejected, EngineTimeout, EngineUnavailable, EngineUsage

log = logging.getLogger(__name__)

#: Bytes per token of the estimate without a local tokenizer (see the module docstring).
EST_BYTES_PER_TOKEN = 3
#: Tokens added per text by the estimate (chat role markers).
EST_OVERHEAD_TOKENS = 8
#: Texts whose exact token counts are kept (source blocks recur across requests).
COUNT_CACHE_SIZE = 8192
#: Context length assumed for a remote model without a local config.
DEFAULT_REMOTE_CONTEXT = 8192


class OpenAIGenerator:
    """Chat completions on an OpenAI-compatible engine.

    :param url: base URL including ``/v1``, e.g. ``http://127.0.0.1:8000/v1``.
    :param model: the engine's model name (for ``transformers serve``: the served directory).
    :param api_key: bearer token sent to the engine (``"none"`` when it needs none).
    :param tokenizer_dir: local directory with the engine's tokenizer (exact counting), or None
        (estimate; see the module docstring).
    :param tls_verify: ``True``, ``False`` or a CA bundle path (for ``https://`` URLs).
    :param timeout_s: per-request limit in seconds (connect to last token).
    :param max_inflight: requests the engine is given at once (the dispatcher enforces it).
    :param retries: extra attempts before the first token on a connection error, 429 or 5xx.
    """

    is_engine = True

    def __init__(self, url: str, model: str, *, api_key: str = "none", tokenizer_dir: Path | None = None,
                 tls_verify: bool | str = True, timeout_s: float = 120.0, max_inflight: int = 16,
                 retries: int = 2) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--generator-url must be an http(s) URL ending in /v1, got {url!r}")
        if not model:
            raise ValueError("--generator-model is required with --generator openai")
        if max_inflight < 1 or timeout_s <= 0:
            raise ValueError("--generator-max-inflight must be >= 1 and --generator-timeout-s > 0")
        self.url, self.model, self.name = url.rstrip("/"), model, f"openai:{model}"
        self.api_key, self.tokenizer_dir = api_key or "none", tokenizer_dir
        self.tls_verify, self.timeout_s = tls_verify, float(timeout_s)
        self.max_inflight, self.retries = int(max_inflight), int(retries)
        self.max_context = DEFAULT_REMOTE_CONTEXT
        self.tokenizer: Any = None
        self.down_since: float | None = None  # perf_counter of the first failure in a row
        self._clients: dict[Any, Any] = {}  # event loop -> its aiohttp.ClientSession
        self._lock = threading.Lock()
        self._warm = False
        self._counts: dict[str, int] = {}  # text -> exact token count (insertion order: oldest first)

    # ------------------------------------------------------------------ set-up
    def warm_up(self) -> None:
        """Load the local tokenizer and context length (if ``tokenizer_dir``). Idempotent."""
        if self._warm:
            return
        with self._lock:
            if self._warm:
                return
            if self.tokenizer_dir is not None:
                from transformers import AutoConfig, AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
                cfg = AutoConfig.from_pretrained(str(self.tokenizer_dir))
                self.max_context = int(getattr(cfg, "max_position_embeddings", DEFAULT_REMOTE_CONTEXT))
            self._warm = True

    def client(self) -> Any:
        """The running event loop's ``aiohttp.ClientSession`` (created on first use; one per loop:
        the streams run on the dispatcher's engine thread, probes on the frontend's loop; no limit
        on connections: the dispatcher bounds the requests in flight)."""
        loop = asyncio.get_running_loop()
        session = self._clients.get(loop)
        if session is None or session.closed:
            import aiohttp

            ssl: Any = None if self.tls_verify is True else self.tls_verify
            if isinstance(self.tls_verify, str):
                import ssl as _ssl

                ssl = _ssl.create_default_context(cafile=self.tls_verify)
            session = self._clients[loop] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=ssl if ssl is not None else True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                headers={"Authorization": f"Bearer {self.api_key}", "Accept": "text/event-stream"})
        return session

    async def aclose_client(self) -> None:
        """Close the running event loop's HTTP connections."""
        session = self._clients.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    async def aclose(self) -> None:
        """Close the HTTP connections (of the running loop; other loops close theirs with
        :meth:`aclose_client`)."""
        await self.aclose_client()

    # ------------------------------------------------------------------ text helpers
    @staticmethod
    def chat_messages(system: str, user: str) -> list[dict[str, str]]:
        """The chat turns sent to the engine: ``[{"role": "system", ...}, {"role": "user", ...}]``."""
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def chat_prompt(self, system: str, user: str) -> str:
        """The prompt as the engine will see it: the local tokenizer's chat template when there
        is one, else ``"<system>\\n\\n<user>"`` (only counted, never sent)."""
        self.warm_up()
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(self.chat_messages(system, user), tokenize=False,
                                                      add_generation_prompt=True)
        return f"{system}\n\n{user}" if system else user

    def _encode(self, text: str) -> Any:
        """The fast tokenizer's encoding of ``text`` without special tokens (``ids``, ``offsets``);
        the ``tokenizers`` backend directly: the ``transformers`` call around it cost ~0.5 ms a call."""
        fast = getattr(self.tokenizer, "backend_tokenizer", None)
        if fast is not None:
            return fast.encode(text, add_special_tokens=False)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return SimpleNamespace(ids=enc["input_ids"], offsets=enc["offset_mapping"])

    def count_tokens(self, text: str) -> int:
        """Exact with a local tokenizer (the counts of recent texts cached: a source chunk recurs
        across requests), else ``ceil(utf8_bytes / 3) + 8`` (an over-estimate)."""
        self.warm_up()
        if self.tokenizer is None:
            return math.ceil(len(text.encode("utf-8")) / EST_BYTES_PER_TOKEN) + EST_OVERHEAD_TOKENS
        n = self._counts.get(text)
        if n is None:
            n = len(self._encode(text).ids)
            if len(self._counts) >= COUNT_CACHE_SIZE:
                self._counts.pop(next(iter(self._counts)))  # the oldest entry
            self._counts[text] = n
        return n

    def truncate_to_tokens(self, text: str, n: int) -> str:
        """Longest prefix of ``text`` with at most ``n`` tokens as :meth:`count_tokens` counts."""
        if n <= 0:
            return ""
        out = text
        if self.count_tokens(out) <= n:
            return out
        if self.tokenizer is None:
            out = text.encode("utf-8")[: max(0, (n - EST_OVERHEAD_TOKENS) * EST_BYTES_PER_TOKEN)].decode("utf-8", "ignore")
        else:
            out = text[: self._encode(text).offsets[n][0]]
        while out and self.count_tokens(out) > n:
            out = out[:-1]
        return out

    # ------------------------------------------------------------------ generation
    @property
    def healthy(self) -> bool:
        """False from a failed request (or probe) until the next one succeeds."""
        return self.down_since is None

    def _mark(self, ok: bool) -> None:
        if ok:
            self.down_since = None
        elif self.down_since is None:
            self.down_since = time.perf_counter()

    async def probe(self) -> bool:
        """One ``GET /models`` (5 s limit); updates :attr:`healthy`. :returns: whether it answered."""
        try:
            async with asyncio.timeout(5.0):
                async with self.client().get(f"{self.url}/models") as resp:
                    await resp.read()
                    ok = resp.status == 200
        except Exception:  # noqa: BLE001 - any failure means not serving
            ok = False
        self._mark(ok)
        return ok

    def _map_error(self, exc: BaseException) -> Exception:
        if isinstance(exc, (EngineUnavailable, EngineTimeout, EngineRejected)):
            return exc
        if isinstance(exc, TimeoutError):  # asyncio.timeout, or aiohttp's connect timeout
            return EngineTimeout(f"the generation engine did not finish within {self.timeout_s:.0f} s")
        return EngineUnavailable(f"the generation engine is unreachable: {type(exc).__name__}: {exc}", 1.0)

    @staticmethod
    def _status_error(code: int, body: bytes, retry_after: str) -> Exception:
        """The error for an HTTP status other than 200 (see the module docstring)."""
        msg = body[:300].decode("utf-8", "replace")
        if code in (400, 413, 422):
            return EngineRejected(f"the generation engine refused the request: HTTP {code}: {msg}")
        wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else (
            1.0 if code == 429 or code >= 500 else 5.0)
        return EngineUnavailable(f"the generation engine answered HTTP {code} "
                                 f"({'overloaded or down' if code == 429 or code >= 500 else 'misconfigured'})", wait)

    async def stream(self, messages: list[dict[str, str]], max_new_tokens: int,
                     usage: EngineUsage, stop: tuple[str, ...] = ()) -> AsyncIterator[str]:
        """Greedy (temperature 0) chat completion; yields text deltas as the engine sends them.

        ``usage`` is filled in as the engine reports it (``prompt_tokens``,
        ``completion_tokens``, ``cached_tokens`` from ``usage.prompt_tokens_details``,
        ``finish_reason``, ``attempts``). Closing the iterator (``aclose``, or cancelling the
        task that iterates) closes the HTTP stream, so the engine frees the request's slot.

        :raises EngineUnavailable | EngineTimeout | EngineRejected: see the module docstring.
        """
        got_token = False
        body = {"model": self.model, "messages": messages, "max_tokens": int(max_new_tokens), "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if stop:  # (OpenAI's chat field; the caller also cuts the stream at them)
            body["stop"] = list(stop)
        for attempt in range(self.retries + 1):
            usage.attempts = attempt + 1
            try:
                async with asyncio.timeout(self.timeout_s):
                    resp = await self.client().post(f"{self.url}/chat/completions", json=body)
                    done = False
                    try:
                        if resp.status != 200:
                            raise self._status_error(resp.status, await resp.read(), resp.headers.get("retry-after", ""))
                        self._mark(True)
                        async for line in resp.content:  # one server-sent-event line at a time
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":  # the body ends next: read to its end, so the connection is reused
                                done = True
                                continue
                            chunk = json.loads(data)
                            if "error" in chunk:  # an error event mid-stream (vLLM, SGLang)
                                raise EngineUnavailable(f"the generation engine failed the request: {chunk['error']}", 1.0)
                            if chunk.get("usage"):
                                _take_usage(chunk["usage"], usage)
                            for ch in chunk.get("choices") or ():
                                if ch.get("finish_reason"):
                                    usage.finish_reason = "length" if ch["finish_reason"] == "length" else "stop"
                                delta = (ch.get("delta") or {}).get("content")
                                if delta:
                                    got_token = True
                                    yield delta
                    finally:
                        if done and resp.content.at_eof():
                            resp.release()  # the stream ended: the connection goes back to the pool
                        else:
                            resp.close()  # also on cancellation: the engine sees the stream close and frees the slot
                return
            except (GeneratorExit, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped below
                err = self._map_error(exc)
                if isinstance(err, EngineUnavailable):
                    self._mark(False)
                if got_token or not isinstance(err, EngineUnavailable) or attempt == self.retries:
                    raise err from (None if err is exc else exc)
                log.warning("engine request failed before its first token (%s); retrying", err)
                await asyncio.sleep(0.2 * (attempt + 1))


def _take_usage(u: dict, usage: EngineUsage) -> None:
    usage.prompt_tokens = int(u.get("prompt_tokens") or 0)
    usage.completion_tokens = int(u.get("completion_tokens") or 0)
    details = u.get("prompt_tokens_details")
    if details and details.get("cached_tokens") is not None:
        usage.cached_tokens = int(details["cached_tokens"])
