"""govray: governed deep-learning training on Ray.

Layers, bottom to top (a lower layer never imports a higher one)::

    errors, canonical → credentials → keys → config → policy → data → routing
      → ledger → checkpoint → harness → tracking → attest → cli
"""

__version__ = "0.1.0"
