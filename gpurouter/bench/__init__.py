"""The benchmarks behind ``python -m gpurouter bench|steps|moe-bench``.

- ``router``: router speed per preset, backend and transport (``bench``);
- ``steps``: jitted forward + backward steps per path, and each transport's per-op cost (``steps``);
- ``moe``: the MoE block end to end and by stage (``moe-bench``);
- ``timing``: the one kernel timer (CUDA events behind a sleep kernel), also the API of the probes in
  ``tools/probes``.

Not imported by ``import gpurouter``.
"""
