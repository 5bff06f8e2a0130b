"""Constrained decoding: JSON schema, regex, choice and grammar outputs (see docs/architecture.md).

``compiler`` compiles off the step loop with a cache and a time limit, ``request`` holds one
request's matcher, ``manager`` builds each step's bitmask, ``bitmask`` (torch) applies it to the
logits, ``backend`` is the interface a grammar engine implements (``xgrammar_backend``).
"""
