"""What stands between the network and the OpenAI-compatible app: the API key and the Host
header (:class:`Guard`, an ASGI middleware), and a request body read under a size limit and
a deadline (:func:`read_body`).

The body is read chunk by chunk as the connection delivers it (uvicorn stops reading the
socket while 64 KiB wait unread), so a body over the limit costs at most the limit plus one
chunk of memory, and is refused (413) as soon as it passes the limit, or at once when its
``Content-Length`` says so.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Iterable

from forge_jax.serving.openai_params import APIError

# Routes open without the API key (a load balancer's probe carries none).
OPEN_PATHS = frozenset({"/health"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def default_allowed_hosts(bind: str) -> frozenset[str] | None:
    """The Host names a server bound to ``bind`` answers: for a loopback address, the
    loopback names (a web page a browser shows cannot reach it under another name: DNS
    rebinding); for another address, that address; for every interface (``0.0.0.0``,
    ``::``), any (None)."""
    if bind in ("", "0.0.0.0", "::"):
        return None
    try:
        loopback = ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = bind == "localhost"
    return _LOOPBACK_NAMES | {bind} if loopback else frozenset({bind})


def parse_allowed_hosts(text: str) -> frozenset[str] | None:
    """``--allowed-hosts``: names separated by commas, ``*`` for any (None)."""
    names = frozenset(n.strip().lower() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"--allowed-hosts names no host: {text!r}")
    return None if "*" in names else names


def host_name(header: str) -> str:
    """The name of a Host header, without its port (``[::1]:8000`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _error_response(error: APIError):
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class Guard:
    """ASGI middleware: a request whose Host header is not allowed is a 400 (every route),
    one without the API key a 401 (every route but :data:`OPEN_PATHS`), in OpenAI's shape.

    Args:
      app: the ASGI app it guards.
      api_key: the key clients send as ``Authorization: Bearer KEY`` (None: none needed).
      allowed_hosts: the Host names served (None: any).
    """

    def __init__(self, app, *, api_key: str | None = None,
                 allowed_hosts: Iterable[str] | None = None):
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()
        self.allowed_hosts = None if allowed_hosts is None else frozenset(
            h.lower() for h in allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self.check(scope)
            if error is not None:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        headers = dict(scope.get("headers") or ())
        if self.allowed_hosts is not None:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                return APIError(400, f"the Host header {host!r} is not served here (allowed: "
                                     f"{', '.join(sorted(self.allowed_hosts))}; the server's "
                                     f"--allowed-hosts adds names)", code="invalid_host")
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(),
                                                                      self.api_key):
                return APIError(401, "Incorrect or missing API key: send it as "
                                     "'Authorization: Bearer KEY'", code="invalid_api_key")
        return None


async def read_body(receive, headers, *, limit: int, timeout: float | None) -> bytes:
    """The request body from the ASGI ``receive``, at most ``limit`` bytes, all of it within
    ``timeout`` seconds (None: no deadline).

    Raises:
      APIError: 413 for a body over the limit (its Content-Length, or as it arrives), 408
        for one that does not arrive in time, 400 for a client that left.
    """
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks, size = [], 0
    while True:
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                                f"({size} bytes came)", code="request_timeout",
                           headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client disconnected while sending its body",
                           code="client_disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit, partial=True)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def too_large(size: int, limit: int, *, partial: bool = False) -> APIError:
    return APIError(413, f"the request body is {'over ' if partial else ''}{size} bytes, more "
                         f"than this server's limit of {limit} bytes (--max-request-bytes)",
                    code="request_too_large", headers={"Connection": "close"})
