#!/usr/bin/env bash
# A hash of the code (every .py / .sh under the packages, bench/ and tests/): what identifies a tree
# on the device machine, whose copy of the git metadata may be older than the files it got.
# Run here at a commit to match it: bash bench/code_hash.sh
cd "$(dirname "$0")/.." || exit 1
find qserve quant_kernels loaders bench tests \( -name '*.py' -o -name '*.sh' \) -not -path '*/__pycache__/*' \
    | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
