"""``govray signer init | serve``: the platform's signer, the one process that uses its keys.

``init`` creates the platform key, encrypted under a passphrase, in the signer's directory (never
silently: an existing key is refused). ``serve`` unlocks it and answers on a Unix socket: a run's
channel seals that run's checkpoints, later steps only, over files the signer hashes itself
(``govray.signer``). The passphrase comes from ``--passphrase-file`` (e.g. a secret the deployment
mounts) or is asked for; it is never an argument or an environment variable.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import typer

from govray.cli.common import console
from govray.core.keys import KeyRole, KeyType, SigningKey, govray_home, platform_key

app = typer.Typer(
    help="The platform's signer: the one process that uses the platform's private keys.", no_args_is_help=True
)

KEY_NAME = "platform"  # DIR/platform.key (encrypted), DIR/platform.pub
MODEL_KEY_NAME = "platform-ecdsa"  # the model-signing key (ECDSA P-256), encrypted under the same passphrase
Directory = typer.Option(None, "--dir", help="The signer's directory (default GOVRAY_HOME/signer).")
PassphraseFile = typer.Option(
    None, "--passphrase-file", help="A file holding the key's passphrase (default: asked for)."
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
def init(directory: Path | None = Directory, passphrase_file: Path | None = PassphraseFile) -> None:
    """Create the platform keys (Ed25519 for checkpoints and attestations, ECDSA for model
    signatures), encrypted under one passphrase, in the signer's directory; print their key ids."""
    root = signer_dir(directory)
    secret = passphrase(passphrase_file, confirm=True)
    for name, keytype in ((KEY_NAME, KeyType.ED25519), (MODEL_KEY_NAME, KeyType.ECDSA)):
        key = SigningKey.generate(KeyRole.PLATFORM, keytype)
        private, public = key.save(root / name, passphrase=secret)
        console.print(
            f"platform {keytype.value} key {key.keyid}: {private} (encrypted), public half {public}",
            highlight=False,
        )


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
) -> None:
    """Unlock the platform key and seal runs' checkpoints on a Unix socket until stopped."""
    from govray.signer.server import SignerServer
    from govray.signer.service import Signer

    root = signer_dir(directory)
    model_key: SigningKey | None
    if dev:
        key, root = platform_key(), govray_home() / "signer-dev"
        model_key = platform_key(keytype=KeyType.ECDSA)
    else:
        secret = passphrase(passphrase_file)
        key = SigningKey.load(root / f"{KEY_NAME}.key", secret)
        held = root / f"{MODEL_KEY_NAME}.key"  # (a signer made before it had one: no model signatures)
        model_key = SigningKey.load(held, secret) if held.is_file() else None
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
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the socket file is removed on the way out
                server.serve_forever()
    finally:
        if dev and pid_file.is_file() and pid_file.read_text() == str(os.getpid()):
            pid_file.unlink()
