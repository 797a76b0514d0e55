"""The ops' shared runtime (private): which tier runs a call (``tiers``, ``dispatch``), launching a Triton kernel
cheaply (``launch``, ``triton_common``), argument checks (``args``) and memory layout rules (``memory``).
"""
