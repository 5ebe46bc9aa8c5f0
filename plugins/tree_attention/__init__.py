"""Tree attention: T tree queries over the committed KV cache plus the T tree keys.

The op every backend implements (see ``reference.tree_attention``): query i of sequence b
sees cache slots ``[0, cache_lengths[b])`` and tree key j where ``tree_mask[b, i, j]``.
"""
