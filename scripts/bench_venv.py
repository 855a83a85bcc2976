#!/usr/bin/env python3
"""Runs plotting code in the benchmark-only virtualenv (target/bench-venv),
made and given matplotlib on first use, so the benchmark scripts' plots
need nothing in the system Python. Imported by bench_ab_summary.py and
bench_instructions.py.
"""

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VENV = os.path.join(ROOT, "target/bench-venv")


def run_plot(code, *args):
    """Runs `code` (Python source that imports matplotlib) with `args` as
    its sys.argv[1:] in the benchmark virtualenv."""
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    if subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode != 0:
        subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "-q", "matplotlib"], check=True)
    subprocess.run([py, "-c", code, *args], check=True)
