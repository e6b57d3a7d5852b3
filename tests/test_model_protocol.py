"""The model contract (forge_jax.models.protocol): the Llama keeps it, and the runtime's step,
engine and chat modules are written against it, importing no particular model."""

from __future__ import annotations

import ast
import pathlib

import numpy as np

from forge_jax.kv_cache import CacheSpec, ContiguousKVCache, PagedKVCache
from forge_jax.models.protocol import CausalLM, ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The runtime's modules that drive a model: none may name one.
RUNTIME = ["forge_jax/generation/steps.py", "forge_jax/serving/batch_step.py",
           "forge_jax/serving/engine.py", "forge_jax/text/chat_session.py",
           "forge_jax/text/api.py"]
MODELS = ("forge_jax.models.llama", "forge_jax.models.deepseek")


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_runtime_imports_no_particular_model():
    for name in RUNTIME:
        named = sorted(m for m in _imports(ROOT / name) if m.startswith(MODELS))
        assert named == [], f"{name} imports {named}: it should call the CausalLM contract"


def test_the_llama_keeps_the_contract(chat_model):
    model = chat_model
    assert isinstance(model, CausalLM) and isinstance(model.config, ModelConfig)
    c = model.config
    paged = model.create_cache(CacheSpec(page_size=4), batch=2, max_len=8, num_pages=4,
                               block_tables=np.arange(4, dtype=np.int32).reshape(2, 2))
    assert isinstance(paged, PagedKVCache) and paged.num_pages == 4
    assert model.cache_bytes(CacheSpec(page_size=4), batch=2, max_len=8, num_pages=4) == \
        paged.nbytes == 2 * c.num_hidden_layers * 16 * model.kv_heads * c.head_dim * 4
    contiguous = model.create_cache(CacheSpec("contiguous"), batch=2, max_len=8)
    assert isinstance(contiguous, ContiguousKVCache) and contiguous.max_len == 8
    assert model.cache_bytes(CacheSpec("contiguous"), batch=2, max_len=8) == contiguous.nbytes
    pool = model.create_pool(CacheSpec(page_size=4), num_pages=6, pages_per_seq=3)
    assert pool.num_pages == 6 and pool.block_tables.shape == (0, 3)
