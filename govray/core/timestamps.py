"""Trusted time on signatures: RFC 3161 timestamps from a time-stamping authority (TSA).

A signature alone says who signed, not when: its ``signed_at`` is the signer's own word. A
timestamp token is the TSA's signature over the signature's sha256 and the time it saw it, so
when a key is revoked as of a moment (``Revocation.revoked_at``: it leaked then), signatures
stamped before that moment stay valid and later ones are refused; a signature without a trusted
stamp is refused once its key is revoked at all.

``stamp(signature, url)`` asks the TSA at ``url`` (the settings' ``timestamping.url``) over RFC
3161's HTTP transport and returns the DER ``TimeStampResponse``, checked to answer this request
(its nonce, the signature's imprint). ``stamped_at(response, signature, roots)`` verifies it
against the TSA root certificates a trust file lists (``TrustConfig.timestamp_authorities``) and
returns the stamped time.

Example::

    token = stamp(raw_signature, "http://tsa.internal/")           # the signer, when it signs
    when = stamped_at(token, raw_signature, trust.timestamp_authorities)   # any verifier
"""

from __future__ import annotations

import datetime as dt
import urllib.error
import urllib.request

from cryptography import x509
from rfc3161_client import (
    TimestampRequestBuilder,
    VerificationError,
    VerifierBuilder,
    decode_timestamp_response,
)

from govray.core.errors import SignatureError

TIMEOUT_S = 30.0
QUERY_TYPE = "application/timestamp-query"
REPLY_TYPE = "application/timestamp-reply"


def stamp(signature: bytes, url: str, timeout: float = TIMEOUT_S) -> bytes:
    """A timestamp of ``signature`` from the TSA at ``url`` (DER ``TimeStampResponse``);
    ``SignatureError`` when it does not answer, or answers something other than this request."""
    request = TimestampRequestBuilder().data(signature).nonce(nonce=True).build()
    asked = urllib.request.Request(
        url, data=request.as_bytes(), headers={"Content-Type": QUERY_TYPE, "Accept": REPLY_TYPE}
    )
    try:
        with urllib.request.urlopen(asked, timeout=timeout) as answer:
            body = answer.read()
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        raise SignatureError(f"the time-stamping authority at {url} did not answer: {error}") from None
    try:
        response = decode_timestamp_response(body)
    except ValueError as error:
        raise SignatureError(f"the time-stamping authority at {url} answered no timestamp: {error}") from None
    if response.tst_info.nonce != request.nonce:
        raise SignatureError(f"the time-stamping authority at {url} answered another request (nonce)")
    if response.tst_info.message_imprint.message != request.message_imprint.message:
        raise SignatureError(f"the time-stamping authority at {url} stamped other bytes")
    return response.as_bytes()


def stamped_at(token: bytes, signature: bytes, roots: list[str]) -> dt.datetime:
    """When the TSA stamped ``signature``, as its token ``token`` says, after checking the token
    (its signature chains to one of the PEM ``roots``, by a certificate for time stamping; it
    covers exactly ``signature``); ``SignatureError`` saying why not."""
    if not roots:
        raise SignatureError("it is stamped, but the trust lists no time-stamping authority to check it with")
    try:
        response = decode_timestamp_response(token)
    except ValueError as error:
        raise SignatureError(f"its timestamp is unreadable: {error}") from None
    problems = []
    for pem in roots:
        try:
            root = x509.load_pem_x509_certificate(pem.encode())
            VerifierBuilder().add_root_certificate(root).build().verify_message(response, signature)
        except (VerificationError, ValueError) as error:
            problems.append(str(error))
            continue
        moment = response.tst_info.gen_time
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    raise SignatureError(f"its timestamp does not verify under a trusted authority ({'; '.join(problems)})")
