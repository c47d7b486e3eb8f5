"""Search strategies as Ray Tune configurations, one module per strategy (grid, random, ASHA, PBT,
Bayesian), and the memorization-penalized objective. The experiment file's ``searcher`` section is
already validated by ``govray.config``; the strategies arrive with the search issue."""
