"""The doctor (private): ``torchpatches.doctor`` and ``python -m torchpatches doctor``.

- ``diagnose``: runs a workload with and without each patch and compares what Dynamo did;
- ``capture``: records graph breaks, recompiles and graphs while a block runs;
- ``sites``: where a patch's declared call sites are in the installed code;
- ``rows``, ``report``: the report and its table; ``script``: the command line's script runner.
"""
