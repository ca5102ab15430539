"""Key agreement and authenticated encryption between two clients, with ``cryptography`` only.

Every client makes two X25519 key pairs a round: one whose agreed keys encrypt the
Shamir shares it sends through the server, one whose agreed keys seed the pairwise
masks. They must differ: when a client drops out, the server reconstructs its mask
key, and that must not also open the shares other clients sent it.

Agreed secrets go through HKDF-SHA256 with an ``info`` naming the purpose, the round
and the unordered pair, so one agreement never gives the same key twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edge_client.secagg.errors import DecryptionError, MessageError

__all__ = ["KEY_BYTES", "NONCE_BYTES", "TAG_BYTES", "KeyPair", "generate_keypair", "public_key_of", "pair_info",
           "agree", "encrypt", "decrypt"]

KEY_BYTES = 32     # X25519 private and public keys, derived keys
NONCE_BYTES = 12   # ChaCha20-Poly1305
TAG_BYTES = 16
_RAW = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True, repr=False)
class KeyPair:
    """An X25519 key pair as raw bytes; ``repr`` leaves the private key out of logs."""

    private: bytes
    public: bytes

    def __repr__(self) -> str:
        return f"KeyPair(public={self.public.hex()})"


def _check_key(key: bytes, what: str) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise MessageError(f"{what} must be {KEY_BYTES} raw bytes, got "
                           f"{len(key) if isinstance(key, bytes) else type(key).__name__}")


def generate_keypair() -> KeyPair:
    private = X25519PrivateKey.generate()
    raw = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    return KeyPair(raw, private.public_key().public_bytes(*_RAW))


def public_key_of(private: bytes) -> bytes:
    """The public key of a raw private key: how the server checks a reconstructed mask key."""
    _check_key(private, "a private key")
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(*_RAW)


def pair_info(purpose: str, round_id: int, a: int, b: int) -> bytes:
    """HKDF ``info`` for a pair of clients: the same whichever of the two computes it."""
    low, high = sorted((a, b))
    return (b"fedge-secagg-v1/" + purpose.encode() + b"/" + round_id.to_bytes(8, "big")
            + low.to_bytes(4, "big") + high.to_bytes(4, "big"))


def agree(private: bytes, peer_public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: X25519 then HKDF-SHA256 under ``info``."""
    _check_key(private, "a private key")
    _check_key(peer_public, "a peer's public key")
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:   # a low-order point gives the all-zero secret, which cryptography refuses
        raise MessageError("a peer's public key is a low-order X25519 point; it must come from "
                           "generate_keypair") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """Nonce, ciphertext and tag; ``associated`` (sender, receiver, round) is authenticated, not sent."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    if not isinstance(sealed, bytes) or len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise DecryptionError(f"a ciphertext must hold at least {NONCE_BYTES + TAG_BYTES} bytes (nonce and tag)")
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except InvalidTag:
        raise DecryptionError("a ciphertext does not authenticate: it was altered, or it was sealed for another "
                              "sender, receiver or round") from None
