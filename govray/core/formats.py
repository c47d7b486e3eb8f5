"""Every file govray writes and reads back names its format; a reader refuses any other.

A format's name carries its version (``govray-run-v1``). A reader given another one refuses it
with both names, never guessing: a file from a newer govray, or one that is not govray's at all.
README.md, "Data formats", lists them and how a later version will be read.

Example::

    format: str = RUN_SPEC_FORMAT

    @field_validator("format")
    @classmethod
    def _known(cls, found: str) -> str:
        return known_format(found, RUN_SPEC_FORMAT, "run.json")
"""

from __future__ import annotations

RUN_SPEC_FORMAT = "govray-run-v1"  # run.json: everything a worker needs (``train.runspec.RunSpec``)
REPRODUCIBILITY_FORMAT = "govray-reproducibility-v1"  # a trial's reproducibility record


def known_format(found: object, expected: str, what: str) -> str:
    """``found`` if it is ``expected``; else a ``ValueError`` naming both (pydantic reports it as
    a validation error of the file being read)."""
    if found != expected:
        raise ValueError(
            f"{what} is in format {found!r}; this govray reads {expected!r} (a file from another "
            "govray version, or not govray's: README, 'Data formats')"
        )
    return expected
