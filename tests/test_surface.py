"""The user's surface: one import (`from decode import ...`) gives every name README's examples
use, and `import decode` alone loads no engine (each name loads its module when first used)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys


def run(script: str) -> str:
    """The stdout of `script` in a fresh interpreter (nothing imported before it)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_one_import_gives_the_surface_and_loads_the_engine_only_when_used():
    script = (
        "import sys, decode\n"
        "assert 'decode.engine.runtime.decoder' not in sys.modules and 'jax' not in sys.modules\n"
        "from decode import (OpenCheckpoint, Placement, EngineOptions, Sampling, DecodeConfig,\n"
        "                    Request, make_plan, Decoder, Batcher, generate)\n"
        "import decode.engine.runtime.decoder as d, decode.engine.runtime.batcher as b\n"
        "assert Decoder is d.Decoder and Batcher is b.Batcher and decode.generate is generate\n"
        "assert set(decode.__all__) >= {'OpenCheckpoint', 'Request', 'make_plan', 'generate'}\n"
        "try:\n"
        "    decode.nothing\n"
        "except AttributeError as e:\n"
        "    print('ok', e)\n")
    out = run(script)
    assert out.startswith("ok module 'decode' has no attribute 'nothing'"), out


def test_the_option_types_load_no_jax():
    """A door's options are parsed and checked before anything heavy loads: the option types and
    their checks (the [MASK] rule, `mask_id_for`, too) import no jax."""
    script = (
        "import sys\n"
        "from decode import EngineOptions, Placement, Sampling\n"
        "Sampling(temperature=0.5, min_p=0.1, logit_bias={3: -100})\n"
        "Placement(dtype='bfloat16', mesh=(2, 1, 2), quantize='int4', kv_dtype='int8')\n"
        "EngineOptions(method='verified', window=8, slots=4, capacity=256)\n"
        "try:\n"
        "    Placement(quantize='int3')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
        "from decode.config import mask_id_for\n"
        "print('jax' in sys.modules)\n")
    refused, loaded = run(script).strip().splitlines()
    assert refused.startswith("DecodeConfigError") and "int3" in refused, refused
    assert loaded == "False"


def test_nothing_imports_upward_in_decode():
    """The engine imports no door, server or job: in decode/, only the option modules (config.py,
    options.py, lora_options.py) are imported from outside the engine's folder; and no offline job imports the
    server (lazy imports included)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "decode"

    def imported(folder: str) -> set:
        names = set()
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module)
                elif isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
        return {n for n in names if n == "decode" or n.startswith("decode.")}

    outside = {n for n in imported("engine") if not n.startswith("decode.engine")}
    assert outside <= {"decode.config", "decode.options", "decode.lora_options"}, outside
    server = {n for n in imported("jobs") if n.startswith("decode.serving")}
    assert not server, server
