"""The import path trials written before the layered tree used (``govray.harness.trial``).

Trial code recorded in a run's code snapshot is replayed and resumed byte for byte, so that path
keeps importing; new trials import ``from govray import Trial, Batch``.
"""
