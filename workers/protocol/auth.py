"""The HMAC challenge-response both ends run before any other message."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os

WORKER_TOKEN_ENV = "RLX_WORKER_TOKEN"
NONCE_BYTES = 32


def new_nonce() -> bytes:
    """Return fresh random bytes for a challenge."""
    return os.urandom(NONCE_BYTES)


def new_token() -> str:
    """Return a random shared token for workers started by this coordinator."""
    return os.urandom(32).hex()


def mac(token: str, role: str, nonce: bytes) -> bytes:
    """MAC a peer's nonce; `role` is who answers, so a reply can't be reflected."""
    return hmac.new(token.encode(), role.encode() + b"\0" + nonce, hashlib.sha256).digest()


def verify(token: str, role: str, nonce: bytes, answer: bytes) -> bool:
    """Check an answer in constant time."""
    return hmac.compare_digest(mac(token, role, nonce), answer)


def ticket_proof(ticket: bytes, nonce: bytes) -> bytes:
    """Prove holding a join ticket to whoever sent `nonce`, without showing the ticket."""
    return hmac.new(ticket, b"joined\0" + nonce, hashlib.sha256).digest()


def holds_ticket(ticket: bytes, nonce: bytes, proof: bytes) -> bool:
    """Check a ticket proof in constant time."""
    return hmac.compare_digest(ticket_proof(ticket, nonce), proof)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach; anything else needs a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
