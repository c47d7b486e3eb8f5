"""A node's signer agent: the platform's signer on a node without its keys (``govray signer
agent``).

It serves the node's Unix socket as the key-holding signer serves its own (the same server, the
same OS-user gate: ``govray.signer.server``) and reads that node's checkpoint folders as a seal
reads them — every file hashed, its state's step, its run spec the one the run was launched with,
its ledger recomputed, its frozen base hashed in the run's base store — then sends what it read
over mutual TLS (``govray.signer.tls``) to the key-holding signer, which checks the capability,
the run spec by digest and the steps already sealed (whose standing on this node the agent
reports), signs the manifest and records it. Opening and closing a run are forwarded as they
are. What needs the keys' own node — a search's Tune state, attestations, derived versions — is
refused here, naming where to ask.

Example::

    agent = AgentSigner(HeadLink("10.0.0.5:7071", Path("/etc/govray/tls")))
    with SignerServer(agent, Path("/run/govray-signer/signer.sock")) as server:
        server.serve_forever()
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from govray.core.dsse import Envelope
from govray.core.errors import SignatureError
from govray.core.settings import operator_trust
from govray.signer.records import checkpoint_folder, folder_check, stands_in
from govray.signer.tls import HeadLink
from govray.train.checkpoints.ledger_check import LedgerCheck
from govray.train.checkpoints.sealing import HashedFolder, Sealed, base_store_of, hash_folder

if TYPE_CHECKING:
    from govray.provenance.attest import SignedAttestation


class AgentSigner:
    """The signer ops of a node without the platform's keys, through ``head`` (the key-holding
    signer's TLS link). ``check_ledgers``: recompute each checkpoint's ledger here (always, but in
    unit tests whose folders hold no training state)."""

    def __init__(
        self, head: HeadLink, *, check_ledgers: bool = True, log: Callable[[str], None] | None = None
    ) -> None:
        self.head, self.log = head, log
        self._ledgers = LedgerCheck(operator_trust) if check_ledgers else None

    def open_run(self, run_dir: str, run_spec: str | None = None) -> tuple[str, int]:
        answer = self.head.ask({"op": "open_run", "run_dir": run_dir, "run_spec": run_spec})
        return str(answer["capability"]), int(answer["after_step"])

    def close_run(self, run_dir: str) -> None:
        self.head.ask({"op": "close_run", "run_dir": run_dir})

    def seal(self, capability: str, folder: str, step: int, referenced: dict[str, str]) -> Sealed:
        """Read checkpoint ``folder`` here, as the key-holding signer would, and have it signed."""
        known = self.head.ask({"op": "sealed_after", "capability": capability, "step": step})
        run_dir = Path(str(known["run_dir"]))
        later = {int(s): (str(d) if d is not None else None) for s, d in dict(known["later"]).items()}
        standing = {s: stands_in(run_dir, s, digest) for s, digest in later.items()}
        check = folder_check(known["run_spec"], self._ledgers)
        directory = checkpoint_folder(run_dir, Path(folder), step)
        hashed = hash_folder(directory, step, referenced, base_store_of(run_dir), check)
        sealed = self._signed(capability, step, hashed, standing, later)
        if self.log is not None:
            self.log(f"sealed {directory} (step {step}) by {self.head.address}")
        return sealed

    def _signed(
        self,
        capability: str,
        step: int,
        hashed: HashedFolder,
        standing: Mapping[int, bool],
        checked: Mapping[int, str | None],
    ) -> Sealed:
        answer = self.head.ask(
            {
                "op": "seal_hashed",
                "capability": capability,
                "step": step,
                "files": hashed.files,
                "blocks": {name: found.model_dump(mode="json") for name, found in hashed.blocks.items()},
                "refers": hashed.refers,
                "standing": {str(s): stood for s, stood in standing.items()},
                "checked": {str(s): digest for s, digest in checked.items()},
            }
        )
        return Sealed(base64.b64decode(answer["manifest"]), Envelope.model_validate(answer["envelope"]))

    def seal_state(self, capability: str, folder: str, sequence: int) -> Envelope:
        _elsewhere("a search's Tune state")

    def attest(
        self, checkpoint: str, recorded_manifest: str | None = None, model_signature: bool = False
    ) -> SignedAttestation:
        _elsewhere("an attestation")

    def derive(self, source: str, adapter: str, directory: str, source_uri: str, envelope: str) -> Sealed:
        _elsewhere("a derived model version")

    def sealed_after(self, capability: str, step: int) -> tuple[str, str | None, dict[int, str | None]]:
        _elsewhere("an agent's question")

    def seal_hashed(
        self,
        capability: str,
        step: int,
        hashed: HashedFolder,
        standing: Mapping[int, tuple[str | None, bool]],
    ) -> Sealed:
        _elsewhere("an agent's seal")


def _elsewhere(what: str) -> NoReturn:
    raise SignatureError(
        f"this node's signer is an agent without the platform's keys: {what} is made by the signer "
        "that holds them (ask it on its own node)"
    )
