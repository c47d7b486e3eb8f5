"""``govray signer init | serve | tls-init | agent``: the platform's signer, the one process that uses
its keys, and its agents on other nodes.

``init`` creates the platform keys in a key backend (``govray.signer.backends``: files encrypted
under a passphrase, a PKCS#11 token, a KMS plugin), never silently: existing keys are refused, and
the creation is audited in the signer's directory. ``serve`` unlocks them and answers on a Unix
socket: a run's channel seals that run's checkpoints, later steps only, over files the signer
hashes itself (``govray.signer``). The secret (the passphrase, the token's PIN) comes from
``--passphrase-file`` (e.g. a secret the deployment mounts) or is asked for; it is never an
argument or an environment variable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from govray.cli.common import console
from govray.core.keys import KeyType, SigningKey, govray_home, platform_key

app = typer.Typer(
    help="The platform's signer: the one process that uses the platform's private keys.", no_args_is_help=True
)

Directory = typer.Option(None, "--dir", help="The signer's directory (default GOVRAY_HOME/signer).")
PassphraseFile = typer.Option(
    None,
    "--passphrase-file",
    help="A file holding the keys' secret: the passphrase, or the token's user PIN (default: asked for).",
)


TlsDirectory = typer.Option(
    None,
    "--tls",
    help="The directory `govray signer tls-init` wrote (ca.pem, and this process's certificate).",
)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def signer_dir(directory: Path | None) -> Path:
    return directory if directory is not None else govray_home() / "signer"


def passphrase(path: Path | None, confirm: bool = False) -> bytes:
    """The passphrase: the file's first line, or typed (twice when a key is created)."""
    if path is not None:
        text = path.read_text().splitlines()[0] if path.read_text() else ""
    else:
        text = typer.prompt("passphrase", hide_input=True, confirmation_prompt=confirm)
    if not text:
        raise typer.BadParameter(
            "an empty passphrase would leave the key unencrypted", param_hint="--passphrase-file"
        )
    return text.encode()


@app.command("init")
def init(
    directory: Path | None = Directory,
    passphrase_file: Path | None = PassphraseFile,
    backend: str = typer.Option(
        "file", "--backend", help="Where the keys are held: file, pkcs11, a plugin's name or MODULE:CLASS."
    ),
    option: list[str] = typer.Option(
        [], "--option", help="A backend option KEY=VALUE (repeatable; pkcs11: module, token, label)."
    ),
) -> None:
    """Create the platform keys (Ed25519 for checkpoints and attestations, ECDSA for model
    signatures) in a key backend, once, audited in the signer's directory; print their key ids."""
    from govray.signer.backends import backend_named, create_keys

    root = signer_dir(directory)
    options = dict(_option(entry) for entry in option)
    needed = getattr(backend_named(backend), "needs_secret", True)
    secret = passphrase(passphrase_file, confirm=True) if needed else None
    keys, _ = create_keys(root, backend, options, secret)
    for key in (keys.platform, keys.model):
        if key is not None:
            held = "in the token" if backend == "pkcs11" else f"in {backend}"
            console.print(
                f"platform {key.public_key.keytype.value} key {key.keyid}: held {held}, "
                f"public half in {root}",
                highlight=False,
            )


def _option(entry: str) -> tuple[str, str]:
    key, equals, value = entry.partition("=")
    if not equals or not key:
        raise typer.BadParameter(f"{entry!r}: an option is KEY=VALUE", param_hint="--option")
    return key, value


@app.command("serve")
def serve(
    directory: Path | None = Directory,
    socket_path: Path | None = typer.Option(
        None, "--socket", help="The Unix socket (default DIR/signer.sock)."
    ),
    passphrase_file: Path | None = PassphraseFile,
    open_uid: list[int] = typer.Option(
        [], "--open-uid", help="An OS user who may open runs (repeatable; default: the signer's own)."
    ),
    dev: bool = typer.Option(
        False,
        "--dev",
        help="Development: this machine's platform key (GOVRAY_HOME/keys, unencrypted) instead of "
        "DIR's encrypted one; what a launch starts when the settings name no signer.",
    ),
    idle_exit: float | None = typer.Option(
        None, "--idle-exit", min=1.0, help="Exit after this many seconds without a connection."
    ),
    listen: str | None = typer.Option(
        None,
        "--listen",
        help="HOST:PORT: also answer other nodes' signer agents there, over mutual TLS (--tls).",
    ),
    tls: Path | None = TlsDirectory,
) -> None:
    """Unlock the platform keys and seal runs' checkpoints on a Unix socket until stopped."""
    from govray.signer.server import SignerServer
    from govray.signer.service import Signer

    root = signer_dir(directory)
    model_key: SigningKey | None
    if dev:
        key, root = platform_key(), govray_home() / "signer-dev"
        model_key = platform_key(keytype=KeyType.ECDSA)
    else:
        from govray.signer.backends import needs_secret, unlock_keys

        secret = passphrase(passphrase_file) if needs_secret(root) else None
        keys = unlock_keys(root, secret)  # (no model key: a signer made before it had one)
        key, model_key = keys.platform, keys.model
    path = socket_path if socket_path is not None else root / "signer.sock"
    opens = frozenset(open_uid) if open_uid else None
    signal.signal(signal.SIGTERM, _interrupted)  # stopped: the socket file goes as on Ctrl-C
    home = govray_home().resolve() if dev else None  # a development signer ends with its GOVRAY_HOME
    pid_file = path.with_suffix(".pid")
    if dev:  # (before the socket answers: whoever started it finds its pid once it does)
        pid_file.write_text(str(os.getpid()))
    try:
        with SignerServer(Signer(key, root / "state", model_key), path, opens, idle_exit, home) as server:
            console.print(f"signer: platform key {key.keyid} on {path}", highlight=False)
            # (Ctrl-C: the socket file goes on the way out)
            with _agents_listener(server, listen, tls), contextlib.suppress(KeyboardInterrupt):
                server.serve_forever()
    finally:
        if dev and pid_file.is_file() and pid_file.read_text() == str(os.getpid()):
            pid_file.unlink()


@contextlib.contextmanager
def _agents_listener(server: Any, listen: str | None, tls: Path | None) -> Iterator[None]:
    """``server`` also answering other nodes' signer agents on ``listen`` (mutual TLS), meanwhile."""
    if listen is None:
        yield
        return
    if tls is None:
        raise typer.BadParameter("--listen needs the certificates of --tls", param_hint="--tls")
    from govray.signer.tls import TlsListener, parse_address

    listener = TlsListener(server, parse_address(listen), tls)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    console.print(f"signer: agents over TLS on {listen} (port {listener.port})", highlight=False)
    try:
        yield
    finally:
        listener.shutdown()
        listener.server_close()


@app.command("tls-init")
def tls_init(
    tls: Path = typer.Argument(..., help="The directory to write the CA and the two certificates to."),
    host: list[str] = typer.Option(
        ..., "--host", help="A name or address agents reach the signer by (repeatable)."
    ),
) -> None:
    """Create the certificates the signer and its nodes' agents authenticate each other with.

    DIR gets a certificate authority of this deployment's own (ca.pem, ca.key), the signer's
    certificate for the hosts named (signer.pem, signer.key) and the agents' (agent.pem,
    agent.key); private keys 0600. Give the signer's node ca.pem and signer.*, every other node
    ca.pem and agent.*; keep ca.key off the nodes.
    """
    from govray.signer.tls import make_certificates

    for path in make_certificates(tls, host):
        console.print(f"wrote {path}", highlight=False)


@app.command("agent")
def agent(
    head: str = typer.Option(
        ..., "--head", help="HOST:PORT of the signer that holds the keys (its --listen)."
    ),
    tls: Path = typer.Option(..., "--tls", help="The directory holding ca.pem, agent.pem and agent.key."),
    socket_path: Path = typer.Option(
        ..., "--socket", help="This node's Unix socket (the settings' signer.socket)."
    ),
    open_uid: list[int] = typer.Option(
        [], "--open-uid", help="An OS user who may open runs (repeatable; default: the agent's own)."
    ),
) -> None:
    """Serve this node's signer socket without the platform's keys: checkpoints read here, signed there.

    A node's rank 0 seals through it: it hashes and checks the folder on this node (its run spec,
    its ledger, its base) and has the signer at --head sign what it read, over mutual TLS.
    """
    from govray.core.errors import SignatureError
    from govray.core.signer_wire import WIRE_REVISION
    from govray.signer.agent import AgentSigner
    from govray.signer.server import SignerServer
    from govray.signer.tls import HeadLink

    link = HeadLink(head, tls)
    offered = link.ask(
        {"op": "offers"}
    )  # (it answers and takes this agent's certificate, or this stops here)
    if "seal_hashed" not in offered.get("ops", ()) or int(offered.get("wire", 1)) < WIRE_REVISION:
        raise SignatureError(f"the signer at {head} runs an older govray than this agent: upgrade it first")
    opens = frozenset(open_uid) if open_uid else None
    signal.signal(signal.SIGTERM, _interrupted)
    with SignerServer(
        AgentSigner(link, log=lambda line: console.print(line, highlight=False)), socket_path, opens
    ) as server:
        console.print(f"signer agent: {socket_path}, signed by {head}", highlight=False)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
