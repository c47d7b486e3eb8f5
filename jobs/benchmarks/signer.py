"""A checkpoint sealed through the platform's signer vs sealed in the worker's own process.

Both sides write the same checkpoint (``--gib`` GiB of fp32 weights in ``model.safetensors``, a
``state.json``) into a fresh folder and seal it; what is timed is writing plus sealing:

- **through the signer**: govray's path. The signer runs in a process of its own (a real
  ``SignerServer`` on a Unix socket, as ``govray signer serve`` runs it); the worker side is
  ``ChannelSigner.seal``: one request, then the signer lists and hashes every file itself, block
  digests included, in one pass, and signs the manifest (``govray.train.checkpoints.sealing``).
- **in process** (the baseline, written here, independent of govray's sealing code): what a worker
  did before the signer ran apart: hash each file with ``hashlib`` (the weight file whole and in
  1 MiB blocks, in one pass), write the block digests beside it, build the manifest JSON and sign
  it with an Ed25519 key it holds (``cryptography``).

Pairs alternate which side goes first; reported: the median of the per-pair ratios. Target
≤ 1.10 (the signer's pass replaces the worker's hashing: no file is read twice).

Run: ``python -m jobs.benchmarks.signer [--gib 1] [--pairs 5]`` (one warm-up pair first). Last line exactly
``signed checkpoint through the signer / in process: X.XXX``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import hashlib
import json
import multiprocessing
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

BLOCK = 1 << 20


def serve(socket_path: str, state: str, ready: multiprocessing.synchronize.Event) -> None:
    """The signer's process: a platform key of its own, served on ``socket_path``."""
    from govray.core.keys import KeyRole, SigningKey
    from govray.signer.server import SignerServer
    from govray.signer.service import Signer

    # (the folder holds no training state: the ledger recomputation, milliseconds for a run's state
    # beside a GiB of hashing, is left out; ``tests/test_signer_ledger.py`` tests it)
    signer = Signer(SigningKey.generate(KeyRole.PLATFORM), Path(state), check_ledgers=False)
    server = SignerServer(signer, Path(socket_path))
    ready.set()
    server.serve_forever()


def write(folder: Path, weights: torch.Tensor) -> None:
    folder.mkdir(parents=True)
    save_file({"weight": weights}, str(folder / "model.safetensors"))
    (folder / "state.json").write_text(json.dumps({"step": 1}))


def through_signer(folder: Path, weights: torch.Tensor, socket_path: Path) -> float:
    from govray.train.checkpoints.signer import ChannelSigner, SignerChannel, SignerClient

    capability, _ = SignerClient(socket_path).open_run(str(folder.parent))  # the launch's, untimed
    signer = ChannelSigner(
        SignerChannel(socket=str(socket_path), capability=capability, run_dir=str(folder.parent))
    )
    began = time.perf_counter()
    write(folder, weights)
    sealed = signer.seal(folder, 1, {})
    (folder / "manifest.json").write_bytes(sealed.manifest)
    (folder / "manifest.sig").write_text(sealed.envelope.to_json())
    return time.perf_counter() - began


def in_process(folder: Path, weights: torch.Tensor, key: Ed25519PrivateKey) -> float:
    began = time.perf_counter()
    write(folder, weights)
    files: dict[str, str] = {}
    for path in sorted(folder.iterdir()):
        whole, blocks = hashlib.sha256(), []
        with open(path, "rb") as handle:
            while chunk := handle.read(BLOCK):
                whole.update(chunk)
                blocks.append(hashlib.sha256(chunk).hexdigest())
        files[path.name] = whole.hexdigest()
        if path.suffix == ".safetensors":
            side = json.dumps({"block_size": BLOCK, "blocks": blocks}).encode()
            (folder / f"{path.name}.blocks.json").write_bytes(side)
            files[f"{path.name}.blocks.json"] = hashlib.sha256(side).hexdigest()
    manifest = json.dumps(
        {"files": files, "step": 1, "signed_at": dt.datetime.now(dt.UTC).isoformat()}, sort_keys=True
    ).encode()
    (folder / "manifest.json").write_bytes(manifest)
    (folder / "manifest.sig").write_bytes(key.sign(manifest))
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of weights in the checkpoint")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    weights = torch.randn(int(args.gib * (1 << 30)) // 4)
    root = Path(tempfile.mkdtemp(prefix="govray-bench-signer-", dir="/tmp"))
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    socket_path = root / "s.sock"
    process = context.Process(target=serve, args=(str(socket_path), str(root / "state"), ready), daemon=True)
    process.start()
    ready.wait(60)
    while not socket_path.exists():
        time.sleep(0.05)
    key = Ed25519PrivateKey.generate()
    ratios = []
    try:
        for pair in range(-1, args.pairs):  # pair -1 warms the page cache and the signer: not counted
            mine, theirs = (root / f"{side}-{pair}" / "checkpoint_00000001" for side in ("signer", "process"))
            sides = [
                functools.partial(through_signer, mine, weights, socket_path),
                functools.partial(in_process, theirs, weights, key),
            ]
            order = sides if pair % 2 == 0 else sides[::-1]
            first, second = (side() for side in order)
            signer_s, process_s = (first, second) if pair % 2 == 0 else (second, first)
            if pair >= 0:
                ratios.append(signer_s / process_s)
            print(
                f"pair {pair}: through the signer {signer_s:.2f} s, in process {process_s:.2f} s: "
                f"{signer_s / process_s:.3f}"
            )
            for name in (f"signer-{pair}", f"process-{pair}"):
                shutil.rmtree(root / name)
    finally:
        process.terminate()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.gib:g} GiB of weights, {args.pairs} pairs, median of per-pair ratios")
    print(f"signed checkpoint through the signer / in process: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
