#!/usr/bin/env bash
# The wheels lit3d needs on a GPU node without internet beyond what the node's image holds, downloaded here, where the
# package index is reachable (docs/launching.md, "On a node without internet"):
#
#     bash benchmarks/gpu_wheels.sh DIR           # for an image with torch, Lightning, transformers and the usual
#                                                 # scientific stack (pandas, pyarrow, ...): a few MB
#     bash benchmarks/gpu_wheels.sh DIR --bare    # also what an environment of torch, Lightning and transformers
#                                                 # alone lacks (pyarrow, pandas, xxhash, ...)
#
# then, on the node:  pip install --no-index --find-links DIR -e .
#
# The image's own torch and Lightning are used as they are: none is downloaded, and lit3d's requirements of them
# (pyproject.toml) are ranges such an image meets. Wheels are for CPython $PYTHON_VERSION (default 3.12) on x86-64
# Linux; versions are pinned to ones that install together beside such an image (torch 2.11, Lightning 2.6.6,
# transformers 5.17, huggingface-hub 1.33, numpy 2.5). Each wheel's own requirements are checked at the end: each is
# one of these wheels (in a version it accepts) or a package such an image has.
set -euo pipefail

usage="usage: bash benchmarks/gpu_wheels.sh DIR [--bare]"
DIR=${1:?$usage}
BARE=${2:-}
[ -z "$BARE" ] || [ "$BARE" = --bare ] || { echo "$usage (got $BARE)" >&2; exit 2; }
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PYTHON=${PYTHON:-python3}
BUDGET_MB=60  # what one device call carries beside the repository

# What such an image lacks: lit3d's CLI (jsonargparse with its `signatures` extra), its data (datasets and its own
# needs beyond pandas/pyarrow/xxhash, zstandard for .jsonl.zst corpora), FP8 (torchao), and setuptools, which pip's
# isolated build of `-e .` takes from DIR when the index is off. NOTE: datasets 5.0.1, not the newest: it takes the
# pyarrow of an image a year old (>= 21, where 5.1 asks >= 24).
NODE_LACKS=(
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
  datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19
  fsspec==2026.6.0  # NOTE: what datasets 5.0 accepts, should the image's be newer (then pip swaps it; else unused)
  zstandard==0.25.0
  torchao==0.18.0
  setuptools==80.9.0
)
# What such an image has that an environment of torch, Lightning and transformers alone does not (datasets' needs).
BARE_LACKS=(
  pyarrow==26.0.1 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0 tzdata==2026.6 xxhash==4.1.0
  requests==2.34.2 charset-normalizer==3.5.3 urllib3==2.8.0
)
# What the check at the end takes as present: what torch, Lightning and transformers bring along, and with an image
# (not --bare) what it holds beside them.
ON_IMAGE="torch triton sympy networkx jinja2 filelock fsspec setuptools typing-extensions lightning pytorch-lightning
  lightning-utilities torchmetrics packaging pyyaml tqdm aiohttp transformers tokenizers safetensors huggingface-hub
  hf-xet httpx idna certifi numpy regex typer rich"
[ -n "$BARE" ] || ON_IMAGE="$ON_IMAGE pandas pyarrow xxhash python-dateutil six tzdata requests charset-normalizer
  urllib3 peft"

wanted=("${NODE_LACKS[@]}")
[ -z "$BARE" ] || wanted+=("${BARE_LACKS[@]}")

platforms=()
for minor in $(seq 17 39); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
tag=cp${PYTHON_VERSION/./}

mkdir -p "$DIR"
echo "+ pip download (CPython $PYTHON_VERSION, x86-64 Linux) into $DIR: ${wanted[*]}"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp --abi "$tag" --abi abi3 --abi none "${platforms[@]}" --dest "$DIR" "${wanted[@]}"

# Each wheel's requirements (for that Python on Linux): one of the wheels, in a version it accepts, or on the image.
"$PYTHON" - "$DIR" "$PYTHON_VERSION" "$ON_IMAGE" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

folder, python, on_image = Path(sys.argv[1]), sys.argv[2], {canonicalize_name(n) for n in sys.argv[3].split()}
wheels = {}
for path in sorted(folder.glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(path.name)
    wheels[name] = (version, path)
environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython"}
problems = []
for name, (version, path) in wheels.items():
    with zipfile.ZipFile(path) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(metadata).decode().splitlines()
    extras = {"signatures"} if name == "jsonargparse" else set()  # the extra lit3d asks for
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        marker = requirement.marker
        if marker and not any(marker.evaluate({**environment, "extra": extra}) for extra in extras | {""}):
            continue
        needed = canonicalize_name(requirement.name)
        if needed in wheels:
            if not requirement.specifier.contains(wheels[needed][0], prereleases=True):
                problems.append(f"{name} {version} needs {requirement}, the folder has {needed} {wheels[needed][0]}")
        elif needed not in on_image:
            problems.append(f"{name} {version} needs {requirement}: neither a wheel here nor on the image")
if problems:
    sys.exit("gpu_wheels.sh: the wheels do not install together:\n  " + "\n  ".join(problems))
print(f"checked: every requirement of the {len(wheels)} wheels is one of them or on the image")
EOF

ls -l "$DIR"/*.whl | awk '{printf "  %8.2f MB  %s\n", $5 / 1e6, $NF}'
total=$(cat "$DIR"/*.whl | wc -c)
awk -v total="$total" -v budget="$BUDGET_MB" -v bare="$BARE" 'BEGIN {
  printf "total: %.1f MB in %s\n", total / 1e6, ARGV[1]
  if (bare == "" && total > budget * 1e6) { printf "over the %d MB a device call carries\n", budget; exit 1 }
}' "$DIR"
echo "on the node: pip install --no-index --find-links $DIR -e .   (docs/launching.md)"
