"""Addresses as both sides write them: HOST:PORT, an IPv6 host in brackets.

One parser for every address a person or a peer gives us (the command lines'
--http, --join, --attach, --advertise; a NodeReport's addr; the address a
client dials), so that each says the same thing about a bad one.
"""

from __future__ import annotations

import ipaddress

# Where an address to listen on that names no host listens: this machine only. Listening on every
# interface (0.0.0.0) is said, never implied.
LISTEN_HOST = "127.0.0.1"
MAX_PORT = 65535


class AddressError(ValueError):
    """Text that is not the HOST:PORT asked for."""


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_host_port(text: str, listen: bool = False) -> tuple[str, int]:
    """The host (an IPv6 one without its brackets) and port that `text`, HOST:PORT, names.

    An address to dial (the default) names its host, and a port in 1..65535.
    One to listen on (`listen`) may leave the host out, for LISTEN_HOST, and
    take port 0 for any free port. An AddressError names the text and the form.
    """
    host, sep, port = text.rpartition(":")
    lowest = 0 if listen else 1
    # At most five digits: int() of a few thousand would raise ValueError, not AddressError.
    digits = port.isascii() and port.isdigit() and len(port) <= len(str(MAX_PORT))
    if not (sep and digits and lowest <= int(port) <= MAX_PORT):
        raise _error(text, listen)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ipv6(host):
            raise _error(text, listen)
    elif ":" in host or not _is_name(host) or not (host or listen):
        raise _error(text, listen)
    return host or LISTEN_HOST, int(port)


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _is_name(host: str) -> bool:
    """Whether `host` could name a host: no brackets, no spaces or other controls."""
    return host.isprintable() and not any(c in host for c in "[] ")


def _error(text: str, listen: bool) -> AddressError:
    ports = f"0..{MAX_PORT} (0: any free port)" if listen else f"1..{MAX_PORT}"
    host = f", no host meaning {LISTEN_HOST}" if listen else ""
    return AddressError(
        f"expected HOST:PORT, the port in {ports}, an IPv6 host in brackets{host}: {text!r} is not HOST:PORT"
    )
