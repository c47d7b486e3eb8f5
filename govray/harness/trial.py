"""``govray.harness.trial``, as recorded trial code imports it: the same objects as
:mod:`govray.train.trial` (not copies), so a recorded trial subclasses the one ``Trial``."""

from govray.train.trial import Batch, ProbeHooks, Trial

__all__ = ["Batch", "ProbeHooks", "Trial"]
