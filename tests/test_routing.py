"""The policy check both of the gateway's doors share: which entry covers a
request, and which addresses a route may connect to."""

from __future__ import annotations

import ipaddress

import pytest

from sandboxns._network import check_network_policy
from sandboxns._routing import Refusal, refusal_to_connect, route_request, route_tunnel

pytestmark = pytest.mark.smoke

POLICY = check_network_policy(
    {
        "allow": [
            {"origin": "https://*.example.com", "headers": {"x-key": "pattern"}},
            {"origin": "https://*.api.example.com"},
            {"origin": "https://exact.example.com", "headers": {"x-key": "exact"}},
            {"origin": "http://*.example.com:8080"},
        ]
    }
)


def test_a_pattern_covers_every_name_below_its_domain_and_not_the_domain():
    for host in ("a.example.com", "a.b.c.example.com", "A.Example.COM."):
        route, path = route_request(POLICY, host, "/x")
        assert (str(route.origin), route.headers, path) == (
            f"https://{host.lower().rstrip('.')}",
            (("x-key", "pattern"),),
            "/x",
        )
    for host in ("example.com", "evil-example.com", "example.com.evil.net", "aexample.com"):
        with pytest.raises(Refusal):
            route_request(POLICY, host, "/")


def test_the_most_specific_entry_wins():
    assert route_request(POLICY, "exact.example.com", "/")[0].headers == (("x-key", "exact"),)
    assert route_request(POLICY, "v1.api.example.com", "/")[0].headers == ()  # the longer pattern
    assert route_request(POLICY, "a.example.com:8080", "/")[0].origin.scheme == "http"


def test_a_tunnel_is_routed_by_host_and_port_to_an_https_origin():
    assert str(route_tunnel(POLICY, "a.example.com:443").origin) == "https://a.example.com"
    for authority in (
        "a.example.com",
        "a.example.com:444",
        "example.com:443",
        "a.example.com:443#x",
        "@a.example.com:443",
        "user@a.example.com:443",
        "user:pass@a.example.com:443",
        "a.example.com:443/x",
        "https://a.example.com:443",
    ):
        with pytest.raises(Refusal):
            route_tunnel(POLICY, authority)
    # http://*.example.com:8080 is reached only by plain requests.
    with pytest.raises(Refusal) as refusal:
        route_tunnel(POLICY, "a.example.com:8080")
    assert refusal.value.status == 403 and "plain HTTP" in refusal.value.reason


def test_internet_routes_every_origin():
    internet = check_network_policy("internet")
    assert str(route_tunnel(internet, "pypi.org:443").origin) == "https://pypi.org"
    assert str(route_request(internet, "example.org", "http://example.org/x")[0].origin) == "http://example.org"


@pytest.mark.parametrize(
    ("host", "address", "named", "allowed"),
    [
        ("pypi.org", "151.101.0.223", False, True),
        ("pypi.org", "127.0.0.1", True, False),  # named, but a name that resolves into loopback
        ("pypi.org", "10.1.2.3", True, False),
        ("pypi.org", "192.168.1.1", False, False),
        ("pypi.org", "169.254.169.254", False, False),  # a cloud's metadata service
        ("pypi.org", "100.64.0.1", False, False),  # shared address space
        ("pypi.org", "::ffff:127.0.0.1", False, False),
        ("pypi.org", "fd00::1", False, False),
        ("pypi.org", "2a04:4e42::223", False, True),
        # IPv6 addresses that lead to IPv4 ones: NAT64 (a name with only an A
        # record resolves so behind DNS64), 6to4, IPv4-translated, and
        # IPv4-compatible; and site-local ones. This Python took them all
        # for public.
        ("pypi.org", "64:ff9b::a00:1", False, False),
        ("pypi.org", "64:ff9b::7f00:1", False, False),
        ("pypi.org", "64:ff9b::a9fe:a9fe", False, False),
        ("pypi.org", "64:ff9b::9765:df", False, True),  # 151.101.0.223
        ("pypi.org", "64:ff9b:1::a00:1", False, False),
        ("pypi.org", "2002:a00:1::1", False, False),
        ("pypi.org", "2002:9765:df::1", False, True),
        ("pypi.org", "::ffff:0:a00:1", False, False),
        ("pypi.org", "::a00:1", False, False),
        ("pypi.org", "::7f00:1", False, False),
        ("pypi.org", "fec0::1", False, False),
        ("pypi.org", "0.0.0.0", False, False),  # connecting there reaches this host
        ("pypi.org", "::", False, False),
        ("localhost", "127.0.0.1", True, True),  # the policy names the host's loopback itself
        ("localhost", "127.0.0.1", False, False),
        ("localhost", "10.0.0.1", True, False),
        ("10.0.0.5", "10.0.0.5", True, True),  # an address the policy names
        ("10.0.0.5", "10.0.0.5", False, False),
        ("151.101.0.223", "151.101.0.223", False, False),  # an address nobody named, public or not
    ],
)
def test_which_addresses_a_route_may_reach(host, address, named, allowed):
    origin = route_tunnel(check_network_policy("internet"), f"{host}:443").origin
    assert (refusal_to_connect(origin, ipaddress.ip_address(address), named) is None) == allowed


def test_matching_normalises_origins():
    policy = check_network_policy(
        {"allow": [{"origin": "https://api.example.com"}, {"origin": "http://api.example.com:8080"}]}
    )
    for host, target in (
        ("api.example.com", "/v1"),
        ("API.Example.COM.", "/v1"),
        ("api.example.com:443", "/v1"),
        ("api.example.com", "https://api.example.com:443/v1"),
    ):
        allowed, path = route_request(policy, host, target)
        assert (str(allowed.origin), path) == ("https://api.example.com", "/v1")
    assert str(route_request(policy, "api.example.com:8080", "/")[0].origin) == "http://api.example.com:8080"
    for host, target in (
        ("api.example.com:80", "/"),
        ("other.example.com", "/"),
        ("api.example.com", "http://api.example.com/"),
    ):
        with pytest.raises(Refusal):
            route_request(policy, host, target)


def test_a_host_header_is_a_host_and_port_and_nothing_more():
    policy = check_network_policy({"allow": [{"origin": "https://api.example.com"}]})
    for host in (
        "api.example.com#",
        "api.example.com:443?@evil.example",
        "api.example.com#@evil.example",
        "user@api.example.com",
        "api.example.com/v1",
        "api.exa\tmple.com",
        "api.example.com:4\t43",
    ):
        with pytest.raises(Refusal) as refusal:
            route_request(policy, host, "/")
        assert refusal.value.status == 400, host


def test_a_url_target_reaches_the_upstream_as_sent():
    policy = check_network_policy({"allow": [{"origin": "https://api.example.com"}]})
    for target, upstream_target in (
        ("https://api.example.com/v1?", "/v1?"),
        ("https://api.example.com?", "/?"),
        ("https://api.example.com/v1?a=b#fragment", "/v1?a=b"),
        ("https://api.example.com", "/"),
    ):
        assert route_request(policy, "api.example.com", target)[1] == upstream_target
