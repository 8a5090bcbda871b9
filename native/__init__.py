"""certchat's native layer: the patched llama.cpp build, its bindings, and our C++/CUDA design core.

This package is a leaf: it knows nothing of the agent, the store or the UI. Paths come
in as arguments (``native.build``) or from the pointer file the last build wrote
(``native.runtime``).
"""
