"""Attention backends behind one interface (spec_engine.attention.base.AttentionBackend)."""
