"""The experiment file (``experiment.py``), the trial's typed training settings (``training.py``)
and the lineage server's settings (``serve.py``)."""
