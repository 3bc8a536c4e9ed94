"""Network policies: what a session's guests may reach.

* ``"deny-all"``: the session's own network namespace with only ``lo``.
* ``"allow-all"``: the host's network, shared.
* ``{"allow": [{"origin": "https://api.example.com", "headers": {...}}]}``:
  still an isolated namespace; the only way out is HTTP through the egress
  gateway (see _gateway.py), to exactly these origins (or, for
  ``https://*.example.com``, any subdomain of the name), with these headers
  injected.
* ``"internet"``: the isolated namespace and the gateway, to every origin
  whose addresses are public; never the host's loopback or private ranges.

A policy object never shows its header values: not in ``repr``, not in an
error message. They are credentials, and they live only in host memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from ._errors import invalid_argument

PolicyKind = Literal["deny-all", "allow-all", "allow", "internet"]
GUEST_SOCKET = "/run/sandboxns-network.sock"
# The gateway's directory in the guest: its socket (GUEST_SOCKET links to
# it) and, for a session whose policy intercepts TLS, the trust bundle.
GUEST_GATEWAY_DIR = "/run/sandboxns"
GATEWAY_SOCKET_NAME = "network.sock"
# Where a gateway session's proxy listens in its own network namespace
# (127.0.0.1 and [::1]); its commands' proxy variables name it.
PROXY_PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
# What every command of a gateway session gets, unless its own environment
# says otherwise: the variables HTTP clients read for a proxy (curl, pip,
# git, Python, Node's and Go's libraries; npm has its own), and the guest's
# own loopback kept off it.
_LOCAL = "localhost,127.0.0.1,::1"
PROXY_ENVIRONMENT = {
    **{
        name: PROXY_URL for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
    },
    "NO_PROXY": _LOCAL,
    "no_proxy": _LOCAL,
    "npm_config_proxy": PROXY_URL,
    "npm_config_https_proxy": PROXY_URL,
}
# And, where the policy intercepts TLS, what makes the tools trust the
# session's CA: a bundle of the host's CAs and it (see _intercept.py).
GUEST_TRUST_BUNDLE = f"{GUEST_GATEWAY_DIR}/ca.pem"
PROXY_TRUST_ENVIRONMENT = {
    name: GUEST_TRUST_BUNDLE
    for name in (
        "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO",
        "npm_config_cafile",
    )
}  # fmt: skip
# Every variable a policy's gateway sets in its commands' environment.
GATEWAY_ENVIRONMENT = frozenset(PROXY_ENVIRONMENT) | frozenset(PROXY_TRUST_ENVIRONMENT)
DEFAULT_PORTS = {"http": 80, "https": 443}
# RFC 9110 token characters.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Headers a policy may not set: they frame or route the message, which the
# gateway does itself.
FORBIDDEN_HEADERS = frozenset(
    {"host", "connection", "content-length", "transfer-encoding", "te", "trailer", "upgrade", "keep-alive"}
)
CREDENTIAL_HEADERS = frozenset({"cookie", "authorization", "proxy-authorization"})


@dataclass(frozen=True)
class Origin:
    """A canonical HTTP(S) origin: scheme, lower-case host without a
    trailing dot, effective port. A host ``*.example.com`` is a pattern:
    any name below example.com (at any depth), never example.com itself."""

    scheme: str
    host: str
    port: int

    @property
    def is_pattern(self) -> bool:
        return self.host.startswith("*.")

    def names(self, host: str) -> bool:
        """Whether ``host`` (canonical) is this origin's host or one its
        pattern covers."""
        if self.is_pattern:
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.port == DEFAULT_PORTS[self.scheme]:
            return f"{self.scheme}://{host}"
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def host_header(self) -> str:
        """The Host header an upstream expects for this origin."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


def canonical_host(host: str) -> str:
    """Lower case, without the trailing dot of a fully qualified name."""
    host = host.lower()
    return host.removesuffix(".")


def parse_origin(text: object, what: str = "origin") -> Origin:
    """``scheme://host[:port]`` with nothing else; refuses anything that is
    not exactly an origin."""
    if not isinstance(text, str) or not text or any(c in text for c in "\0\r\n\t \\"):
        raise invalid_argument(f"{what} must be an origin like 'https://api.example.com', not {text!r}")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise invalid_argument(f"{what} {text!r} is not a valid origin: {exc}") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise invalid_argument(f"{what} {text!r} must use http or https")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise invalid_argument(f"{what} {text!r} must not contain user information")
    if parts.path not in ("", "/") or parts.query or parts.fragment or text.endswith(("?", "#")):
        raise invalid_argument(f"{what} {text!r} must not have a path, query or fragment")
    host = parts.hostname or ""
    pattern = host.startswith("*.")
    name = host.removeprefix("*.")
    if not name or "*" in name or not re.fullmatch(r"[A-Za-z0-9.\-:_]+", name) or name.startswith("."):
        raise invalid_argument(
            f"{what} {text!r} must name one host, or all names below one as *.example.com (a leading '*.' only)"
        )
    if pattern and (":" in name or re.fullmatch(r"[0-9.]+", name)):
        raise invalid_argument(f"{what} {text!r}: a pattern covers names below a domain, not addresses")
    if port == 0:
        raise invalid_argument(f"{what} {text!r} has an invalid port")
    return Origin(parts.scheme, canonical_host(host), port if port is not None else DEFAULT_PORTS[parts.scheme])


@dataclass(frozen=True, repr=False)
class AllowedOrigin:
    origin: Origin
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def injects_credentials(self) -> bool:
        return bool(self.headers)

    def __repr__(self) -> str:
        names = ", ".join(name for name, _ in self.headers)
        return f"AllowedOrigin({str(self.origin)!r}, headers=[{names}])"


@dataclass(frozen=True, repr=False)
class NetworkPolicy:
    """A checked network policy (see the module docstring)."""

    kind: PolicyKind
    allowed: tuple[AllowedOrigin, ...] = field(default=())

    @property
    def shares_host_network(self) -> bool:
        return self.kind == "allow-all"

    @property
    def needs_gateway(self) -> bool:
        return self.kind in ("allow", "internet")

    @property
    def intercepts(self) -> bool:
        """Whether an https origin gets headers from the policy: the
        gateway then answers tunnels to it with the session's own CA."""
        return any(allowed.injects_credentials and allowed.origin.scheme == "https" for allowed in self.allowed)

    def __repr__(self) -> str:
        if self.kind != "allow":
            return f"NetworkPolicy({self.kind!r})"
        return f"NetworkPolicy(allow={list(self.allowed)!r})"


DENY_ALL = NetworkPolicy("deny-all")


def header_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a header a policy injects, or None if it can."""
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        return f"{name!r} is not a valid header name"
    lower = name.lower()
    if lower in FORBIDDEN_HEADERS or lower.startswith("proxy-"):
        return f"{name!r} frames or routes the request and cannot be injected"
    return None


def _check_headers(headers: object, where: str) -> tuple[tuple[str, str], ...]:
    if headers is None:
        return ()
    if not isinstance(headers, Mapping):
        raise invalid_argument(f"{where}.headers must map header names to values")
    checked: dict[str, str] = {}
    for name, value in headers.items():
        problem = header_name_problem(name)
        if problem is not None:
            raise invalid_argument(f"{where}.headers: {problem}")
        lower = name.lower()
        if lower in checked:
            raise invalid_argument(f"{where}.headers: {name!r} is given twice")
        # The value is a credential: say what is wrong with it, never what it is.
        if not isinstance(value, str):
            raise invalid_argument(f"{where}.headers[{name!r}] must be a string")
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value):
            raise invalid_argument(f"{where}.headers[{name!r}] contains a control character (CR, LF, NUL, ...)")
        if value != value.strip(" \t"):
            raise invalid_argument(
                f"{where}.headers[{name!r}] starts or ends with white space, which HTTP does not allow"
            )
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            raise invalid_argument(f"{where}.headers[{name!r}] has characters HTTP headers cannot carry") from None
        checked[lower] = value
    return tuple(checked.items())


def check_network_policy(policy: object) -> NetworkPolicy:
    """Validate a network policy as callers give it; an already checked
    :class:`NetworkPolicy` passes through."""
    if isinstance(policy, NetworkPolicy):
        return policy
    if policy == "deny-all":
        return DENY_ALL
    if policy in ("allow-all", "internet"):
        return NetworkPolicy(policy)
    if not isinstance(policy, Mapping):
        raise invalid_argument(
            f"network policy must be 'deny-all', 'allow-all', 'internet' or {{'allow': [...]}}, not {policy!r}"
        )
    unknown = set(policy) - {"allow"}
    if unknown:
        raise invalid_argument(f"network policy has unknown keys {sorted(map(str, unknown))}; only 'allow' is known")
    entries = policy.get("allow")
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple)):
        raise invalid_argument("network policy 'allow' must be a list of {'origin': ..., 'headers': {...}}")
    allowed: list[AllowedOrigin] = []
    for index, entry in enumerate(entries):
        where = f"allow[{index}]"
        if not isinstance(entry, Mapping):
            raise invalid_argument(f"{where} must be a mapping with 'origin' and optional 'headers'")
        extra = set(entry) - {"origin", "headers"}
        if extra:
            raise invalid_argument(f"{where} has unknown keys {sorted(map(str, extra))}")
        origin = parse_origin(entry.get("origin"), f"{where}.origin")
        if any(existing.origin == origin for existing in allowed):
            raise invalid_argument(f"{where}.origin {str(origin)!r} is allowed twice")
        allowed.append(AllowedOrigin(origin, _check_headers(entry.get("headers"), where)))
    return NetworkPolicy("allow", tuple(allowed))
