"""One block in the shared pool: a 128-byte header, then the payload, sealed with the deployment's secret.

A pool value is stored as one object, written from and read back into two or more buffers (the
header, then the payload whole or in the caller's pieces), so the payload moves zero-copy between
the pool and the caller's memory.

Why a seal. Mooncake Store has no authentication: any process that reaches the pool can read,
write, overwrite (``upsert``) or remove any object. So every value kvstrata reads back from the
pool is authenticated before it is served: with a deployment secret (``PoolConfig.secret_file``;
an embedded pool makes one), a value carries a MAC that only holders of the secret can make, and
a forged, altered or replayed value (another block's value copied under this block's name) is a
miss, never served. Without a secret (a pool only trusted processes reach) every value still
carries an xxh3_64 of its payload, and a reader refuses one without it or whose payload does not
match: a put that lands late from memory reused meanwhile (another block's bytes under this
block's valid header) is a miss too. The checksum guards against accidents only; anyone can
compute it, so only the MAC keeps out a writer who means harm. Object names are keyed too,
``kvstrata/<keyed namespace tag>/<keyed block key>``, so a client without the secret can neither
derive a tenant's object names from the public block-key scheme nor tell from a listing of the
pool which model, tenant or prompt a name is of. With ``encrypt`` (CacheConfig's default whenever
there is a secret) the payload is encrypted (AES-GCM), so a client without the secret reads
nothing of the KV either: Mooncake lets any client read any object, and its master tells anyone
every object's name and address.

Replays. A value also says when it was written (``written_ns``, strictly increasing per
writer), under the MAC: a tier refuses a value of a key older than the newest it has read for
that key (an earlier value of the same block put back, sealed and intact, after a newer one).
A tier that has not read the newer value cannot tell: it has no record to hold the old one to.
Write times are the writers' wall clocks: a value from a host whose clock runs ahead raises the
bar for that key, and a later value from a slower clock is then refused too (a miss, not wrong KV).

Keys (HKDF-SHA256 of the secret, per namespace tag, i.e. per model, layout and tenant namespace):
``name`` (object names: HMAC-SHA256 of the block key), ``mac``, ``enc``; and one of the whole
deployment, ``tag`` (the names' middle part: HMAC-SHA256 of the namespace tag). The MAC: a one-time
Poly1305 key, HMAC-SHA256(mac key, header bytes 0..80: the key, layout, sizes, flags, a random
nonce and the write time), then Poly1305 over the payload. With encryption, AES-GCM's own tag
(over the ciphertext, with the header bytes as associated data) takes the MAC's place.

Why Poly1305. It is the fastest keyed integrity check at hand, per core, on the 2-vCPU AMD EPYC
(Zen 3: AVX2, VAES, VPCLMULQDQ, SHA-NI) development VM, cryptography 50 (OpenSSL 4.0), 32 MiB
from memory: Poly1305 5.2 GB/s; GMAC (AES-GCM with the payload as associated data) 3.7 to 4.1;
AES-GCM itself into a scratch buffer 2.4 to 3.4; keyed BLAKE3 2.6 and HMAC-SHA256 1.4 (hashlib,
SHA-NI); keyed BLAKE2b 0.6. Poly1305 holds the GIL while it runs (two threads take twice the time
of one); hashlib and BLAKE3 release it, but are 2 to 4 times slower per core, and on 2 cores, one
of them busy with the pool daemon's copy, speed per core is what counts. Non-cryptographic hashes
(xxh3 at 10 GB/s) are no MAC: anyone can forge them. Every byte read back must be checked (any
byte may have been changed by another writer), so a sealed transfer costs the pool's copy plus
one Poly1305 pass (~50 ms of CPU per 256 MiB): close to raw only with a core free for the MAC.

Version 3, little-endian::

    offset  bytes   field
    0       8       magic b"KVSPOOL\\x00"
    8       2       format version (3)
    10      2       flags: bit 0 xxh3 of the payload set (always, unsealed), bit 1 sealed (MAC),
                    bit 2 encrypted
    12      4       reserved (0)
    16      16      key
    32      8       xxh3_64 of layout.describe(): blocks of another layout are never served
    40      8       payload_bytes (= layout.block_bytes)
    48      8       xxh3_64 of the payload as stored (0 when sealed: the MAC covers it)
    56      12      nonce (random per write; 0 unless sealed)
    68      4       reserved (0)
    72      8       written_ns: when the value was written (ns since the epoch; 0: not said)
    80      16      tag: the payload's Poly1305 MAC, or AES-GCM's tag (0 unless sealed)
    96      8       xxh3_64 of bytes [0, 96): the header checks itself against accidents
    104     24      zeros
    128             payload: uint8 [num_layers, layer_bytes]
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.poly1305 import Poly1305

from kvstrata.errors import CorruptBlock
from kvstrata.index.keys import KEY_BYTES, BlockKey
from kvstrata.tiers.blockfile import xxh3_of

MAGIC = b"KVSPOOL\x00"
VERSION = 3
HEADER_BYTES = 128
CIPHER_CHUNK = 256 * 1024  # bytes encrypted or decrypted through the scratch buffer at a time (it stays in cache)
_PAYLOAD_CHECKSUM, _SEALED, _ENCRYPTED = 1, 2, 4
_BODY = struct.Struct("<8sHHI16sQQQ12sIQ16s")  # offsets 0..95 above
_SIGNED = 80  # header bytes the MAC's one-time key (or AES-GCM's associated data) covers
_CHECKSUM = struct.Struct("<Q")
assert _BODY.size == 96


@dataclass(frozen=True)
class ValueHeader:
    key: BlockKey
    layout_digest: int
    payload_bytes: int
    payload_checksum: int | None  # None: the writer did not checksum the payload
    nonce: bytes | None  # None: not sealed
    tag: bytes | None
    encrypted: bool
    written_ns: int


def layout_digest(layout_text: str) -> int:
    """The header's layout field for ``layout.describe()``."""
    return xxhash.xxh3_64_intdigest(layout_text.encode())


def encode_header(key: BlockKey, layout_digest: int, payload_bytes: int, payload_checksum: int | None,
                  written_ns: int = 0, nonce: bytes | None = None, tag: bytes | None = None,
                  encrypted: bool = False) -> bytes:
    """The 128 header bytes of a value (unsealed without ``nonce`` and ``tag``)."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {key!r}")
    flags = (_PAYLOAD_CHECKSUM if payload_checksum is not None else 0) | (_SEALED if nonce is not None else 0)
    flags |= _ENCRYPTED if encrypted else 0
    body = _BODY.pack(MAGIC, VERSION, flags, 0, key, layout_digest, payload_bytes, payload_checksum or 0,
                      nonce or bytes(12), 0, written_ns, tag or bytes(16))
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body)) + bytes(HEADER_BYTES - _BODY.size - _CHECKSUM.size)


def decode_header(head: bytes) -> ValueHeader:
    """Parse a header and check it against accidents (magic, version, its own checksum); the
    seal is :meth:`ValueSeal.open`'s to check.

    Raises:
        CorruptBlock: anything does not verify.
    """
    if len(head) < HEADER_BYTES:
        raise CorruptBlock(f"pool value header truncated: {len(head)} bytes")
    magic, version, flags, _, key, layout, payload_bytes, payload_checksum, nonce, _, written_ns, tag = _BODY.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlock(f"pool value has bad magic {magic!r}")
    if version != VERSION:
        raise CorruptBlock(f"pool value format version {version}, this build reads {VERSION}")
    (stored,) = _CHECKSUM.unpack_from(head, _BODY.size)
    if xxhash.xxh3_64_intdigest(memoryview(head)[: _BODY.size]) != stored:
        raise CorruptBlock("pool value header checksum mismatch")
    sealed = bool(flags & _SEALED)
    return ValueHeader(key, layout, payload_bytes, payload_checksum if flags & _PAYLOAD_CHECKSUM else None,
                       nonce if sealed else None, tag if sealed else None, bool(flags & _ENCRYPTED), written_ns)


class ValueSeal:
    """Makes and checks the values of one namespace: object names, headers, MACs, encryption.

    Args:
        layout_text: ``layout.describe()`` of the blocks.
        payload_bytes: bytes of one block.
        namespace_tag: the tier's namespace tag (keys are derived per namespace).
        secret: the deployment secret; None: values are not sealed (a pool of trusted
            processes only) but carry, and must carry, an xxh3_64 of their payload.
        encrypt: encrypt payloads (needs ``secret``).
    """

    def __init__(self, layout_text: str, payload_bytes: int, namespace_tag: str, secret: bytes | None,
                 encrypt: bool = False) -> None:
        if encrypt and secret is None:
            raise ValueError("pool values can be encrypted only with a deployment secret (pool secret_file)")
        self.layout_digest = layout_digest(layout_text)
        self.payload_bytes = payload_bytes
        self.namespace_tag = namespace_tag
        self.encrypt = encrypt
        self.sealed = secret is not None
        if secret is not None:
            self._name_key, self._mac_key, enc_key = (_derive(secret, namespace_tag, use) for use in (b"name", b"mac", b"enc"))
            # The names' middle part: the namespace tag keyed with a key of the deployment's (the
            # same in every namespace), so that a listing of the pool (the master's HTTP port
            # answers anyone who reaches it) does not say which model or tenant a name is of.
            tag_key = _derive(secret, "", b"tag")
            self._prefix = f"kvstrata/{hmac.new(tag_key, namespace_tag.encode(), hashlib.sha256).hexdigest()[:16]}/"
            self._aead = AESGCM(enc_key)
            self._aes = algorithms.AES(enc_key)

    def object_name(self, key: BlockKey) -> str:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"remote tier: a block key is {KEY_BYTES} bytes, got {key!r}")
        if not self.sealed:
            return f"kvstrata/{self.namespace_tag}/{key.hex()}"
        keyed = hmac.new(self._name_key, key, hashlib.sha256).hexdigest()[:32]  # not derivable without the secret
        return self._prefix + keyed

    def seal(self, key: BlockKey, parts: Sequence[np.ndarray], written_ns: int,
             into: np.ndarray | None = None) -> tuple[bytes, np.ndarray | None]:
        """The header of the payload given as ``parts`` (uint8, C-contiguous, in order), written
        at ``written_ns`` (under the seal: see the module docstring's replays), and, when
        encrypting, the ciphertext to store instead: streamed into ``into`` (uint8, as many
        bytes as the parts: a registered buffer, so that the pool takes it from there; the tag
        never reads it, see ``_stream``) or, without one, into a new array of
        the first part's shape if it is the only part, else flat; else None: the parts are
        stored as they are. A sealed value
        carries no xxh3: its MAC checks every byte already.

        Raises:
            ValueError: ``into`` of another size than the parts.
        """
        nbytes = sum(part.nbytes for part in parts)
        if not self.sealed:
            return encode_header(key, self.layout_digest, nbytes, xxh3_of(parts), written_ns), None
        nonce = os.urandom(12)
        signed = encode_header(key, self.layout_digest, nbytes, None, written_ns, nonce, bytes(16), self.encrypt)[:_SIGNED]
        ciphertext = None
        if self.encrypt:
            # Streamed into place through a cache-sized private scratch buffer (see _stream):
            # AESGCM.encrypt would return a new bytes object of the whole value (ciphertext and
            # tag), to be copied again into registered memory: measured on 32 MiB, 25 ms against
            # 3.4 ms streamed (cryptography 50).
            ciphertext = into.reshape(-1) if into is not None else np.empty(nbytes, dtype=np.uint8)
            if ciphertext.size != nbytes:
                raise ValueError(f"pool value: ciphertext buffer of {ciphertext.size} bytes for {nbytes} payload bytes")
            encryptor = Cipher(self._aes, modes.GCM(nonce)).encryptor()
            encryptor.authenticate_additional_data(signed)
            _stream(encryptor, parts, ciphertext)
            encryptor.finalize()
            tag = encryptor.tag
            if into is not None:
                ciphertext = into
            elif len(parts) == 1:
                ciphertext = ciphertext.reshape(parts[0].shape)
        else:
            mac = Poly1305(self._one_time_key(signed))
            for part in parts:
                mac.update(part)
            tag = mac.finalize()
        return encode_header(key, self.layout_digest, nbytes, None, written_ns, nonce, tag, self.encrypt), ciphertext

    def open(self, key: BlockKey, head: bytes, parts: Sequence[np.ndarray], not_before_ns: int = 0) -> ValueHeader:
        """Check a value read for ``key``: its header and, sealed, its MAC over ``parts`` (the
        payload's pieces, in order, as read); decrypted in place when encrypted. A value written
        before ``not_before_ns`` (the newest value of this key the reader has seen) is refused.
        Returns the value's header, verified.

        Raises:
            CorruptBlock: not this key's, layout's or size's, not sealed by this deployment,
                forged, altered or replayed (another key's value, or this key's older one);
                unsealed, without a payload checksum or with bytes that do not match it: the
                value must not be served.
        """
        header = decode_header(head)
        name = key.hex()[:12]
        if header.key != key:
            raise CorruptBlock(f"remote tier: object of {name} holds block {header.key.hex()[:12]}")
        if header.layout_digest != self.layout_digest:
            raise CorruptBlock(f"remote tier: block {name} was written under another layout")
        if header.payload_bytes != self.payload_bytes or sum(p.nbytes for p in parts) != self.payload_bytes:
            raise CorruptBlock(f"remote tier: block {name} has {header.payload_bytes} payload bytes")
        if self.sealed:
            self._check_seal(key, header, head, parts)
        elif header.nonce is not None:
            raise CorruptBlock(f"remote tier: block {name} is sealed with a secret this tier was not given")
        elif header.payload_checksum is None:
            raise CorruptBlock(f"remote tier: block {name} carries no payload checksum: unverifiable")
        elif xxh3_of(parts) != header.payload_checksum:
            raise CorruptBlock(f"remote tier: block {name} payload checksum mismatch")
        if header.written_ns < not_before_ns:  # checked once the seal is: the time is the writer's
            raise CorruptBlock(f"remote tier: block {name} is older than a value of it this tier has read "
                               f"(written {not_before_ns - header.written_ns} ns before): a replay")
        return header

    def _check_seal(self, key: BlockKey, header: ValueHeader, head: bytes, parts: Sequence[np.ndarray]) -> None:
        name = key.hex()[:12]
        if header.nonce is None:
            raise CorruptBlock(f"remote tier: block {name} is not sealed as this deployment seals (forged?)")
        signed = bytes(head[:_SIGNED])
        # A value is opened as it was sealed, encrypted or not: both are authenticated with the
        # deployment's keys (the flag is under the MAC, or AES-GCM's associated data), so a
        # process that encrypts reads what one that does not wrote, and the other way round.
        if header.encrypted:
            # Streamed: each piece decrypted a chunk at a time through one reused scratch buffer
            # that stays in cache, and copied back (cryptography refuses to decrypt in place;
            # AESGCM.decrypt would need the ciphertext joined, tag appended, and a new
            # plaintext: three copies and two fresh allocations of the whole value). Measured
            # on 32 MiB: 5.4 ms in chunks of 256 KiB, 10.8 ms through a scratch of the whole.
            # The pieces hold unauthenticated plaintext until finalize: a failure there raises,
            # and the caller never serves the slot.
            decryptor = Cipher(self._aes, modes.GCM(header.nonce, header.tag)).decryptor()
            decryptor.authenticate_additional_data(signed)
            for part in parts:
                flat = part.reshape(-1)
                try:
                    _stream(decryptor, [flat], flat)  # through the scratch buffer: back into the part
                except ValueError:
                    raise CorruptBlock(f"remote tier: block {name} decrypted out of step") from None
            try:
                decryptor.finalize()
            except InvalidTag:
                raise CorruptBlock(f"remote tier: block {name} fails authentication (forged or altered)") from None
            return
        mac = Poly1305(self._one_time_key(signed))
        for part in parts:
            mac.update(part)
        try:
            mac.verify(header.tag)
        except InvalidSignature:
            raise CorruptBlock(f"remote tier: block {name} fails authentication (forged or altered)") from None

    def _one_time_key(self, signed: bytes) -> bytes:
        """Poly1305's key for one value: bound to its header (key, layout, sizes, nonce)."""
        return hmac.new(self._mac_key, signed, hashlib.sha256).digest()


def _derive(secret: bytes, namespace_tag: str, use: bytes) -> bytes:
    info = b"kvstrata pool v2 " + use + b" " + namespace_tag.encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _stream(cipher, parts: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``cipher``'s output of ``parts`` (in order) into ``out`` (flat uint8, their size), a
    chunk at a time through this thread's scratch buffer (private memory, in cache), then
    copied: AES-GCM's tag is computed over the ciphertext where it is written, and ``out`` may
    be registered memory that another client of the pool can write, so each chunk is copied
    there only after the cipher has made (and hashed) it in private memory: bytes changed in
    ``out`` then fail authentication, never enter the tag."""
    scratch = _scratch(CIPHER_CHUNK + 15)  # update_into's room for a partial AES block
    at = 0
    for part in parts:
        flat = part.reshape(-1)
        for start in range(0, flat.size, CIPHER_CHUNK):
            chunk = flat[start : start + CIPHER_CHUNK]
            if cipher.update_into(chunk, scratch) != chunk.size:  # GCM is a stream: never short
                raise ValueError("pool value: the cipher fell out of step")
            out[at : at + chunk.size] = scratch[: chunk.size]
            at += chunk.size


_scratches = threading.local()  # per thread: one uint8 buffer, grown as needed


def _scratch(nbytes: int) -> np.ndarray:
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or buffer.size < nbytes:
        buffer = _scratches.buffer = np.empty(nbytes, dtype=np.uint8)
    return buffer[:nbytes]
