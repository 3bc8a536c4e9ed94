"""Where a guest's request may go: the policy check both of the egress
gateway's doors share (its Unix socket and the session's proxy port).

A request names an origin: by its ``Host`` header, an absolute URL, or a
``CONNECT`` authority. The route for it is the one policy entry that covers
that origin (an exact origin before a pattern, a longer pattern before a
shorter one) with the concrete origin to reach; under ``"internet"``, any
http(s) origin. What a route may connect to is decided again on the
addresses the name resolves to, and on the address actually connected to
(see :func:`may_connect`), so a name that resolves into the host's loopback
or a private network reaches nothing there unless the policy names it.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from ._network import DEFAULT_PORTS, AllowedOrigin, NetworkPolicy, Origin, canonical_host

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Refusal(Exception):
    """A request the gateway answers itself."""

    def __init__(self, status: int, reason: str, close: bool = False) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.close = close


def split_authority(value: str, what: str = "Host header") -> tuple[str, int | None]:
    """``host[:port]`` and nothing more, canonical."""
    # urlsplit reads more leniently: it drops a query or fragment after the
    # port ("api.example:443#@evil") and tabs or newlines anywhere.
    if not value or any(c not in _AUTHORITY_CHARACTERS for c in value):
        raise Refusal(400, f"malformed {what}")
    try:
        parts = urlsplit(f"//{value}")
        port = parts.port
    except ValueError:
        raise Refusal(400, f"malformed {what}") from None
    if not parts.hostname or parts.username is not None or port == 0:
        raise Refusal(400, f"malformed {what}")
    return canonical_host(parts.hostname), port


# The characters of an RFC 3986 host (a name, an IPv4 address or a bracketed
# IPv6 one) and port.
_AUTHORITY_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~%!$&'()*+,;=[]:")


def _most_specific(candidates: list[AllowedOrigin], asked: str) -> AllowedOrigin:
    """The one entry that covers a request best; Refusal(403) if two tie."""
    if not candidates:
        raise Refusal(403, f"{asked} is not an allowed origin of the session's network policy")

    def rank(allowed: AllowedOrigin) -> tuple[bool, int]:
        return not allowed.origin.is_pattern, len(allowed.origin.host)

    best = max(rank(allowed) for allowed in candidates)
    chosen = [allowed for allowed in candidates if rank(allowed) == best]
    if len(chosen) > 1:
        raise Refusal(403, f"{asked} matches several allowed origins; give the port or an absolute URL")
    return chosen[0]


def _routed(origin: Origin, entry: AllowedOrigin | None) -> AllowedOrigin:
    """The route: the concrete origin, with its policy entry's headers."""
    return AllowedOrigin(origin, entry.headers if entry is not None else ())


def route_request(policy: NetworkPolicy, host_header: str, target: str) -> tuple[AllowedOrigin, str]:
    """The route of a plain HTTP request and the origin-form target to send
    upstream; Refusal(403) unless exactly one policy entry covers it."""
    host, port = split_authority(host_header)
    if target.startswith("/"):
        # No scheme is named: whichever entry's port fits (a guest on the
        # Unix socket speaks plain HTTP for an https origin too).
        candidates = [
            allowed
            for allowed in policy.allowed
            if allowed.origin.names(host)
            and allowed.origin.port == (port if port is not None else DEFAULT_PORTS[allowed.origin.scheme])
        ]
        if policy.kind == "internet":
            scheme = "https" if port == DEFAULT_PORTS["https"] else "http"
            return _routed(Origin(scheme, host, port or DEFAULT_PORTS[scheme]), None), target
        entry = _most_specific(candidates, host_header)
        return _routed(Origin(entry.origin.scheme, host, entry.origin.port), entry), target
    try:
        parts = urlsplit(target)
        target_port = parts.port
    except ValueError:
        raise Refusal(400, "malformed request target", close=True) from None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.username is not None:
        raise Refusal(400, "the request target must be a path or an http(s) URL", close=True)
    origin = Origin(
        parts.scheme,
        canonical_host(parts.hostname),
        target_port if target_port is not None else DEFAULT_PORTS[parts.scheme],
    )
    if (origin.host, origin.port) != (host, port if port is not None else DEFAULT_PORTS[parts.scheme]):
        raise Refusal(403, "the request URL names another origin than the Host header")
    # What follows the origin, as sent: urlsplit's parts would lose an
    # empty query ("/x?" is not "/x"). A fragment is never sent.
    path = target[len(f"{parts.scheme}://{parts.netloc}") :].partition("#")[0]
    path = path if path.startswith("/") else "/" + path
    if policy.kind == "internet":
        return _routed(origin, None), path
    candidates = [
        allowed
        for allowed in policy.allowed
        if (allowed.origin.scheme, allowed.origin.port) == (origin.scheme, origin.port)
        and allowed.origin.names(origin.host)
    ]
    return _routed(origin, _most_specific(candidates, host_header)), path


def route_tunnel(policy: NetworkPolicy, authority: str) -> AllowedOrigin:
    """The route of ``CONNECT host:port``: the https entry that covers that
    host and port (under ``"internet"``, any). An http origin is only
    reached by plain requests, which the gateway reads and rebuilds: a
    tunnel would carry the guest's own Host header (another site of the
    same server's), an Upgrade, or no HTTP at all."""
    host, port = split_authority(authority, "CONNECT target")
    if port is None:
        raise Refusal(400, "a CONNECT target is host:port", close=True)
    if policy.kind == "internet":
        return _routed(Origin("https", host, port), None)
    candidates = [a for a in policy.allowed if a.origin.port == port and a.origin.names(host)]
    tunnelled = [a for a in candidates if a.origin.scheme == "https"]
    if candidates and not tunnelled:
        raise Refusal(403, f"http://{authority} is plain HTTP: send its requests through the proxy, not a CONNECT")
    entry = _most_specific(tunnelled, authority)
    return _routed(Origin("https", host, port), entry)


def is_address(host: str) -> bool:
    """Whether a (canonical) host is an IP address, not a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# IPv6 addresses that lead to the IPv4 address in their last 32 bits:
# NAT64's well-known prefix (RFC 6052; on a host behind DNS64, a name with
# only an A record resolves into it) and SIIT's IPv4-translated ones.
_CARRY_IPV4 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("::ffff:0:0:0/96"))
# Never the internet at large, whatever this Python's tables say: NAT64
# for local use (RFC 8215: the IPv4 address may sit anywhere in it), the
# deprecated IPv4-compatible ::a.b.c.d, and site-local addresses.
_NOT_PUBLIC = (
    ipaddress.IPv6Network("64:ff9b:1::/48"),
    ipaddress.IPv6Network("::/96"),
    ipaddress.IPv6Network("fec0::/10"),
)


def is_public(address: IPAddress) -> bool:
    """An address of the internet at large: not loopback, private,
    link-local, shared, reserved or multicast. An IPv6 address that leads
    to an IPv4 one (mapped, NAT64, 6to4, translated) is judged as that."""
    if isinstance(address, ipaddress.IPv6Address):
        if any(address in network for network in _NOT_PUBLIC):
            return False
        if any(address in network for network in _CARRY_IPV4):
            return is_public(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        carried = address.ipv4_mapped or address.sixtofour
        if carried is not None:
            return is_public(carried)
    return address.is_global and not address.is_multicast


def names_itself(policy: NetworkPolicy, origin: Origin) -> bool:
    """Whether the policy names this origin's host itself, exactly (not by
    a pattern, nor as "internet")."""
    return any(allowed.origin.host == origin.host for allowed in policy.allowed)


def refusal_to_connect(origin: Origin, address: IPAddress, named: bool) -> str | None:
    """Why a route may not connect to ``address``, or None if it may. Only
    public addresses, unless the policy names the host itself (``named``)
    as an IP address (that address) or as localhost (its loopback). A
    guest's IP-literal target is refused unless named, public or not."""
    if is_address(origin.host):
        return None if named else f"{origin.host} is an address, and no allowed origin names it"
    if named and (origin.host == "localhost" or origin.host.endswith(".localhost")):
        return None if address.is_loopback else f"{origin.host} resolves to {address}, not a loopback address"
    if not is_public(address):
        return f"{origin.host} resolves to {address}, which is not a public address"
    return None


def route_within(route: AllowedOrigin, host_header: str, target: str) -> tuple[AllowedOrigin, str]:
    """A request read inside a tunnel the gateway answers itself (see
    _intercept.py): it must be for the tunnel's own origin (421 if not, as
    RFC 9110 says of a request the connection cannot serve)."""
    origin = route.origin
    host, port = split_authority(host_header)
    path = target
    if not target.startswith("/"):
        named, path = route_request(NetworkPolicy("allow", (route,)), host_header, target)
        host, port = named.origin.host, named.origin.port
    if (host, port or DEFAULT_PORTS[origin.scheme]) != (origin.host, origin.port):
        raise Refusal(421, f"this connection is a tunnel to {origin}; {host_header} is another origin")
    return route, path
