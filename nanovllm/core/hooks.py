"""The hooks the core declares: small typed protocols that features implement and the fronts
(`llm.py`, `serve/`) plug in when an option or a request asks for them.

The core calls these protocols and never names a feature: a plain generate with no options runs
the core alone. One section per hook; each feature module says which hook it plugs into.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable  # noqa: F401

# ---------------------------------------------------------------- logits (sampling extensions)

# ---------------------------------------------------------------- scheduling

# ---------------------------------------------------------------- forward strategy (graphs)
