"""Shared test cases and helpers, written once for every test module (test modules never
import each other).

* :mod:`cases.references`: independent float64 NumPy references of the ops.
* :mod:`cases.inputs`: random inputs (never zeros) and poisoning (NaN / inf in every slot a
  query must not see).
* :mod:`cases.paged`: paged KV caches, block tables and ragged steps built from random data.
* :mod:`cases.checks`: comparisons with the references under the tolerance policy.
* :mod:`cases.calls`: how tests call ops (one jit per shape) and name their cases.
* :mod:`cases.shapes`: shapes of released models.
* :mod:`cases.variants`: chex's execution variants (jit, eager, device, host, pmap) for pytest.
* :mod:`cases.base` and the per-family bases (``attention_base``, ``paged_base``,
  ``ragged_base``, ``elementwise_base``): the behaviours every implementation of an op
  family must show, which each implementation's test file subclasses.
* :mod:`cases.chat_checkpoint`: the small Llama chat checkpoint the text and chat tests use.
* :mod:`cases.hf_families`: tiny random checkpoints of the decoder families saved by
  transformers, and transformers' logits and greedy tokens to compare with.
"""
