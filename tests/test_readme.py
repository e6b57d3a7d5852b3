"""Every Python block of the README runs as written, top to bottom, in a fresh interpreter.

Each block is executed verbatim (never a fragment of it) in its own ``python`` process
from a scratch directory; a few blocks are followed by checks of what they computed.
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

# Run after the block, in the same interpreter: checks on the names the block defined.
CHECKS = {
    "manager": """
usage = manager.usage()
assert usage.used_pages == 0 and usage.free_pages == usage.total_pages, usage
assert out.shape == (1, 8, 64), out.shape
""",
    "o1": """
assert o1.shape == (2, 1, 8, 64), o1.shape
""",
    "cu_q_lens": """
import numpy as np
assert out.shape == (8, 8, 64) and np.isfinite(np.asarray(out)).all()
assert (np.asarray(out[7]) == 0).all() and np.abs(np.asarray(out[:7])).max() > 0
""",
    "int8_bytes": """
import numpy as np
float_bytes = quantize_load.parameter_bytes(llama.from_pretrained(TINY_DIR))
assert 0.24 < int8_bytes / float_bytes < 0.28, int8_bytes / float_bytes
want = np.ones((2, 128)) @ np.asarray(fj.dequantize(q), np.float64).T
assert y.shape == (2, 64) and np.allclose(np.asarray(y), want, atol=1e-4)
""",
    "kv_pool_bytes": """
import numpy as np
assert kv_pool_bytes / (2 * 16 * 16 * 64 * 2) == (64 + 4) / 128, kv_pool_bytes
dense = np.asarray(fj.dequantize(k_pages), np.float64)[:, :2].reshape(2, 32, 64)[:, :20]
assert np.abs(dense - np.swapaxes(np.asarray(k), 0, 1)).max() < 0.03
assert quant_out.shape == (1, 8, 64) and np.isfinite(np.asarray(quant_out)).all()
""",
    "answers": """
assert answers == ["001", "1231"], answers
""",
    "served": """
assert served == ["001", "1231", "285"], served
assert engine.manager.usage().num_sequences == 0
""",
    "sharded_tokens": """
one_device = llama.generate(llama.from_pretrained(TINY_DIR), [[3, 4, 5], [3, 6]], max_new_tokens=8)
assert sharded_tokens == one_device, (sharded_tokens, one_device)
assert model.mesh.tp == 2 and model.mesh.dp == 2
assert copy.layers[0].self_attn.qkv_proj.kernel[...].sharding.spec[0] == "tp"
""",
    "moe_out": """
import numpy as np
assert moe_out.shape == (6, 64) and mixtral_out.shape == (6, 64)
assert np.isfinite(np.asarray(moe_out)).all() and np.abs(np.asarray(mixtral_out)).max() > 0
assert feat.shape == (2, 16, 16, 16) and depthwise.shape == (2, 16, 16, 16)
""",
    "new_tokens": """
assert logits.shape[:2] == (1, 4) and len(new_tokens) == 2, (logits.shape, new_tokens)
""",
}

DRIVER = """
import json, sys
block, checks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
exec(compile(block, "README.md block", "exec"), namespace)
exec(compile(checks, "README.md block checks", "exec"), namespace)
print("README BLOCK OK")
"""


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(_blocks()) >= 4


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_block_runs_in_a_fresh_interpreter(index, tmp_path):
    block = _blocks()[index]
    checks = "".join(code for name, code in CHECKS.items()
                     if re.search(rf"^{name}\b", block, re.M))
    result = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps([block, checks]),
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "README BLOCK OK" in result.stdout, (
        f"README block {index} failed:\n{block}\n--- stdout\n{result.stdout}\n"
        f"--- stderr\n{result.stderr}")
