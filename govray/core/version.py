"""govray's own version, for the documents it writes (BOMs, training-content summaries) and the
package (``govray.__version__``). A module of the bottom layer, so that every layer can name the
version without importing the package root, which sits above them all."""

from __future__ import annotations

GOVRAY_VERSION = "0.1.0"  # equal to pyproject.toml's version (tests/test_layering.py checks it)
