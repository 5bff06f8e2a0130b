"""Speculative decoding: proposers (n-gram, draft model) and their options; imports nothing heavy."""
