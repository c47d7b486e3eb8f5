"""govray: governed deep-learning training on Ray.

Layers, bottom to top (a lower layer never imports a higher one)::

    errors, canonical, documents, runtime → credentials → keys → dsse → config → policy
      → data → schedule → routing → adapters → allreduce → ledger → checkpoint
      → harness, reproducibility → tracking → gc → preflight → runner → replay → cli

(``tests/test_layering.py`` enforces it.)
"""

__version__ = "0.1.0"
