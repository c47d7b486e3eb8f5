"""The platform's key out of the trial's reach where the deployment separates OS users (issue 49):
the signer (``govray signer serve``, its keys encrypted under a passphrase in a home only it may
enter) runs as one unprivileged OS user, the Ray node and so every worker as another, the driver as
the operator (root here). A 2-worker run of the key-searching trial (``tests/helpers/
key_search_trial.py``: every file it can read below ``/tmp`` and its working directory, every
readable process's environment and command line, its stack) finds neither the key, in any form,
nor its passphrase, while every checkpoint the run wrote is sealed by that key. Root would read
everything: the search that counts is the workers', as their own user.

Creating the two OS users needs root (CI runs as root; elsewhere the test is skipped, saying so).
The interpreter and the repository must be reachable by the workers' user: each directory above
them that lacks it is given ``o+x`` (traverse, not list) for the test and set back after. The
driver and the Ray node run with umask 0 so both users write the storage (a deployment would use a
shared group); the signer's home stays 0700 and its socket 0660, the workers in its group.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govray.core.keys import SigningKey, TrustConfig, load_trust, save_trust
from govray.train.checkpoints.files import find_checkpoints, verify_checkpoint
from tests.helpers.builders import REPO
from tests.helpers.key_search_trial import key_search_example
from tests.helpers.local_ray import LocalRayCluster, OsUser

pytestmark = pytest.mark.cluster

SIGNER_USER, WORKER_USER = "govray-t-signer", "govray-t-worker"
PASSPHRASE = "a passphrase the workers must never see"


def _user(name: str) -> pwd.struct_passwd:
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True
        )
    return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[pwd.struct_passwd, pwd.struct_passwd]]:
    """The signer's and the workers' OS users (created once; they stay, unprivileged and
    without a login), with the interpreter and the repository reachable for the test."""
    if os.geteuid() != 0:
        pytest.skip("creating the signer's and the workers' OS users needs root (CI runs as root)")
    signer, worker = _user(SIGNER_USER), _user(WORKER_USER)
    changed: dict[Path, int] = {}
    for target in (Path(sys.prefix).resolve(), REPO.resolve()):
        for directory in (target, *target.parents):
            mode = stat.S_IMODE(directory.stat().st_mode)
            if not mode & stat.S_IXOTH and directory not in changed:
                changed[directory] = mode
                directory.chmod(mode | stat.S_IXOTH)
    try:
        yield signer, worker
    finally:
        for directory, mode in changed.items():
            directory.chmod(mode)


def _owned_dir(prefix: str, owner: pwd.struct_passwd, mode: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chown(path, owner.pw_uid, owner.pw_gid)
    path.chmod(mode)
    return path


@pytest.fixture
def signer(users: tuple[pwd.struct_passwd, pwd.struct_passwd]) -> Iterator[tuple[Path, SigningKey, Path]]:
    """``govray signer serve`` as the signer's user: its keys made by ``govray signer init`` in
    its home (0700), its socket 0660 in a directory its group may enter. Yields (socket, its
    platform key — loaded here, as root, only to know what to search for —, its home)."""
    owner = users[0]
    home = _owned_dir("gk-signer-", owner, 0o700)
    sockets = _owned_dir("gk-sock-", owner, 0o750)
    secret = home / "passphrase"
    secret.write_text(PASSPHRASE + "\n")
    env = {**os.environ, "HOME": str(home), "GOVRAY_HOME": str(home / "govray")}
    init = [
        sys.executable,
        "-P",
        "-m",
        "govray",
        "signer",
        "init",
        "--dir",
        str(home),
        "--passphrase-file",
        str(secret),
    ]
    subprocess.run(init, check=True, env=env, capture_output=True)
    for path in (home, *home.rglob("*")):
        os.chown(path, owner.pw_uid, owner.pw_gid)
    socket = sockets / "signer.sock"
    serve = [
        *init[:5],  # (python -P -m govray signer)
        "serve",
        "--dir",
        str(home),
        "--socket",
        str(socket),
        "--passphrase-file",
        str(secret),
        "--open-uid",
        "0",  # the operator's launch (root here) opens runs; the workers only seal
    ]
    log = open(home.parent / f"{home.name}.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        serve, env=env, stdout=log, stderr=subprocess.STDOUT, user=owner.pw_uid, group=owner.pw_gid, cwd=home
    )
    try:
        for _ in range(200):
            if socket.exists() or process.poll() is not None:
                break
            time.sleep(0.1)
        assert socket.exists(), (home.parent / f"{home.name}.log").read_text()
        yield socket, SigningKey.load(home / "platform.key", PASSPHRASE.encode()), home
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)


def secret_forms(key: SigningKey, home: Path) -> list[bytes]:
    """What a search must not find: the key's raw bytes (hex, base64), its encrypted PEM's body,
    and the passphrase."""
    private = key._private
    assert isinstance(private, Ed25519PrivateKey)
    raw = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    pem = (home / "platform.key").read_bytes()
    body = b"".join(line for line in pem.splitlines() if line and not line.startswith(b"-----"))
    return [raw, raw.hex().encode(), base64.b64encode(raw), body, PASSPHRASE.encode()]


def test_workers_running_as_their_own_user_reach_no_key_nor_passphrase_while_the_signer_seals(
    users: tuple[pwd.struct_passwd, pwd.struct_passwd],
    signer: tuple[Path, SigningKey, Path],
) -> None:
    socket, key, home = signer
    worker = users[1]
    root = Path(tempfile.mkdtemp(prefix="gk-run-", dir="/tmp"))
    root.chmod(0o777)
    probes = root / "found"
    probes.mkdir()
    probes.chmod(0o777)
    example = key_search_example(
        root,
        probes,
        (home / "platform.key").stat().st_mtime - 1.0,
        policy={"file": "policies/digits.policy.yaml"},  # vouched for by the operator's trust
    )
    # The operator's trust: the signer's platform key and the example's policy authority.
    trust = root / "operator-trust.yaml"
    authorities = load_trust(root / "policies" / "trust.yaml")
    save_trust(TrustConfig(keys=[*authorities.keys, key.public_key]), trust)
    worker_home = Path(tempfile.mkdtemp(prefix="gk-worker-", dir="/tmp"))
    (worker_home / ".ray").mkdir()
    shutil.copy(Path.home() / ".ray" / "auth_token", worker_home / ".ray" / "auth_token")
    for path in (worker_home, *worker_home.rglob("*")):
        os.chown(path, worker.pw_uid, worker.pw_gid)
    cluster = LocalRayCluster()
    try:
        cluster.start_head(
            num_cpus=2,
            user=OsUser(worker.pw_uid, worker.pw_gid, (users[0].pw_gid,), worker_home),
            env={"GOVRAY_HOME": str(worker_home / "govray"), "GOVRAY_SIGNER_SOCKET": str(socket)},
        )
        cluster.wait_for_nodes(1)
        job = subprocess.run(
            [sys.executable, "-m", "govray", "run", str(example)],
            env=cluster.environment(
                RAY_ADDRESS=cluster.address, GOVRAY_SIGNER_SOCKET=str(socket), GOVRAY_TRUST=str(trust)
            ),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            umask=0,  # the storage is the workers' too: they write checkpoints and logs there
        )
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    finally:
        cluster.stop()
        shutil.rmtree(worker_home, ignore_errors=True)
    found = [json.loads(path.read_text()) for path in sorted(probes.glob("*.json"))]
    searches = [entry for entry in found if entry["uid"] == worker.pw_uid]
    assert len({entry["pid"] for entry in searches}) == 2 and len(searches) >= 4  # both workers, twice
    checkpoints = find_checkpoints(next((root / "storage" / "ray").iterdir()))
    assert checkpoints
    operator = TrustConfig(keys=[key.public_key])
    for folder in checkpoints:  # sealed by the key no worker reached
        assert verify_checkpoint(folder, operator)[1] == key.keyid
    forms = secret_forms(key, home)
    searched: set[str] = set()
    for entry in searches:
        reached = [
            *entry["environ"].values(),
            *(text for texts in entry["processes"].values() for text in texts),
            *entry["stack"],
        ]
        assert not [text for text in reached if any(form in text.encode() for form in forms)]
        searched.update(entry["files"])
    assert {str(folder / "manifest.sig") for folder in checkpoints} & searched  # the search reached them
    assert not [name for name in searched if Path(name).is_relative_to(home)]  # the signer's home: closed
    holding = []
    for name in sorted(searched):
        try:
            data = Path(name).read_bytes()
        except OSError:
            continue
        if any(form in data for form in forms):
            holding.append(name)
    assert holding == []
    shutil.rmtree(root, ignore_errors=True)
