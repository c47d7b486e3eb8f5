"""Canaries inserted into a corpus, and the never-trained candidates they are ranked among.

A corpus names its canary set in the data config (``canaries: {file: canaries.json}``); the
training loop then measures each trained canary's exposure at every validation. A canary
(Carlini et al., "The Secret Sharer", 2019) is the template with each slot filled by a random
symbol, e.g. ``my secret code is 7 3 9 1 5 2``, inserted ``repeats`` times as rows of its
own. Exposure ranks a canary's loss among reference candidates drawn from the same template and
randomness space: every slot a uniform draw from ``alphabet``, excluding the inserted canaries,
so no candidate was ever trained on. The file is a :class:`CanarySet` as JSON.

Example::

    canaries = CanarySet.load(DATA / "canaries.json")
    references = canaries.candidates(1000, random.Random(0))       # never-trained texts
    nll = trial.sequence_scores(model, [c.text for c in canaries.canaries] + references)
"""

from __future__ import annotations

import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

SLOT = "{}"


class Canary(BaseModel):
    """One inserted canary: its text, its secret, and the corpus rows (0-based) that hold it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    secret: str
    rows: tuple[int, ...]


class CanarySet(BaseModel):
    """The canaries of one corpus and the space their secrets were drawn from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus_id: str
    file: str
    template: str  # ``{}`` marks a slot
    alphabet: str = Field(min_length=2)
    repeats: int = Field(ge=1)
    candidates_rule: str = (
        "same template; every slot a uniform draw from the alphabet; the inserted canaries excluded"
    )
    canaries: tuple[Canary, ...]

    @model_validator(mode="after")
    def _canaries_fill_the_template(self) -> CanarySet:
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"alphabet '{self.alphabet}' repeats a symbol")
        if (
            self.slots == 0
            or self.template.replace(SLOT, "").count("{")
            or self.template.replace(SLOT, "").count("}")
        ):
            raise ValueError(f"template '{self.template}' needs at least one '{{}}' slot and no other braces")
        for canary in self.canaries:
            if any(row < 0 for row in canary.rows):
                raise ValueError(f"canary '{canary.text}' lists a negative row")
            if self.fill(canary.secret) != canary.text:
                raise ValueError(f"canary '{canary.text}' is not the template filled with '{canary.secret}'")
        return self

    @property
    def slots(self) -> int:
        return self.template.count(SLOT)

    @property
    def space_size(self) -> int:
        """How many distinct secrets the template admits (canaries included)."""
        return len(self.alphabet) ** self.slots

    def fill(self, secret: str) -> str:
        """The template with one symbol of ``secret`` per slot."""
        if len(secret) != self.slots or any(symbol not in self.alphabet for symbol in secret):
            raise ValueError(f"secret '{secret}' needs {self.slots} symbols from '{self.alphabet}'")
        return self.template.format(*secret)

    def draw_secret(self, rng: random.Random) -> str:
        return "".join(rng.choice(self.alphabet) for _ in range(self.slots))

    def candidates(self, count: int, rng: random.Random) -> list[str]:
        """``count`` distinct never-trained candidate texts (no inserted canary among them)."""
        inserted = {canary.secret for canary in self.canaries}
        if count > self.space_size - len(inserted):
            raise ValueError(f"the template admits only {self.space_size - len(inserted)} candidates")
        secrets: dict[str, None] = {}  # insertion-ordered set: the same rng gives the same list
        while len(secrets) < count:
            secret = self.draw_secret(rng)
            if secret not in inserted:
                secrets[secret] = None
        return [self.fill(secret) for secret in secrets]

    @classmethod
    def load(cls, path: Path) -> CanarySet:
        return cls.model_validate_json(path.read_text())

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


class CanaryProbe(BaseModel):
    """What the training loop needs to measure one corpus's canary exposure."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    canaries: CanarySet
    references: int = Field(ge=1)  # never-trained candidates each canary is ranked among
