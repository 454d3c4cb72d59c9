#!/usr/bin/env bash
# Benchmarks: raytrain side by side with torchrun DDP, DataLoader and torch.save (bench/compare.py).
#   bench/run.sh [--quick] [--no-write]
# Sets up the environment (make setup) on a fresh machine, runs everything interleaved, updates
# BENCHMARKS.md and bench/results/, and prints throughput_ratio=<x> as its last line.
set -euo pipefail

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  make --quiet setup >&2
  exec .venv/bin/python bench/compare.py "$@"
}

main "$@"
