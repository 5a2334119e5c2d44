"""Attention features: step features that change which K/V a step reads or keeps (sparse, window, streaming, importance, merging)."""
