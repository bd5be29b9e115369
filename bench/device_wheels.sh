#!/usr/bin/env bash
# The Python packages the device machine lacks, as wheels in .whl/ (git-ignored through
# .git/info/exclude), for the device README's way of carrying them: the server's (fastapi and its
# opentelemetry-api, uvicorn, pydantic), the engine-core process's (pyzmq, msgspec) and structured
# outputs' (xgrammar, apache-tvm-ffi), and py-spy (issue 27's profile of the HTTP path: its binary lands
# in /tmp/site/bin, where bench/serving_http.sh looks). Run here, in the repo root; then every device call names
# ".whl" in carry and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site:. || exit
# (what the device image already holds: .library/device/KINDS.md; anyio, httpx, prometheus-client,
# annotated-doc, peft are there). Delete .whl/ before the session ends.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --platform any -d .whl \
    fastapi starlette opentelemetry-api pydantic pydantic-core annotated-types typing-inspection typing-extensions \
    uvicorn jsonschema jsonschema-specifications referencing rpds-py fastapi-offline \
    pyzmq msgspec xgrammar apache-tvm-ffi py-spy
ls .whl
du -sh .whl
