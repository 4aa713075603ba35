"""The web server's front door: which requests reach Gradio at all.

- Cross-origin requests are refused (403, no CORS headers): a page on another site could otherwise drive the UI
  with the visitor's login cookie. Allowed: the UI's own origin (Origin's host:port is the Host the request was
  sent to) and those the user lists (--allowed-origin, IMAGETUNE_ALLOWED_ORIGINS), e.g. a proxy's.
- Served on a loopback address, the Host header must name this machine (DNS rebinding: a site whose name
  resolves to 127.0.0.1 would otherwise be "same origin" with the UI).
- Failed logins back off exponentially per client and user name (429 with Retry-After); the clock is injected.
  The client is the connecting address, or, when that address is a proxy the operator trusts
  (IMAGETUNE_TRUSTED_PROXIES), the address that proxy forwarded in X-Forwarded-For: behind a shared proxy every
  visitor has the proxy's address, and one wrong guess locked the owner out too (issue 29).
- The login cookie is SameSite=Lax (Gradio sets None, which sends it along with other sites' requests).

Pure functions and a small ASGI wrapper; `install` puts it outside Gradio's whole middleware stack, so it sees
every request first, from the server's very first one.
"""

from __future__ import annotations

import ipaddress
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from trainer.errors import UserError

ORIGINS_ENV = "IMAGETUNE_ALLOWED_ORIGINS"
PROXIES_ENV = "IMAGETUNE_TRUSTED_PROXIES"
LOGIN_BODY_MAX = 64 * 1024  # a login form is a few dozen bytes; the guard reads it whole to learn the user name
DEFAULT_PORTS = {"http": 80, "https": 443}


def _netloc(scheme: str, host: str, port: int | None) -> str:
    host = host.lower().strip("[]")
    shown = f"[{host}]" if ":" in host else host
    return shown if port in (None, DEFAULT_PORTS.get(scheme)) else f"{shown}:{port}"


def normalize_origin(text: str) -> str | None:
    """`scheme://host[:port]` in lower case without a default port, or None for anything else ('null', paths)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/") or parts.query:
        return None
    return f"{parts.scheme}://{_netloc(parts.scheme, parts.hostname, port)}"


def split_host(header: str) -> tuple[str, int | None]:
    try:
        parts = urlsplit(f"//{header.strip()}")
        return (parts.hostname or "").lower(), parts.port
    except ValueError:
        return "", None


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class OriginPolicy:
    bind_host: str
    allowed: frozenset[str] = frozenset()

    @classmethod
    def build(cls, bind_host: str, origins: Iterable[str] = (), environ=None) -> OriginPolicy:
        import os

        environ = os.environ if environ is None else environ
        listed = [o for o in (*origins, *environ.get(ORIGINS_ENV, "").split(",")) if o.strip()]
        normal = []
        for origin in listed:
            found = normalize_origin(origin)
            if found is None:
                raise UserError(f"Allowed origin {origin!r} (--allowed-origin or {ORIGINS_ENV}) is not an origin; "
                                "write it as scheme://host[:port], e.g. https://abc123-7860.proxy.runpod.net")
            normal.append(found)
        return cls(bind_host, frozenset(normal))

    def host_problem(self, host_header: str) -> str | None:
        """Why a request's Host is refused: on a loopback address only this machine's names are served."""
        if not is_loopback(self.bind_host):
            return None
        host, _ = split_host(host_header)
        allowed_hosts = {"localhost", "127.0.0.1", "::1", self.bind_host.lower()}
        allowed_hosts |= {split_host(urlsplit(o).netloc)[0] for o in self.allowed}
        if host in allowed_hosts:
            return None
        return f"Host {host_header!r} is not this machine (a DNS-rebinding page?)"

    def origin_problem(self, origin: str | None, host_header: str, scheme: str = "http") -> str | None:
        """Why a request with this Origin is refused; None when it is the UI's own page (or listed)."""
        if origin is None:
            return None  # not sent by a browser page of another site (browsers send Origin cross-origin)
        found = normalize_origin(origin)
        if found is None:
            return f"Origin {origin!r} is not allowed"
        if found in self.allowed:
            return None
        host, port = split_host(host_header)
        origin_scheme = found.split("://", 1)[0]
        # Behind a TLS proxy the page is https while the request reaches us as http: compare host and port only.
        if host and _netloc(origin_scheme, host, port) == found.split("://", 1)[1]:
            return None
        if host and _netloc(scheme, host, port) == found.split("://", 1)[1]:
            return None
        return f"Origin {origin!r} is not this UI's (allow it with --allowed-origin)"


Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def trusted_proxies(text: str | None = None, environ=None) -> Networks:
    """The proxies whose X-Forwarded-For is believed: addresses or networks, comma-separated (PROXIES_ENV)."""
    import os

    if text is None:
        text = (os.environ if environ is None else environ).get(PROXIES_ENV, "")
    networks = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise UserError(f"{PROXIES_ENV}: {item!r} is not an address or a network; list the proxies in front "
                            "of the UI as addresses or CIDR networks, comma-separated (e.g. 10.0.0.0/8)") from None
    return tuple(networks)


def _trusted(addr: str, proxies: Networks) -> bool:
    try:
        ip = ipaddress.ip_address(addr.strip().strip("[]"))
    except ValueError:
        return False
    return any(ip in net for net in proxies)


def client_address(peer: str, forwarded_for: str | None, proxies: Networks) -> str:
    """Who sent the request: the peer, unless it is a trusted proxy; then X-Forwarded-For read from the right
    (each proxy appends the address it was reached from) to the first address no trusted proxy has. A header sent
    by anyone else is ignored: it could name any address, a fresh back-off each time."""
    if not _trusted(peer, proxies):
        return peer
    addr = peer
    for hop in reversed([h.strip() for h in (forwarded_for or "").split(",") if h.strip()]):
        addr = hop[:64]  # a client's own entries can be any text: keep the key small
        if not _trusted(hop, proxies):
            break
    return addr


@dataclass
class LoginThrottle:
    """Exponential back-off of failed logins per key (the guard's key: client and user name): after n failures in
    a row, the next attempt is refused for base * 2^(n-1) seconds (at most cap). A success forgets the key."""

    clock: Callable[[], float] = time.monotonic
    base: float = 1.0
    cap: float = 300.0
    _failures: dict[str, tuple[int, float]] = field(default_factory=dict)

    def wait_s(self, addr: str) -> float:
        count, until = self._failures.get(addr, (0, 0.0))
        return max(0.0, until - self.clock())

    def failed(self, addr: str) -> float:
        now = self.clock()
        if len(self._failures) > 10_000:  # many addresses: forget those whose back-off ran out long ago
            self._failures = {a: v for a, v in self._failures.items() if v[1] + self.cap > now}
        count = self._failures.get(addr, (0, 0.0))[0] + 1
        delay = min(self.cap, self.base * 2 ** (count - 1))
        self._failures[addr] = (count, now + delay)
        return delay

    def succeeded(self, addr: str) -> None:
        self._failures.pop(addr, None)


_SAMESITE = re.compile(rb";\s*samesite=[a-z]+", re.I)


def lax_cookie(value: bytes) -> bytes:
    return _SAMESITE.sub(b"", value) + b"; SameSite=Lax"


class Guard:
    """ASGI wrapper applying OriginPolicy, LoginThrottle and SameSite=Lax around `app`."""

    def __init__(self, app, policy: OriginPolicy, throttle: LoginThrottle, proxies: Networks = ()):
        self.app, self.policy, self.throttle, self.proxies = app, policy, throttle, proxies

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        problem = self.policy.host_problem(host) or self.policy.origin_problem(
            headers.get("origin"), host, "https" if scope.get("scheme") in ("https", "wss") else "http")
        if problem:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _respond(send, 403, problem)
        login = scope["type"] == "http" and scope.get("method") == "POST" and \
            scope.get("path", "").rstrip("/").endswith("/login")
        addr = ""
        if login:
            body, receive = await _read_body(receive)
            if body is None:
                return await _respond(send, 413, "A login form is a user name and a password, nothing larger.")
            user = (parse_qs(body.decode("latin-1")).get("username") or [""])[0][:256]
            client = client_address((scope.get("client") or ("?",))[0], headers.get("x-forwarded-for"),
                                    self.proxies)
            # Per client *and* user name: guesses at one name slow down that name from that client only, so
            # neither a visitor behind the same proxy nor one guessing another name locks the owner out.
            addr = json.dumps([client, user])
            if (wait := self.throttle.wait_s(addr)) > 0:
                return await _respond(send, 429, f"Too many failed logins; try again in {wait:.0f} s.",
                                      [(b"retry-after", str(max(1, round(wait))).encode())])
        status = []

        async def guarded_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message["headers"] = [(k, lax_cookie(v) if k.lower() == b"set-cookie" else v)
                                      for k, v in message.get("headers", [])]
            await send(message)

        await self.app(scope, receive, guarded_send)
        if login and status:
            if status[0] == 200:
                self.throttle.succeeded(addr)
            elif status[0] in (400, 401, 403):
                self.throttle.failed(addr)


async def _read_body(receive):
    """(the request's whole body, a `receive` that hands it on to the app), or (None, _) past LOGIN_BODY_MAX."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client went away; the app sees an empty body
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > LOGIN_BODY_MAX:
            return None, receive
        more = message.get("more_body", False)
    body, sent = b"".join(chunks), []

    async def replay():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


async def _respond(send, code: int, detail: str, extra: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


def install(policy: OriginPolicy, throttle: LoginThrottle, proxies: Networks = ()) -> None:
    """Wrap every Gradio app this process builds (there is one) in a Guard, before it serves its first request."""
    from gradio.routes import App

    original = getattr(App.build_middleware_stack, "_unguarded", App.build_middleware_stack)

    def build_middleware_stack(self):
        return Guard(original(self), policy, throttle, proxies)

    # A marker on the function (installing twice wraps once), and a patch of Gradio's method: both untypeable.
    build_middleware_stack._unguarded = original  # type: ignore[attr-defined]
    App.build_middleware_stack = build_middleware_stack  # type: ignore[method-assign]
