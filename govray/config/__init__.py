"""The experiment file (``experiment.py``) and the trial's typed training settings (``training.py``)."""
