"""Search strategies: each turns an experiment's ``searcher:`` section into a Ray Tune plan.

govray finds them through the ``govray.searchers`` entry points (pyproject.toml), never by import:
``single``, ``grid``, ``random``, ``asha``, ``pbt``, ``bayesian``. A strategy is
``plan(config, max_steps) -> govray.platform.search.TunePlan``.
"""
