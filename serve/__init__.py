"""The Ray Serve + FastAPI app that answers lineage and attestation questions over HTTP, reading the
tracking store read-only: ``serve.app`` (the deployment; ``serve run serve.app:app`` or
``govray serve``), ``serve.api`` (reads), ``serve.verify`` (``POST /api/verify``), ``serve.writes``
(registry writes behind a bearer token) and ``serve.cache``; its settings are
``govray.config.serve``'s. ``govray serve`` finds ``serve.app:start`` through the ``govray.apps``
entry point (pyproject.toml): govray never imports this package."""
