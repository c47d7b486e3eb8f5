"""Search strategies: each turns an experiment's ``searcher:`` section into a Ray Tune plan.

govray finds them through the ``govray.searchers`` entry points (pyproject.toml), never by import:
``single``, ``grid``, ``random``, ``asha``, ``adaptive_asha``, ``pbt``, ``bayesian``. A strategy is
one module holding ``CONFIG``, the model of its section (a ``govray.config.searcher.SearcherConfig``
subclass whose ``name`` is the strategy's), and ``plan(config, max_steps) ->
govray.config.searcher.TunePlan``; its entry point names the ``plan``, and the experiment's loader
validates the section with the ``CONFIG`` of the same module. Validating a section must load
neither Ray nor torch: a strategy imports Ray Tune inside its ``plan``.
"""
