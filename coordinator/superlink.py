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
"""

from __future__ import annotations

import ipaddress
import os
import sys
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


async def _plain(send: Callable[[Any], Awaitable[None]], status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
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
        seen, started = 0, False

        async def counted() -> Any:  # a chunked body, or one longer than it said
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.cap:
                    raise _TooLarge
            return message

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await _plain(send, 413, TOO_LARGE)


def install() -> None:
    """Put :class:`LocalControlOnly` in front of the SuperLink's middleware (before its app is made)."""
    from flwr.superlink import extensions
    from starlette.middleware import Middleware

    if getattr(extensions.get_middleware, "fedshield_guard", False):
        return
    flower_own = extensions.get_middleware

    def get_middleware() -> tuple[Middleware, ...]:
        return (Middleware(LocalControlOnly), *flower_own())

    get_middleware.fedshield_guard = True  # type: ignore[attr-defined]
    extensions.get_middleware = get_middleware


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
    import importlib

    import uvicorn

    cli = importlib.import_module("flwr.superlink.cli.flower_superlink")  # the module (the package exports the function)

    serve = uvicorn.run

    def run(*args: Any, **kwargs: Any) -> None:
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
