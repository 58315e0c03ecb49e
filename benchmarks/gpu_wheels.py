"""The wheels the GPU machine lacks, for the device call (docs/performance.md, "The GPU check").

    python benchmarks/gpu_wheels.py            # here, with network: download benchmarks/gpu_wheels.txt into .whl/
    python3 benchmarks/gpu_wheels.py --check   # there, after gpu_check.sh installed them: import each, say what is

The GPU machine has no network. What the project imports and that machine lacks is pinned in gpu_wheels.txt; this
downloads those wheels for its Python (CPython 3.12, manylinux x86-64) into `.whl/` (git-ignored), keeps one version
of each, drops what bitsandbytes' wheel holds for other CUDA releases than the machine's torch (cu130) was built
for, and checks that the working tree and the wheels together fit what the device tool carries (64 MiB). Name
`.whl` in the device call's `carry`.

`--check` (gpu_check.sh's first stage) imports every carried package and the machine's own, printing PASS / FAIL per
package with its version, and the torch, CUDA and GPU facts; a version of the machine's own packages that differs
from benchmarks/gpu_machine.txt is printed as a NOTE (that list was read off the machine by hand).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS = Path(__file__).with_name("gpu_wheels.txt")
MACHINE = Path(__file__).with_name("gpu_machine.txt")
WHEELS = ROOT / ".whl"
CARRY_LIMIT = 64 * 2**20  # what the device tool carries: the working tree and the `carry` paths together
PYTHON_VERSION, PLATFORMS = "3.12", ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                                     "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
                                     "manylinux1_x86_64")
MACHINE_CUDA = "130"  # the GPU machine's torch 2.11.0+cu130: the one bitsandbytes CUDA library it loads
MODULES = {"pydantic-core": "pydantic_core", "fastapi-offline": "fastapi_offline", "python-multipart": "multipart", "opentelemetry-api": "opentelemetry",
           "huggingface_hub": "huggingface_hub", "pyyaml": "yaml", "prometheus-client": "prometheus_client",
           "pytest-xdist": "xdist", "pytest-timeout": "pytest_timeout"}


def pinned(path: Path) -> list[tuple[str, str | None]]:
    """(name, version or None) of each requirement line of `path`."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [(line.split("==")[0], line.split("==")[1] if "==" in line else None) for line in lines if line]


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def slim_bitsandbytes(wheel: Path) -> None:
    """Rewrite bitsandbytes' wheel without the libraries of other CUDA (and ROCm) releases than the machine's: it
    loads only the one matching torch's CUDA, and the others make it too large to carry (43 MB -> about 3 MB)."""
    keep = re.compile(rf"libbitsandbytes_(cpu|cuda{MACHINE_CUDA})\.so$")
    with zipfile.ZipFile(wheel) as source:
        names = [name for name in source.namelist()
                 if "libbitsandbytes_" not in name or keep.search(name)]
        if len(names) == len(source.namelist()):
            return  # slimmed already
        contents = {name: source.read(name) for name in names}
    record = next(name for name in names if name.endswith(".dist-info/RECORD"))
    contents[record] = "".join(line + "\n" for line in contents[record].decode().splitlines()
                               if line.split(",")[0] in contents).encode()
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for name, data in contents.items():
            target.writestr(name, data)
    slim.replace(wheel)


def download() -> None:
    pins = pinned(PINS)
    WHEELS.mkdir(exist_ok=True)
    wanted = {normalised(name): version for name, version in pins}
    for wheel in WHEELS.glob("*.whl"):  # one version of each: drop any other
        name, version = wheel.name.split("-")[:2]
        if wanted.get(normalised(name)) != version:
            wheel.unlink()
    present = {normalised(wheel.name.split("-")[0]) for wheel in WHEELS.glob("*.whl")}
    absent = [f"{name}=={version}" for name, version in pins if normalised(name) not in present]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
               *[flag for platform in PLATFORMS for flag in ("--platform", platform)], "-d", str(WHEELS), *absent]
    if absent:  # (a slimmed wheel no longer has the registry's hash: pip would fetch it again)
        subprocess.run(command, check=True)
    for wheel in WHEELS.glob("bitsandbytes-*.whl"):
        slim_bitsandbytes(wheel)
    have = {normalised(wheel.name.split("-")[0]) for wheel in WHEELS.glob("*.whl")}
    absent = sorted(set(wanted) - have)
    if absent:
        sys.exit(f"no wheel for {absent} in {WHEELS}")
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode().split("\0")
    tree = sum((ROOT / name).stat().st_size for name in tracked if name and (ROOT / name).is_file())
    wheels = sum(wheel.stat().st_size for wheel in WHEELS.glob("*.whl"))
    print(f"{len(have)} wheels in {WHEELS}: {wheels / 2**20:.1f} MiB; the working tree {tree / 2**20:.1f} MiB; "
          f"together {(tree + wheels) / 2**20:.1f} MiB of the {CARRY_LIMIT / 2**20:.0f} MiB the device call carries")
    if tree + wheels > CARRY_LIMIT:
        sys.exit("too large to carry: drop a wheel from benchmarks/gpu_wheels.txt (and say what then cannot run)")


def check() -> int:
    """Import every carried package and the machine's own; 1 when a carried one fails."""
    failed = 0
    for name, version in pinned(PINS) + pinned(MACHINE):
        module = MODULES.get(name, normalised(name))
        try:
            importlib.import_module(module)
            found = importlib.metadata.version(name)
        except Exception as error:  # noqa: BLE001  (each package is reported)
            failed += 1
            print(f"FAIL import {module} ({name}): {type(error).__name__}: {error}", flush=True)
            continue
        if version is not None and found != version and (name, version) in pinned(MACHINE):
            print(f"NOTE {name} {found} here, {version} in benchmarks/gpu_machine.txt", flush=True)
        print(f"PASS import {module} ({name} {found})", flush=True)
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {device}; python {sys.version.split()[0]}; "
          f"{os.cpu_count()} CPUs", flush=True)
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="import the carried packages (on the GPU machine)")
    if parser.parse_args().check:
        sys.exit(check())
    download()


if __name__ == "__main__":
    main()
