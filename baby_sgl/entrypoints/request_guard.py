"""The server's first line, in front of every route (a plain ASGI middleware):

- bound to a loopback address, the server answers only requests whose Host is a loopback name
  or address, or one of `--allowed-hosts` (403 otherwise): a page on a site whose name an
  attacker resolves to 127.0.0.1 (DNS rebinding) sends its own name as the Host;
- requests a browser sends from another site's page (an `Origin` that is not this server)
  are refused, so no web page can drive a server on localhost;
- a GET that changes the server's state (SGLang's clients send these as GETs too) needs
  `Content-Type: application/json` or the API key, which no cross-site image or link can send;
- with `--api-key`, every route but /health needs `Authorization: Bearer <key>`; the dashboard's
  routes also take the key as HTTP Basic auth's password, which a browser asks for and then
  sends with the page's own requests;
- a body larger than `--max-request-bytes` is refused (413) before any of it is parsed, by its
  Content-Length or, for chunked bodies, as soon as it grows past the limit;
- a body that takes longer than `--request-body-timeout` seconds to arrive is refused (408);
- a POST body must be JSON (415), which a cross-site HTML form cannot send.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import ipaddress
import time
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baby_sgl.entrypoints.responses import error_response

OPEN_PATHS = frozenset({"/health"})  # a supervisor's liveness probe needs no key
BROWSER_PREFIX = "/dashboard"  # pages a person opens in a browser: Basic auth is offered too
# Routes that act (flush the cache, run the model, walk the memory in the scheduler's thread) yet
# answer GET, as SGLang's do.
ACTING_GETS = frozenset({"/flush_cache", "/health_generate", "/debug/check_memory"})


def allowed_host_names(listen_host: str, allowed_hosts: tuple[str, ...]) -> frozenset[str] | None:
    """The Host names a server listening on listen_host answers besides the loopback ones, or
    None for any: a server bound to another address is reached by names we cannot know, unless
    --allowed-hosts lists them."""
    if "*" in allowed_hosts or not (allowed_hosts or is_loopback(listen_host)):
        return None
    return frozenset(_host_name(h) for h in (listen_host, *allowed_hosts))


def is_loopback(name: str) -> bool:
    """localhost (and its subdomains, which resolve to loopback by RFC 6761) or a loopback address."""
    name = _host_name(name)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int, body_timeout: float,
                 host_names: frozenset[str] | None = frozenset()) -> None:
        """host_names: what allowed_host_names gives (None: any Host is answered)."""
        self.app = app
        self.host_names = host_names
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_request_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._check_headers(scope, headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, refusal = await self._read_body(headers, receive, scope["path"])
            if body is None and refusal is None:
                return  # the client left while sending
            if refusal is None and body and not _is_json(headers.get("content-type", "")):
                refusal = error_response("the body must be JSON, sent with Content-Type: application/json", 415,
                                         path=scope["path"])
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check_headers(self, scope: Scope, headers: dict[str, str]):
        host = headers.get("host")
        if host is not None and self.host_names is not None and not self._host_allowed(host):
            return error_response(f"the Host {host!r} is not served here: only loopback names and those given "
                                  "with --allowed-hosts are", 403, path=scope["path"])
        origin = headers.get("origin")
        if origin is not None and _origin_host(origin) != headers.get("host"):
            return error_response(f"cross-origin requests are refused (Origin: {origin!r})", 403, path=scope["path"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            browser = scope["path"].startswith(BROWSER_PREFIX)
            key = headers.get("x-api-key")  # Anthropic's clients send the key so
            if not self._authorized(f"Bearer {key}" if key else headers.get("authorization", ""), basic=browser):
                response = error_response("a valid API key is needed: send Authorization: Bearer <key> "
                                          "(or x-api-key: <key>)", 401, path=scope["path"])
                response.headers["WWW-Authenticate"] = 'Basic realm="baby-sgl"' if browser else "Bearer"
                return response
        if scope["method"] in ("GET", "HEAD") and scope["path"] in ACTING_GETS and self.api_key is None \
                and not _is_json(headers.get("content-type", "")):
            return error_response(f"GET {scope['path']} acts on the server: send it as POST, or as a GET with "
                                  "Content-Type: application/json", 400, path=scope["path"])
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(f"invalid Content-Length {length!r}", 400, path=scope["path"])
            if int(length) > self.max_bytes:
                return error_response(f"the request body is {int(length)} bytes; the limit is {self.max_bytes}", 413,
                                      path=scope["path"])
        return None

    def _host_allowed(self, host: str) -> bool:
        name = _host_name(host)
        return is_loopback(name) or name in (self.host_names or ())

    def _authorized(self, given: str, basic: bool) -> bool:
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "basic" and basic:  # user:password, the key being the password
            try:
                token = base64.b64decode(token.strip(), validate=True).decode("latin-1").partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        return self.api_key is not None and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key)

    async def _read_body(self, headers: dict[str, str], receive: Receive, path: str):
        """(body, None), or (None, a refusal), or (None, None) if the client disconnected."""
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                return None, error_response(f"the request body did not arrive within {self.body_timeout:g} s", 408,
                                            path=path)
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None, error_response(f"the request body is larger than the limit of {self.max_bytes} bytes",
                                            413, path=path)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _host_name(host: str) -> str:
    """A host's name as compared: no port, no IPv6 brackets, lower case, no final dot
    ("[::1]:8080" -> "::1", "LocalHost.:80" -> "localhost")."""
    host = host.strip()
    name, colon, port = host.rpartition(":")
    if not (colon and port.isdigit() and (name.endswith("]") or ":" not in name)):
        name = host  # no port (a bare IPv6 address has colons of its own)
    return name.strip("[]").lower().rstrip(".")


def _origin_host(origin: str) -> str | None:
    try:
        return urlsplit(origin).netloc
    except ValueError:  # not even a URL: not this server
        return None


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the client's own messages (a later disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
