"""The registry core (private): how a patch is declared (``declare``), gated by versions and fingerprints
(``gates``, ``compat``), bound into its target and taken out again (``slot``), applied when its module loads
(``import_hooks``, ``lazy``), reported (``status``) and keyed into Inductor's cache (``cache_key``);
``registry`` runs them all; ``env`` reads ``TORCHPATCHES_DISABLE``.
"""
