"""The platform's signer: the one process that uses the platform's private keys.

It runs the installed govray, imports no trial code (nor torch, nor Ray) and is reached over a Unix
socket in canonical JSON (``wire``), never pickle. A run's channel is a capability for that run
(``service.Signer``): it seals checkpoints of that run's directory only, each at a later step than
the last it sealed, over files it hashes itself. ``govray signer serve`` runs it.
"""
