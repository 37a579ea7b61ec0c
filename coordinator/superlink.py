"""Flower's SuperLink, with its Control and Runtime APIs answering only this host.

Why: Flower 1.42 serves the Fleet, Control and Runtime APIs on one port (``--host``/``--port``), and
without Flower Enterprise's OIDC plugin the Control API authenticates no one. Anyone who could reach
the coordinator's port could register a node key of their own (node authentication then admits
them), unregister the enrolled nodes, and submit a run: a ServerApp of their choosing, executed on
the coordinator's host. TLS does not help: every agent holds the CA certificate, and the server's
certificate proves only the server. SuperNodes need the Fleet API alone.

:func:`command` (``python -m coordinator.superlink ARGS`` works too) runs ``flower-superlink ARGS`` with one ASGI middleware in
front of Flower's (through ``flwr.superlink.extensions.get_middleware``, the hook Flower's own
extensions use): a request from a peer that is not this host (:func:`from_this_host`) gets 403
unless it is for a Fleet API route or ``/health``; so does one from this host that says it was forwarded
(X-Forwarded-For, Forwarded: a local reverse proxy's). uvicorn's own reading of those headers is off, and
Flower's switches for its older gRPC APIs (a second, unguarded listener) are dropped. The coordinator's own
``flwr`` commands (key registration, ``flwr run``) and the ServerApp's process connect from this host and
are not affected. What the guard cannot tell apart: a tunnel or TCP proxy on this host (ssh -L, socat, a
service-mesh sidecar) in front of the port makes every peer this host; put none there.

A remote peer's body past :func:`max_body` gets 413 (also a chunked one, whatever Flower's own middleware makes of
the cut-off read), the memory of refused bodies is given back (:class:`_Reclaimer`), and each failed TLS handshake
is one rate-limited WARNING line with the peer's address and the cause (:func:`watch_tls_handshakes`).

One process serves every node, so its CPU per request bounds a large federation: Flower's middleware is slimmed
(:func:`slimmed`: 5.1 -> 1.75 ms a Fleet request with :func:`tls_loop` and P-256 node keys; docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import ipaddress
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

# Stricter only, for tests on 127.0.0.1 (where every peer is this host): loopback peers count as remote.
_LOOPBACK_IS_REMOTE = os.environ.get("FEDSHIELD_SUPERLINK_LOOPBACK_IS_REMOTE") == "1"

REFUSED = b"fedshield: this SuperLink answers its Control and Runtime APIs only to its own host.\n"
TOO_LARGE = b"fedshield: request body too large for this SuperLink.\n"
MAX_BODY_ENV = "FEDSHIELD_SUPERLINK_MAX_BODY"  # bytes a remote peer's request may carry (set by coordinator start)
DEFAULT_MAX_BODY = (512 + 16) << 20  # max-update-mb's default, and room for the message around an update


def max_body() -> int:
    try:
        return max(1 << 20, int(os.environ.get(MAX_BODY_ENV, DEFAULT_MAX_BODY)))
    except ValueError:
        return DEFAULT_MAX_BODY


class _TooLarge(Exception):
    pass


RECLAIM_AT = 64 << 20  # bytes of refused bodies after which their memory is given back at once
RECLAIM_IDLE_S = 1.0  # fewer: given back this long after the last one
RECLAIM_SHARE = 0.1  # of the event loop's time, at most, spent giving it back


class _Reclaimer:
    """Gives the memory of refused request bodies back to the system.

    What held it (measured: 100 invalid 16 MB bodies to a Fleet route left the SuperLink at 1.27 GB from 134 MB,
    for good): Flower's error path keeps each refused body in a reference cycle (the protobuf parser's
    ``DecodeError`` -> its traceback -> the frame holding ``body``, and the request object caching it), which only
    Python's full collection frees, and that runs rarely in a process of ~185k long-lived objects; freed, the
    bodies' memory still stayed with glibc's heap (its mmap threshold had grown past 16 MB) until ``malloc_trim``.
    So once refused bodies add up: a full ``gc.collect()`` and ``malloc_trim(0)`` (about 0.1 s, in the event loop,
    never more than :data:`RECLAIM_SHARE` of its time)."""

    def __init__(self) -> None:
        self.pending, self.not_before = 0, 0.0
        self.handle: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # (one in the SuperLink; a test's loops come and go)
        self.runs = 0  # (for tests)

    def refused(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending < (1 << 20):  # small change: Python's own collections see to it
            return
        loop = asyncio.get_running_loop()
        when = max(loop.time() + (0.0 if self.pending >= RECLAIM_AT else RECLAIM_IDLE_S), self.not_before)
        if self.handle is not None and self.loop is loop:
            if self.handle.when() <= when:
                return
            self.handle.cancel()
        self.handle, self.loop = loop.call_at(when, self.reclaim, loop), loop

    def reclaim(self, loop: asyncio.AbstractEventLoop) -> None:
        self.handle, self.pending = None, 0
        start = time.perf_counter()
        gc.collect()
        _malloc_trim()
        self.runs += 1
        self.not_before = loop.time() + (time.perf_counter() - start) * (1 / RECLAIM_SHARE - 1)


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: free heap pages back to the system (a no-op elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc (musl, macOS)
        pass


_RECLAIMER = _Reclaimer()


@lru_cache(maxsize=1)
def public_paths() -> frozenset[str]:
    """The routes a remote peer may call: Flower's Fleet API (what a SuperNode uses) and ``/health``."""
    from flwr.superlink.routers.fleet.router import router

    return frozenset({route.path for route in router.routes} | {"/health"})


def _ip(host: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(str(host))
    except ValueError:  # a Unix socket's peer, a test client's name: not an IP address
        return None
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None else ip


def from_this_host(scope: Scope) -> bool:
    """Whether a connection comes from this machine: its peer is a loopback address, or the very address
    it reached the server at (Linux gives a connection to one of the host's own addresses that address
    as its source; a peer elsewhere cannot have it, TCP's handshake rules out a forged source).

    Not a test of "can this address be bound here": with ``net.ipv4.ip_nonlocal_bind`` any address can."""
    client, server = scope.get("client"), scope.get("server")
    peer = _ip(client[0]) if client else None
    if peer is None:
        return False
    if peer.is_loopback:
        return not _LOOPBACK_IS_REMOTE
    return server is not None and not peer.is_unspecified and peer == _ip(server[0])


_FORWARDING_HEADERS = frozenset({b"x-forwarded-for", b"forwarded", b"x-real-ip"})


def _forwarded(scope: Scope) -> bool:
    """Whether a request says it was forwarded: then its peer on this host (a reverse proxy, a tunnel)
    is not who sent it. The flwr CLI and the ServerApp never send these headers."""
    return any(name.lower() in _FORWARDING_HEADERS for name, _ in scope.get("headers") or ())


async def _plain(send: Callable[[Any], Awaitable[None]], status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,  # close: the rest of the body is not read
                "headers": headers + [(b"connection", b"close")] * close})
    await send({"type": "http.response.body", "body": body})


class LocalControlOnly:
    """ASGI middleware: from a peer that is not this host, only :func:`public_paths` (exact match), and a body
    of at most :func:`max_body` bytes (Flower reads a Fleet request's whole body into memory before node
    authentication: unbounded, a peer with no credentials could run the coordinator out of memory)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app, self.cap = app, max_body()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] not in ("http", "websocket") or (from_this_host(scope) and not _forwarded(scope)):
            await self.app(scope, receive, send)
            return
        if scope.get("path") not in public_paths():
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await _plain(send, 403, REFUSED)
            return
        if scope["type"] == "http":
            await self._capped(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _capped(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]]) -> None:
        length = next((v for k, v in scope.get("headers") or () if k.lower() == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.cap):
            await _plain(send, 413, TOO_LARGE)  # told before a byte of it is read
            return
        seen, status, over = 0, 0, False

        async def counted() -> Any:  # a chunked body, or one longer than it said
            nonlocal seen, over
            if over:  # read no more of it, whatever the app does with the first refusal
                raise _TooLarge
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.cap:
                    over = True
                    raise _TooLarge
            return message

        async def tracked(message: Any) -> None:
            nonlocal status
            if over:  # the app's own answer to the cut-off body (Flower's: a 500) is replaced: the peer gets 413
                if not status and message["type"] == "http.response.start":
                    status = 413
                    await _plain(send, 413, TOO_LARGE, close=True)
                return
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except Exception:
            if not over:
                _RECLAIMER.refused(seen)
                raise
        if over and not status:
            status = 413
            await _plain(send, 413, TOO_LARGE, close=True)
        if over or status >= 400:
            _RECLAIMER.refused(seen)


# Flower 1.42's SuperLink stacks eight BaseHTTPMiddlewares; each costs a request its task group, memory streams and
# a wrapped response even when it only passes the request on, and most act on one API only. For the requests they
# pass on unread they are stepped around (:class:`_OnlyFor`), and the error translator, node authentication and
# protobuf translation run as plain ASGI: a Fleet or Runtime request goes through none of them.
# (module, class, the paths it acts on, the app.state plugin without which it acts on none): for any other request
# Flower's code returns ``call_next(request)`` at once.
_CONTROL, _FLEET, _RUNTIME = "/v1/control/", "/v1/fleet/", "/v1/runtime/"
_PATH_BOUND_MIDDLEWARE = (
    ("flwr.superlink.routers.control.middlewares", "ControlSensitiveResponseMiddleware", _CONTROL, None),
    ("flwr.superlink.routers.control.middlewares", "ControlAuthenticationMiddleware", _CONTROL, None),
    ("flwr.superlink.routers.control.middlewares", "ControlLicenseMiddleware", _CONTROL, None),
    ("flwr.superlink.routers.control.middlewares", "ControlEventLogMiddleware", _CONTROL, "control_event_log_plugin"),
    ("flwr.superlink.routers.fleet.middlewares", "FleetEventLogMiddleware", _FLEET, "fleet_event_log_plugin"),
)


class _OnlyFor:
    """ASGI: Flower's ``middleware`` for the paths under ``prefix`` (and, with ``plugin``, only while the app's state
    holds that plugin); any other request goes straight to the app it wraps, as ``middleware`` would have sent it
    there unread."""

    def __init__(self, app: ASGIApp, middleware: type, prefix: str, plugin: str | None = None, args: tuple = (),
                 kwargs: dict | None = None) -> None:
        self.app, self.prefix, self.plugin = app, prefix, plugin
        self.middleware = middleware(app, *args, **(kwargs or {}))

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http" and (not scope.get("path", "").startswith(self.prefix) or (
                self.plugin and getattr(getattr(scope.get("app"), "state", None), self.plugin, None) is None)):
            await self.app(scope, receive, send)
        else:
            await self.middleware(scope, receive, send)


class _Translated:
    """ASGI: Flower's error translator (``dispatch``: a FlowerError, HTTPException or any other exception raised
    before the response started becomes its JSON answer) without a BaseHTTPMiddleware around it."""

    def __init__(self, app: ASGIApp, dispatch: Callable[..., Awaitable[Any]]) -> None:
        self.app, self.dispatch = app, dispatch

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            from starlette.requests import Request

            error = exc  # (``exc`` is unbound once the except block ends; the translator calls this within it)

            async def raised(_request: Any) -> Any:
                raise error

            response = await self.dispatch(Request(scope, receive), raised)
            await response(scope, receive, send)


class _NodeAuthenticated:
    """ASGI: Flower's NodeAuthMiddleware without a BaseHTTPMiddleware around it: a Fleet request that the protobuf
    layer parsed is authenticated (``authenticate_node``, in the thread pool as Flower runs it) before the app sees
    it; its HTTPException (401) goes up to the error translator, as from Flower's."""

    def __init__(self, app: ASGIApp) -> None:
        from flwr.superlink.routers.fleet.node_auth import authenticate_node
        from google.protobuf.message import Message
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import Request

        self.app, self.authenticate, self.message = app, authenticate_node, Message
        self.in_threads, self.request = run_in_threadpool, Request

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(_FLEET):
            request = self.request(scope, receive)
            body = getattr(request.state, "protobuf_request", None)
            if isinstance(body, self.message):
                await self.in_threads(self.authenticate, request)
                if (why := foreign_sender(body)) is not None:
                    from fastapi import HTTPException

                    raise HTTPException(status_code=403, detail=why)
        await self.app(scope, receive, send)


def foreign_sender(request: Any) -> str | None:
    """Why an authenticated Fleet request pushes a message as another node, or None. Flower 1.42 authenticates
    ``request.node`` but stores each pushed message under the ``src_node_id`` its metadata claims: an enrolled node
    could answer another node's message as that node (a second update a round, or the other's replaced)."""
    messages, node = getattr(request, "messages_list", None), getattr(request, "node", None)
    if messages is None or node is None:
        return None
    if any(m.metadata.src_node_id != node.node_id for m in messages):
        return "a node may push only messages from itself"
    return None


class _ProtobufTranslated:
    """ASGI: Flower's ProtobufTranslationMiddleware, its ``dispatch`` step for step, without a BaseHTTPMiddleware
    around it, for the Fleet and Runtime APIs (the Control API keeps Flower's own): the body parsed into
    ``request.state.protobuf_request`` (and replayed to the app), the app's placeholder answer replaced by the
    handler's serialized result, a JSON error passed on as it is."""

    def __init__(self, app: ASGIApp) -> None:
        from flwr.supercore.protobuf import translation
        from flwr.supercore.protobuf.streaming import get_protobuf_stream_context
        from starlette.requests import Request

        self.app, self.flower = app, translation.ProtobufTranslationMiddleware(app)
        self.types, self.Error, self.codes = translation.PROTOBUF_REQUEST_TYPES, translation.FlowerError, \
            translation.ApiErrorCode
        self.request, self.stream_context = Request, get_protobuf_stream_context

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith((_FLEET, _RUNTIME)):
            await self.flower(scope, receive, send)
            return
        request_type = self.types.get((scope["method"], scope["path"]))
        if request_type is None:
            await self.app(scope, receive, send)
            return
        mw, request = self.flower, self.request(scope, receive)
        mw._check_request_media_type(request)
        body = await request.body()
        request.state.protobuf_request = mw._parse_request(body, request_type)
        replayed = False

        async def replay() -> Any:  # the body once more, for anything after this that reads it
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: dict | None = None
        chunks: list[bytes] = []

        async def held(message: Any) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, replay, held)
        if start is None:
            raise RuntimeError("No response returned.")  # (BaseHTTPMiddleware's words for an app that sent none)
        headers = list(start.get("headers", []))
        if start["status"] >= 400:
            content_type = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), "")
            media_type = content_type.partition(";")[0].strip().lower()
            if media_type == "application/json" or media_type.endswith("+json"):
                await send(start)
                await send({"type": "http.response.body", "body": b"".join(chunks)})
                return
            raise self.Error(self.codes.INVALID_PROTOBUF_RESPONSE, "Protobuf route returned a non-JSON HTTP error "
                                                                   f"response with Content-Type {content_type!r}.")
        if not hasattr(request.state, "protobuf_response"):
            raise self.Error(self.codes.INVALID_PROTOBUF_RESPONSE,
                             "Protobuf response missing from request state after handler completed.")
        response = mw._response_for(request.state.protobuf_response, self.stream_context(request))
        del request.state.protobuf_response
        response.status_code = start["status"]
        response.headers.raw.extend(h for h in headers if h[0] not in (b"content-length", b"content-type"))
        await response(scope, receive, send)


def slimmed(stack: list) -> list:
    """Flower's middleware ``stack`` with each of :data:`_PATH_BOUND_MIDDLEWARE` acting only on its own paths, and
    its error translator, node authentication and (for Fleet and Runtime) protobuf translation as plain ASGI
    (:class:`_Translated`, :class:`_NodeAuthenticated`, :class:`_ProtobufTranslated`)."""
    from flwr.supercore.error.http import http_error_translator
    from flwr.supercore.protobuf.translation import ProtobufTranslationMiddleware
    from flwr.superlink.routers.fleet.node_auth import NodeAuthMiddleware
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    bound = {getattr(importlib.import_module(module), name): (prefix, plugin)
             for module, name, prefix, plugin in _PATH_BOUND_MIDDLEWARE}
    out = []
    for m in stack:
        if m.cls is NodeAuthMiddleware and not m.args and not m.kwargs:
            m = Middleware(_NodeAuthenticated)
        elif m.cls is ProtobufTranslationMiddleware and not m.args and not m.kwargs:
            m = Middleware(_ProtobufTranslated)
        elif m.cls in bound:
            prefix, plugin = bound[m.cls]
            m = Middleware(_OnlyFor, middleware=m.cls, prefix=prefix, plugin=plugin, args=tuple(m.args),
                           kwargs=dict(m.kwargs))
        elif m.cls is BaseHTTPMiddleware and not m.args and m.kwargs == {"dispatch": http_error_translator}:
            m = Middleware(_Translated, dispatch=http_error_translator)
        out.append(m)
    return out


def install() -> None:
    """Put :class:`LocalControlOnly` in front of the SuperLink's middleware (before its app is made), and step
    around the middleware that has nothing to do with a request (:func:`slimmed`)."""
    from flwr.superlink import extensions, main
    from starlette.middleware import Middleware

    if getattr(extensions.get_middleware, "fedshield_guard", False):
        return
    flower_own, flower_stack = extensions.get_middleware, main._get_middleware

    def get_middleware() -> tuple[Middleware, ...]:
        return (Middleware(LocalControlOnly), *flower_own())

    def get_stack() -> list[Middleware]:
        return slimmed(flower_stack())

    get_middleware.fedshield_guard = True  # type: ignore[attr-defined]
    get_stack.flower = flower_stack  # type: ignore[attr-defined]  (Flower's own, for the tests' comparison)
    extensions.get_middleware = get_middleware
    main._get_middleware = get_stack


# Failed TLS handshakes never reach ASGI (nor uvicorn): asyncio's TLS layer drops them and logs only in its debug
# mode, uvloop's not at all. So the SuperLink serves TLS on asyncio's loop, whose TLS layer (pure Python) is hooked.
_HANDSHAKE_REASONS = {
    "TLSV1_ALERT_UNKNOWN_CA": "the client does not trust this coordinator's CA (unknown CA: is its --root-cert "
                              "this coordinator's ca.crt?)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the client rejected this coordinator's certificate (bad certificate: is the "
                                   "address it connects to one of the certificate's names? `fedshield certs init "
                                   "--san`)",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the client rejected this coordinator's certificate (certificate unknown)",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the client says this coordinator's certificate has expired (or its clock is "
                                       "off)",
    "HTTP_REQUEST": "plaintext HTTP on the TLS port (the client runs --insecure?)",
    "WRONG_VERSION_NUMBER": "the client does not speak TLS (plaintext on the TLS port? --insecure?)",
    "NO_SHARED_CIPHER": "no cipher in common with the client",
    "UNSUPPORTED_PROTOCOL": "no TLS version in common with the client",
    "VERSION_TOO_LOW": "no TLS version in common with the client",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common with the client",
}


def handshake_reason(exc: BaseException | type[BaseException]) -> str:
    """A failed handshake's cause in words: OpenSSL's reason (a constant's name: no key material, no peer data)."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return _HANDSHAKE_REASONS.get(reason, f"TLS error {reason}")
    if exc is TimeoutError or isinstance(exc, TimeoutError):
        return "the handshake did not complete in time"
    kind = exc if isinstance(exc, type) else type(exc)
    if issubclass(kind, ConnectionError):
        return "the client closed the connection during the handshake (does it trust this coordinator's CA?)"
    return kind.__name__


def _address(peer: Any) -> str:
    if not isinstance(peer, (tuple, list)) or len(peer) < 2:
        return "an unknown peer"
    return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"


class HandshakeLog:
    """One WARNING line per failed TLS handshake, naming the peer and the cause; at most one line per peer
    address (host) every ``every`` seconds (the next one says how many were not shown), and ``most`` lines
    every ``every`` seconds over all peers (a line then says how many more there were)."""

    def __init__(self, emit: Callable[[str], None] | None = None, every: float = 60.0, most: int = 30,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit or logging.getLogger("uvicorn.error").warning  # (Flower's configuration: the SuperLink's log)
        self.every, self.most, self.clock = every, most, clock
        self.hosts: dict[str, list[float]] = {}  # host -> [when a line last named it, failures not shown since]
        self.window, self.lines, self.dropped = -float("inf"), 0, 0

    def failed(self, peer: Any, reason: str) -> None:
        now = self.clock()
        if now - self.window >= self.every:
            if self.dropped:
                self.emit(f"fedshield: {self.dropped} more failed TLS handshake{'s' * (self.dropped != 1)} in the "
                          f"last {self.every:g} s not shown (more than {self.most} lines)")
            if len(self.hosts) > 4096:
                self.hosts = {h: v for h, v in self.hosts.items() if now - v[0] < self.every}
            self.window, self.lines, self.dropped = now, 0, 0
        host = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        entry = self.hosts.get(host)
        if entry is not None and now - entry[0] < self.every:
            entry[1] += 1
            return
        if self.lines >= self.most:
            self.dropped += 1
            return
        hidden = int(entry[1]) if entry is not None else 0
        self.hosts[host] = [now, 0]
        self.lines += 1
        more = f" ({hidden} more from {host} not shown since the last such line)" if hidden else ""
        self.emit(f"fedshield: TLS handshake from {_address(peer)} failed: {reason}{more}")


def watch_tls_handshakes(log: HandshakeLog | None = None) -> bool:
    """Report each failed server-side handshake of asyncio's TLS layer (this process's) to ``log``. A connection
    that sent nothing (a TCP reachability probe, an agent's start-up check) is no handshake and is not reported.
    False where this Python's asyncio lacks the hooks used (then nothing is reported)."""
    from asyncio import sslproto

    cls: Any = sslproto.SSLProtocol
    if getattr(cls, "fedshield_watched", None) is not None:
        cls.fedshield_watched = log or cls.fedshield_watched
        return True
    hooks = ("_do_handshake", "_on_handshake_complete", "_check_handshake_timeout")
    if not all(hasattr(cls, name) for name in hooks) or not hasattr(sslproto, "SSLProtocolState"):
        return False
    do, complete, timeout = (getattr(cls, name) for name in hooks)
    handshaking = sslproto.SSLProtocolState.DO_HANDSHAKE

    def report(self: Any, exc: BaseException | type[BaseException]) -> None:
        try:
            if getattr(self, "_server_side", False) and getattr(self, "fedshield_reads", 0) > 1:  # (1: its start)
                transport = getattr(self, "_transport", None)
                peer = transport.get_extra_info("peername") if transport is not None else None
                cls.fedshield_watched.failed(peer, handshake_reason(exc))
        except Exception:  # noqa: BLE001 - a log line must never break the connection handling
            pass

    def _do_handshake(self: Any) -> None:
        self.fedshield_reads = getattr(self, "fedshield_reads", 0) + 1
        do(self)

    def _on_handshake_complete(self: Any, handshake_exc: Any) -> None:
        if handshake_exc is not None:
            report(self, handshake_exc)
        complete(self, handshake_exc)

    def _check_handshake_timeout(self: Any) -> None:
        if getattr(self, "_state", None) == handshaking:
            report(self, TimeoutError)
        timeout(self)

    cls._do_handshake, cls._on_handshake_complete = _do_handshake, _on_handshake_complete
    cls._check_handshake_timeout = _check_handshake_timeout
    cls.fedshield_watched = log or HandshakeLog()
    return True


def tls_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (libuv: the SuperLink's request handling ~1.4x cheaper than on asyncio's) with TLS served
    by asyncio's TLS layer, whose failed handshakes :func:`watch_tls_handshakes` reports (uvloop's own reports
    none). uvicorn's ``loop`` takes this factory; asyncio's loop serves where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    from asyncio import sslproto

    class Loop(uvloop.Loop):  # type: ignore[misc, name-defined]
        async def create_server(self, protocol_factory: Callable[[], Any], *args: Any, ssl: Any = None,
                                ssl_handshake_timeout: float | None = None, ssl_shutdown_timeout: float | None = None,
                                **kwargs: Any) -> Any:
            if ssl is None:
                return await super().create_server(protocol_factory, *args, **kwargs)

            def tls_protocol() -> asyncio.BaseProtocol:
                return sslproto.SSLProtocol(self, protocol_factory(), ssl, None, server_side=True,
                                            ssl_handshake_timeout=ssl_handshake_timeout,
                                            ssl_shutdown_timeout=ssl_shutdown_timeout)

            return await super().create_server(tls_protocol, *args, **kwargs)

    return Loop()


# Flower's switches for its older gRPC APIs: each starts a second listener (the Control API on
# --control-api-address, 0.0.0.0:9093 by default) that this guard never sees.
UNGUARDED_APIS = ("FLWR_INTERNAL_GRPC_CONTROL_API", "FLWR_INTERNAL_GRPC_FLEET_API")


def command(*args: str) -> list[str]:
    """The command line that runs ``flower-superlink *args`` behind the guard. This file is loaded on its
    own, not as ``coordinator.superlink``: importing the package would load the whole coordinator (torch
    with it) into the SuperLink's process, about 190 MB and 2 s of start-up for nothing it uses."""
    loader = ("import importlib.util as u, sys; s = u.spec_from_file_location('fedshield_superlink', sys.argv.pop(1)); "
              "m = u.module_from_spec(s); s.loader.exec_module(m); m.main()")
    # -P: no working directory on sys.path (``-c`` puts it first): a uvicorn.py or flwr/ where the operator typed
    # the command would otherwise be imported into the SuperLink, which holds the server key
    return [sys.executable, "-P", "-c", loader, os.path.abspath(__file__), *args]


GRACEFUL_SHUTDOWN_S = 5.0


def main(argv: list[str] | None = None) -> None:
    for var in UNGUARDED_APIS:
        if os.environ.pop(var, None) is not None:
            print(f"fedshield: {var} ignored: it would start an API beside the guarded port", file=sys.stderr)
    install()

    import uvicorn

    cli = importlib.import_module("flwr.superlink.cli.flower_superlink")  # the module (the package exports the function)

    serve = uvicorn.run

    def run(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("ssl_certfile"):
            if watch_tls_handshakes():
                kwargs["loop"] = tls_loop  # (uvloop's own TLS layer reports no failed handshake: see tls_loop)
            else:
                print("fedshield: failed TLS handshakes are not logged: this Python's asyncio lacks the hooks used",
                      file=sys.stderr)
        # No X-Forwarded-For / Forwarded: uvicorn rewrites the peer from them for the addresses in
        # $FORWARDED_ALLOW_IPS (often "*" in container images), and a remote peer then passed for 127.0.0.1.
        # A bounded graceful shutdown: uvicorn waited for every open request, and a log stream (flwr run
        # --stream) never ends, so a SIGTERM (the coordinator's stop, or its death) left the SuperLink serving.
        serve(*args, **{**kwargs, "proxy_headers": False, "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S})

    cli.uvicorn = SimpleNamespace(run=run)  # only flower_superlink's own call (uvicorn's module is left as it is)
    sys.argv = ["flower-superlink", *(sys.argv[1:] if argv is None else argv)]
    cli.flower_superlink()


if __name__ == "__main__":
    main()
