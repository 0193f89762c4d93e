#!/usr/bin/env bash
# The checks the workspace declares, as CI runs them: formatting, clippy with warnings as
# errors, rustdoc with warnings as errors, and shellcheck (warnings and errors) on every script.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
command -v shellcheck >/dev/null || { echo "shellcheck is missing: run scripts/setup-debian.sh" >&2; exit 1; }
git ls-files -z '*.sh' | xargs -0 shellcheck -S warning
echo "lint: clean"
