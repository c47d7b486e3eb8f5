"""The Ray Serve + FastAPI app that answers lineage and attestation questions over HTTP, reading the
tracking store read-only: ``serve.app`` (the deployment; ``serve run serve.app:app`` or
``govray serve``), ``serve.api`` (reads), ``serve.verify`` (``POST /api/verify``), ``serve.writes``
(registry writes behind a bearer token), ``serve.settings`` and ``serve.cache``."""
