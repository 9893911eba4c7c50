"""HOST:PORT is parsed by one function on both sides, and formatted by one."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.protocol.address import LISTEN_HOST, AddressError, host_port, parse_host_port

names = st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){0,3}", fullmatch=True)
ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)
ports = st.integers(1, 65535)


@given(host=st.one_of(names, ipv4, ipv6), port=ports)
def test_what_host_port_writes_parses_back_to_the_same_host_and_port(host, port):
    assert parse_host_port(host_port(host, port)) == (host, port)
    assert parse_host_port(host_port(host, port), listen=True) == (host, port)


@given(host=ipv6, port=ports)
def test_an_ipv6_host_is_written_in_brackets(host, port):
    assert host_port(host, port) == f"[{host}]:{port}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("coordinator:8471", ("coordinator", 8471)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("[::1]:65535", ("::1", 65535)),
        ("[fe80::1%eth0]:8471", ("fe80::1%eth0", 8471)),
        ("0.0.0.0:08471", ("0.0.0.0", 8471)),
    ],
)
def test_an_address_to_dial_names_its_host_and_port(text, expected):
    assert parse_host_port(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (":0", (LISTEN_HOST, 0)),
        (":8470", ("127.0.0.1", 8470)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::]:0", ("::", 0)),
    ],
)
def test_an_address_to_listen_on_may_leave_out_the_host_for_loopback_and_take_port_zero(text, expected):
    assert parse_host_port(text, listen=True) == expected


BAD_EITHER_WAY = [
    "",
    "8470",
    "nowhere",
    "h:",
    "h:-1",
    "h:65536",
    "h:" + "9" * 5000,  # more digits than int() takes from text
    "h:http",
    "h:\u0661",  # an Arabic-Indic digit: isdigit() says yes, the port is no number we take
    "h:\u00b2",
    "h: 80",
    "::1:8471",  # an IPv6 host without brackets: where does it end?
    "[::1:8471",
    "[nowhere]:8471",
    "[]:8471",
    "[[::1]]:8471",
    "a]:1",
    "a b:1",
    "a\tb:1",
    "a\n:1",
]


@pytest.mark.parametrize("listen", [False, True])
@pytest.mark.parametrize("text", BAD_EITHER_WAY)
def test_text_that_is_not_host_port_is_refused_naming_it_and_the_form_expected(text, listen):
    with pytest.raises(AddressError) as info:
        parse_host_port(text, listen=listen)
    message = str(info.value)
    assert message.startswith("expected HOST:PORT, the port in ")
    assert f"{text!r} is not HOST:PORT" in message
    assert "an IPv6 host in brackets" in message


@pytest.mark.parametrize("text", [":8471", "h:0", "[::1]:0"])
def test_an_address_to_dial_needs_a_host_and_a_port_above_zero(text):
    assert parse_host_port(text, listen=True)  # taken to listen on
    with pytest.raises(AddressError, match=r"the port in 1\.\.65535") as info:
        parse_host_port(text)
    assert repr(text) in str(info.value)


def test_the_error_for_an_address_to_listen_on_says_port_zero_is_any_and_no_host_is_loopback():
    with pytest.raises(AddressError) as info:
        parse_host_port("h:65536", listen=True)
    assert "the port in 0..65535 (0: any free port)" in str(info.value)
    assert f"no host meaning {LISTEN_HOST}" in str(info.value)


def test_an_address_error_is_a_value_error():
    assert issubclass(AddressError, ValueError)


@given(text=st.text(max_size=30), listen=st.booleans())
def test_any_text_is_either_parsed_into_a_host_and_a_port_in_range_or_refused_with_an_address_error(
    text, listen
):
    try:
        host, port = parse_host_port(text, listen=listen)
    except AddressError as exc:
        assert repr(text) in str(exc)
        return
    assert (0 if listen else 1) <= port <= 65535
    assert host and "[" not in host and "]" not in host
    if ":" in host:
        ipaddress.IPv6Address(host)
    assert parse_host_port(host_port(host, port), listen=listen) == (host, port)
