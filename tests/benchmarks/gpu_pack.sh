#!/usr/bin/env bash
# Pack the Python packages a lent GPU machine lacks into one archive for gpu_session.sh
# (docs/BENCHMARKS.md, "GPU"). The device image holds torch, numpy, scipy, scikit-learn,
# pandas and matplotlib but not Flower, Ray, cleanlab, mlxtend, opacus or pydantic, and
# nothing can be fetched there; a call may carry 64 MiB in all, and Ray's wheel alone is
# 70 MiB. So: the exact versions this machine's venv holds, as wheels for the device's
# Python, installed into one folder, Ray without what a simulation never loads (its Java
# jar, RLlib, Serve, Tune, Train, Data, LLM and the dashboard's web client) and its native
# binaries stripped of symbols, then one xz archive (about 46 MB).
#
#   bash tests/benchmarks/gpu_pack.sh [PYVER=3.12] [OUT=.whl/site.tar.xz]
set -euo pipefail
PYVER=${1:-3.12}
OUT=$(realpath -m "${2:-.whl/site.tar.xz}")
VENV_PY=${VENV_PY:-.venv/bin/python}
# What the device image already has (KINDS.md of the device tool): not carried.
ON_DEVICE='^(torch|torchvision|triton|numpy|scipy|scikit-learn|pandas|matplotlib|pillow|sympy|mpmath|networkx|jinja2|markupsafe|fsspec|joblib|threadpoolctl|python-dateutil|tzdata|contourpy|cycler|fonttools|kiwisolver|pyparsing|narwhals|six|setuptools|pip|pytest|pluggy|iniconfig|ruff|py-spy|uv|uvloop|fedefc|nvidia-.*|cuda-.*)=='
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$VENV_PY" -m pip list --format=freeze 2>/dev/null | grep -viE "$ON_DEVICE" > "$work/carry.txt"
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
           manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
want=(--no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp "${platforms[@]}")
python3 -m pip download -q "${want[@]}" -d "$work/wheels" -r "$work/carry.txt"
python3 -m pip install -q --no-index --no-compile "${want[@]}" --target "$work/site" \
    "$work"/wheels/*.whl
cd "$work/site"
rm -rf ray/jars ray/rllib ray/serve ray/llm ray/train ray/tune ray/data ray/dashboard/client/build
find . \( -name tests -o -name __pycache__ \) -type d -prune -exec rm -rf {} +
strip --strip-unneeded ray/_raylet.so ray/core/src/ray/raylet/raylet ray/core/src/ray/gcs/gcs_server
mkdir -p "$(dirname "$OUT")"
tar cf - . | xz -T2 -6 > "$OUT"
echo "$(wc -l < "$work/carry.txt") packages for Python $PYVER in $OUT ($(du -h "$OUT" | cut -f1))"
