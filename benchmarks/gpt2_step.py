"""One GPT-2 training step of the NumPy model, timed; MFU, peak memory, and PyTorch beside it.

    python benchmarks/gpt2_step.py                  # GPT-2 124M at B x T = 4x64 and 4x256
    python benchmarks/gpt2_step.py --torch          # side by side with PyTorch eager
    python benchmarks/gpt2_step.py --help           # as python -m proxies.gpt2.bench --help

What is measured and how: see proxies/gpt2/bench.py.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from proxies.gpt2.bench import main  # noqa: E402  (imports proxies first: BLAS threads pinned)

if __name__ == "__main__":
    sys.exit(main())
