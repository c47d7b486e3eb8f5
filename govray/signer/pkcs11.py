"""The signer's keys inside a PKCS#11 token: generated there, used there, never read.

The interface every HSM and most cloud KMSs expose (CloudHSM, Cloud KMS's and Azure's PKCS#11
libraries); tested against SoftHSM2. Options (``govray signer init --backend pkcs11 --option
KEY=VALUE``, kept in ``backend.yaml``):

- ``module``: the token's PKCS#11 library (e.g. ``/usr/lib/softhsm/libsofthsm2.so``);
- ``token``: the token's label;
- ``label`` (default ``govray-platform``): the Ed25519 key's label; the ECDSA key's is
  ``LABEL-ecdsa``.

The secret is the token's user PIN. Both keys are made with ``CKA_SENSITIVE`` true and
``CKA_EXTRACTABLE`` false: the token refuses to export them, even wrapped. Ed25519 signs with
``CKM_EDDSA``; ECDSA P-256 with ``CKM_ECDSA`` over the SHA-256 digest computed here (the
mechanism every token has), its raw ``r || s`` encoded in DER as ``cryptography`` answers. One
session per key pair, its operations one at a time (a PKCS#11 session is not for concurrent use).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, KeyType, SigningKey
from govray.signer.held_keys import HeldKeys

DEFAULT_LABEL = "govray-platform"
ED25519_OID = "1.3.101.112"  # RFC 8410's id-Ed25519: the EC_PARAMS of an Edwards-curve key
OPTIONS = {"module", "token", "label"}


class TokenKey:
    """One private key in the token (a :class:`govray.core.keys.HeldKey`)."""

    def __init__(self, session: Any, private: Any, public: Any, keytype: KeyType, lock: threading.Lock):
        import pkcs11
        from asn1crypto.core import OctetString

        self._session, self._private, self._lock, self._keytype = session, private, lock, keytype
        self._mechanism = pkcs11.Mechanism.EDDSA if keytype == KeyType.ED25519 else pkcs11.Mechanism.ECDSA
        point = OctetString.load(bytes(public[pkcs11.Attribute.EC_POINT])).native  # (DER-wrapped)
        self._public: Ed25519PublicKey | ec.EllipticCurvePublicKey = (
            Ed25519PublicKey.from_public_bytes(point)
            if keytype == KeyType.ED25519
            else ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
        )

    def public_key(self) -> Ed25519PublicKey | ec.EllipticCurvePublicKey:
        return self._public

    def sign(self, data: bytes) -> bytes:
        import pkcs11

        message = data if self._keytype == KeyType.ED25519 else hashlib.sha256(data).digest()
        try:
            with self._lock:
                signature = bytes(self._private.sign(message, mechanism=self._mechanism))
        except pkcs11.PKCS11Error as error:
            raise SignatureError(f"the PKCS#11 token refused to sign: {error!r}") from None
        if self._keytype == KeyType.ED25519:
            return signature
        half = len(signature) // 2
        return encode_dss_signature(int.from_bytes(signature[:half]), int.from_bytes(signature[half:]))


class Pkcs11Backend:
    """``pkcs11``: both keys generated in the token named by the options (see the module)."""

    needs_secret = True

    def create(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        import pkcs11
        from pkcs11.util.ec import encode_named_curve_parameters

        session, label = self._session(options, secret, write=True)
        for name in _labels(label).values():
            if list(session.get_objects({pkcs11.Attribute.LABEL: name})):
                raise SignatureError(
                    f"the token holds a key labelled {name!r} already: choose another --option label"
                )
        curves = {
            KeyType.ED25519: (pkcs11.KeyType.EC_EDWARDS, ED25519_OID),
            KeyType.ECDSA: (pkcs11.KeyType.EC, "secp256r1"),
        }
        for number, (keytype, name) in enumerate(_labels(label).items(), start=1):
            token_type, curve = curves[keytype]
            parameters = session.create_domain_parameters(
                token_type, {pkcs11.Attribute.EC_PARAMS: encode_named_curve_parameters(curve)}, local=True
            )
            parameters.generate_keypair(
                store=True,
                label=name,
                id=f"{label}-{number}".encode(),
                private_template={
                    pkcs11.Attribute.SENSITIVE: True,
                    pkcs11.Attribute.EXTRACTABLE: False,
                    pkcs11.Attribute.PRIVATE: True,
                    pkcs11.Attribute.SIGN: True,
                },
            )
        session.close()
        return self.unlock(directory, options, secret)

    def unlock(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        import pkcs11

        session, label = self._session(options, secret, write=False)
        lock = threading.Lock()
        keys: dict[KeyType, SigningKey] = {}
        for keytype, name in _labels(label).items():
            try:
                private = session.get_key(object_class=pkcs11.ObjectClass.PRIVATE_KEY, label=name)
                public = session.get_key(object_class=pkcs11.ObjectClass.PUBLIC_KEY, label=name)
            except (pkcs11.NoSuchKey, pkcs11.MultipleObjectsReturned) as error:
                raise SignatureError(
                    f"the token has no single key pair labelled {name!r} ({error!r})"
                ) from None
            if private[pkcs11.Attribute.EXTRACTABLE] or not private[pkcs11.Attribute.SENSITIVE]:
                raise SignatureError(f"the token's key {name!r} is extractable: not a key the signer uses")
            keys[keytype] = SigningKey(TokenKey(session, private, public, keytype, lock), KeyRole.PLATFORM)
        return HeldKeys(keys[KeyType.ED25519], keys[KeyType.ECDSA])

    @staticmethod
    def _session(options: Mapping[str, str], secret: bytes | None, write: bool) -> tuple[Any, str]:
        import pkcs11

        if unknown := set(options) - OPTIONS:
            raise SignatureError(
                f"the pkcs11 backend has no option {', '.join(sorted(unknown))} ({sorted(OPTIONS)})"
            )
        if "module" not in options or "token" not in options:
            raise SignatureError("the pkcs11 backend needs --option module=LIBRARY and --option token=LABEL")
        try:
            library = pkcs11.lib(options["module"])
            token = library.get_token(token_label=options["token"])
            session = token.open(user_pin=(secret or b"").decode(), rw=write)
        except (pkcs11.PKCS11Error, RuntimeError) as error:  # (RuntimeError: a library that does not load)
            raise SignatureError(
                f"cannot open PKCS#11 token {options['token']!r} of {options['module']}: {error!r}"
            ) from None
        return session, options.get("label", DEFAULT_LABEL)


def _labels(label: str) -> dict[KeyType, str]:
    return {KeyType.ED25519: label, KeyType.ECDSA: f"{label}-ecdsa"}
