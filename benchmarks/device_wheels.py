"""What the lent GPU machine lacks, carried as wheels (benchmarks/device_prep.sh runs this here).

The machine (nvidia-h200: Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, no registry) has the
packages in DEVICE_HAS; a call carries the working tree and the paths it names, 64 MiB in all. CARRY is
what the peers and the validator's reference columns need beyond DEVICE_HAS: TransformerLens, nnsight
and interp-engine, with what their imports pull in (measured: `check` imports them here with only
DEVICE_HAS and the downloaded wheels visible). nnterp runs on its own nnsight 0.7.0 from .nnterp-ref/
(validator/engines/child.py): its pins (scripts/nnterp_reference.txt) and NNTERP_REF_EXTRA go to
`<dest>/nnterp-ref/`, which benchmarks/device.sh installs there with `scripts/nnterp_reference.sh --wheels`;
`check` imports nnterp from them in the same world. transformers itself is not carried by default:
5.19 (the project's pin) is 12.6 MB, and with it the carried set plus the checkout is over 64 MiB;
the engine, the validator and the peers were run on the CPU with 5.17 and huggingface-hub 1.33 (what
the machine has) and pass. `--transformers` adds it where the checkout leaves room.

    python -m benchmarks.device_wheels download [--transformers] [--dest .whl]   # pip download, py3.12 wheels
    python -m benchmarks.device_wheels check [--dest .whl]                       # the imports, in the device's world
    python -m benchmarks.device_wheels size [--dest .whl]                        # checkout + wheels against 64 MiB
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2 ** 20  # what one device call carries: the working tree and its carried paths
# what the carried wheels take, --transformers included (25.0 MiB downloaded on 2026-12-07): the checkout
# must leave this much of LIMIT, or the prepared device run cannot start (tests/test_benchmarks_device_wheels.py)
WHEELS_ROOM = 26 * 2 ** 20

# distributions on the machine's image (/work/.library/device/KINDS.md, nvidia-h200, read 2026-11-17)
DEVICE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())

# name==version of every wheel a device call carries (the project's pins where it has them; the rest as
# the project's environment resolved them)
CARRY = (
    "interp-engine==1.14.2", "transformer-lens==4.3.0", "nnsight==0.8.1",
    # TransformerLens imports datasets at import time
    "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19",
    # nnsight 0.8.1's imports
    "greenlet==3.5.6", "websocket-client==1.9.2", "zstandard==0.25.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5",
)
NNTERP_REF = "nnterp-ref"  # the folder under dest holding the wheels of nnterp's side directory
# what nnsight 0.7.0 imports beyond the side pins that neither the machine nor CARRY has (nnsight 0.8 dropped astor)
NNTERP_REF_EXTRA = ("astor==0.8.1",)
TRANSFORMERS = "transformers==5.19.0"
# the image's own versions of what the check must not take from this environment (the project pins other ones)
DEVICE_VERSIONS = ("transformers==5.17.0", "huggingface-hub==1.33.0")
DEVICE_SITE = Path("/tmp/interp-device-site")  # where `check` installs them (never carried)
# what the device run imports (benchmarks' peers, the validator's reference columns)
IMPORTS = ("transformers", "transformer_lens.model_bridge", "nnsight", "interp_engine", "engine.backends.hf.eager",
           "validator.runner", "validator.cli", "benchmarks.sweep", "benchmarks.worker", "matplotlib.pyplot")
_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
              "manylinux1_x86_64")


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def nnterp_ref_pins() -> list[str]:
    """The wheels of nnterp's side directory on the machine: its pins, then NNTERP_REF_EXTRA."""
    from validator.engines import NNTERP_SIDE
    return NNTERP_SIDE.wanted().split() + list(NNTERP_REF_EXTRA)


def _fetch(dest: Path, want: list[str], stale: set[str], pip: tuple[str, ...]) -> None:
    """pip download of `want` (name==version, no dependencies) as CPython 3.12 x86-64 Linux wheels into `dest`,
    after removing wheels there of another version of a wanted package or of a package in `stale` (two versions
    stop the install)."""
    dest.mkdir(parents=True, exist_ok=True)
    names = {norm(w.split("==")[0]) for w in want}
    for p in dest.glob("*.whl"):
        if norm(p.name.split("-")[0]) in names | stale and not any(
                norm(p.name.split("-")[0]) == norm(w.split("==")[0]) and p.name.split("-")[1] == w.split("==")[1]
                for w in want):
            p.unlink()
    cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           *[a for p in _PLATFORMS for a in ("--platform", p)], "-d", str(dest), *want]
    subprocess.run(cmd, check=True)


def download(dest: Path, with_transformers: bool = False, pip: tuple[str, ...] = (sys.executable, "-m", "pip")) -> list[Path]:
    """pip download of every carried wheel for CPython 3.12 on x86-64 Linux into `dest` (no dependencies:
    CARRY names each one), and of nnterp's side directory into `dest/nnterp-ref`; wheels of other versions of
    the same packages are removed (two stop the install), and transformers when not asked for."""
    _fetch(dest, list(CARRY) + ([TRANSFORMERS] if with_transformers else []), {"transformers", "nnterp"}, pip)
    side = nnterp_ref_pins()
    _fetch(dest / NNTERP_REF, side, {norm(w.split("==")[0]) for w in side}, pip)
    return sorted(dest.glob("*.whl")) + sorted((dest / NNTERP_REF).glob("*.whl"))


def device_site(site: Path = DEVICE_SITE, pip: tuple[str, ...] = (sys.executable, "-m", "pip")) -> Path:
    """A folder holding the image's own transformers and huggingface-hub (DEVICE_VERSIONS), installed once
    from the registry, for `check` to import instead of this environment's."""
    if not all((site / f"{norm(v.split('==')[0]).replace('-', '_')}-{v.split('==')[1]}.dist-info").is_dir()
               for v in DEVICE_VERSIONS):
        subprocess.run([*pip, "install", "-q", "--no-deps", "--no-compile", "--upgrade", "--target", str(site),
                        *DEVICE_VERSIONS], check=True)
    return site


def world(dest: Path, view: Path, also: Path | None = None) -> Path:
    """A folder of links to what of this environment's site-packages the machine would have: the modules
    and metadata of its image's distributions (DEVICE_HAS) and of the carried wheels (in `dest`, and in
    `also` when given; the same versions, built here for this Python), but not transformers and
    huggingface-hub, whose image versions `device_site` provides. Run with `python -S` and this on the
    path, anything else is simply absent."""
    import sysconfig
    from importlib import metadata
    skip = {norm(v.split("==")[0]) for v in DEVICE_VERSIONS}
    carried = {norm(p.name.split("-")[0]) for d in (dest, *([also] if also else [])) for p in d.glob("*.whl")}
    allowed = ({norm(d) for d in DEVICE_HAS} | carried) - (skip - carried)
    owners = metadata.packages_distributions()
    site = Path(sysconfig.get_paths()["purelib"])
    view.mkdir(parents=True, exist_ok=True)
    for entry in site.iterdir():
        if entry.name.endswith(".dist-info"):
            keep = norm(entry.name[:-len(".dist-info")].rsplit("-", 1)[0]) in allowed
        elif entry.suffix == ".pth" or entry.name == "__pycache__":
            keep = False
        else:
            top = entry.name.split(".")[0]
            keep = any(norm(d) in allowed for d in owners.get(top, ())) or (top not in owners and top.startswith("_"))
        if keep and not (view / entry.name).exists():
            (view / entry.name).symlink_to(entry)
    return view


_IMPORT = r"""
import importlib, sys
bad = 0
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
        print(f"{m}: imports")
    except Exception as e:
        bad += 1
        print(f"{m}: FAILS: {type(e).__name__}: {e}")
sys.exit(1 if bad else 0)
"""


def check(dest: Path, imports: tuple[str, ...] = IMPORTS, site: Path | None = None) -> tuple[bool, str]:
    """Import `imports` in a fresh process (`python -S`) that sees only what the machine would: its image's
    distributions, its transformers and huggingface-hub (from `site`), and the carried wheels' packages."""
    import tempfile
    view = world(dest, Path(tempfile.mkdtemp(prefix="device-world-")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([*([str(site)] if site else []), str(view), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-S", "-c", _IMPORT, *imports], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    return proc.returncode == 0, (proc.stdout + (proc.stderr[-2000:] if proc.returncode else "")).strip()


def check_nnterp_ref(dest: Path, site: Path | None = None) -> tuple[bool, str]:
    """nnterp imported in the machine's world plus the wheels of `dest/nnterp-ref`, with this checkout's
    .nnterp-ref (scripts/nnterp_reference.sh: the same pins, built for this Python) first on the path, as
    device.sh puts the machine's; its nnsight must be the side directory's, not CARRY's."""
    import tempfile

    from validator.engines import NNTERP_SIDE
    if not sorted((dest / NNTERP_REF).glob("*.whl")):
        return False, f"nnterp (side): no wheels in {dest / NNTERP_REF}; run download"
    why = NNTERP_SIDE.problem()
    if why:
        return False, f"nnterp (side): {why}"
    view = world(dest, Path(tempfile.mkdtemp(prefix="device-world-")), also=dest / NNTERP_REF)
    side = str(NNTERP_SIDE.path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([side, *([str(site)] if site else []), str(view), str(ROOT)])}
    code = ("import sys, nnsight, nnterp; from importlib import metadata; "
            "print(f'nnterp (side): imports, nnterp {metadata.version(\"nnterp\")} on nnsight {nnsight.__version__} "
            "from {nnsight.__file__}'); sys.exit(0 if nnsight.__file__.startswith(sys.argv[1]) else 1)")
    proc = subprocess.run([sys.executable, "-S", "-c", code, side], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    return proc.returncode == 0, (proc.stdout + (proc.stderr[-2000:] if proc.returncode else "")).strip()


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends besides its carried paths: tracked files and untracked ones git
    does not ignore (links count as links)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    total = 0
    for rel in filter(None, set(out.split("\0"))):
        p = root / rel
        if p.is_symlink():
            total += len(os.readlink(p))
        elif p.is_file():
            total += p.stat().st_size
    return total


def size(dest: Path, root: Path = ROOT) -> tuple[bool, str]:
    tree = tree_bytes(root)
    wheels = sum(p.stat().st_size for p in dest.glob("*.whl")) + sum(p.stat().st_size for p in
                                                                     (dest / NNTERP_REF).glob("*.whl"))
    ok = tree + wheels <= LIMIT
    mib = 2 ** 20
    return ok, (f"checkout {tree / mib:.1f} MiB + {dest.name} {wheels / mib:.1f} MiB = {(tree + wheels) / mib:.1f} MiB "
                f"of the {LIMIT // mib} MiB a device call carries" + ("" if ok else ": OVER, carry fewer wheels "
                                                                      "(drop --transformers)"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device_wheels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("download", "check", "size"))
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl")
    ap.add_argument("--transformers", action="store_true", help=f"carry {TRANSFORMERS} too (12.6 MB)")
    args = ap.parse_args(argv)
    if args.what == "download":
        got = download(args.dest, args.transformers)
        print(f"{len(got)} wheels in {args.dest}")
        return 0
    if args.what == "check":
        site = device_site()
        ok, text = check(args.dest, site=site)
        side_ok, side_text = check_nnterp_ref(args.dest, site)
        ok, text = ok and side_ok, f"{text}\n{side_text}"
    else:
        ok, text = size(args.dest)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
