"""The user's surface: one import (`from decode import ...`) gives every name README's examples
use, and `import decode` alone loads no engine (each name loads its module when first used)."""

from __future__ import annotations

import subprocess
import sys


def test_one_import_gives_the_surface_and_loads_the_engine_only_when_used():
    script = (
        "import sys, decode\n"
        "assert 'decode.engine.decoder' not in sys.modules and 'jax' not in sys.modules\n"
        "from decode import (OpenCheckpoint, Placement, EngineOptions, Sampling, DecodeConfig,\n"
        "                    Request, make_plan, Decoder, Batcher, generate)\n"
        "import decode.engine.decoder as d, decode.serving.batching as b\n"
        "assert Decoder is d.Decoder and Batcher is b.Batcher and decode.generate is generate\n"
        "assert set(decode.__all__) >= {'OpenCheckpoint', 'Request', 'make_plan', 'generate'}\n"
        "try:\n"
        "    decode.nothing\n"
        "except AttributeError as e:\n"
        "    print('ok', e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok module 'decode' has no attribute 'nothing'"), out.stdout
