"""The tools (soak run, benchmarks, device checks) as importable modules.

A regular package, so that `scripts.harness` (the cluster harness the tests share) resolves to this
checkout and never to some other `scripts` directory further down sys.path.
"""
