#!/usr/bin/env bash
# Prints the executable of CPython VERSION (e.g. 3.12): pyenv's newest VERSION.x, else pythonVERSION on PATH.
# Exits 1, printing nothing, when this machine has none. pyenv's shims answer for every version, so pyenv itself is
# asked first.
#   scripts/find_python.sh 3.12
set -uo pipefail
version="${1:?usage: scripts/find_python.sh VERSION}"
if command -v pyenv >/dev/null 2>&1; then
  if found=$(pyenv latest "$version" 2>/dev/null); then
    python="$(pyenv root)/versions/$found/bin/python$version"
    [ -x "$python" ] && { echo "$python"; exit 0; }
  fi
  exit 1
fi
command -v "python$version" || exit 1
