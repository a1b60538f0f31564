"""Run folders and sweeps: the policy of DESIGN.md §2 ("What a run writes"), in one package.

- `folder`: which folder a run writes to, decided before its config resolves (`planned_config`);
- `claim`: the ranks agree on the config, rank 0 creates the folder and writes config.yaml, once the
  run has validated and built (`claim_run_dir`);
- `sweep`: the sweep root and each job's folder, and the sweep's failure policy (`SweepCallback`);
- `summary`: summary.json / summary.md of a sweep root.
"""
