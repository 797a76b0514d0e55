"""What fused in a model and why not (private): ``torchpatches.coverage`` and ``python -m torchpatches coverage``.

- ``observe``: the recorder the fused patterns report each call's outcome to while a call is watched;
- ``modules``: the model's modules by name, and the classes no fusion pattern targets;
- ``timing``: the call timed with and without torchpatches on a GPU (alternated, CUDA events);
- ``report``: the report, its table and JSON; ``run``: the API's and the command line's runs.
"""
