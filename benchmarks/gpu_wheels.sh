#!/usr/bin/env bash
# Fetch, on this machine, the wheels benchmarks/gpu_check.sh installs on a lent GPU machine whose image
# lacks the project's packages (its Python 3.12 has torch, numpy, scipy, scikit-learn, matplotlib, rich,
# typer, httpx, grpcio...; not flwr, opacus, cryptography or pycryptodome). They go to .whl/, which the
# device tool carries (`carry: [".whl"]`); keep .whl/ out of git (.git/info/exclude).
#
#   bash benchmarks/gpu_wheels.sh          # from the repository root, with pip able to reach PyPI
set -euo pipefail
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    flwr==1.42.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 grpcio-health-checking==1.81.1 iterators==0.0.2 \
    opacus==1.6.0 pycryptodome==3.24.1 tomli==2.5.0 tomli-w==1.2.0 protobuf==6.33.6 grpcio==1.85.3 \
    pfl==0.6.0 multiprocess==0.70.19 dill prv-accountant==0.2.0  # (pfl for vs_pfl.py; ray's wheel is past the carry)
du -sh .whl
