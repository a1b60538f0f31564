"""Run any training script under `torch.profiler` and write rank 0's kernel time split + top kernels.

    torchrun --nproc_per_node=N bench/profile_wrap.py OUT.txt SCRIPT.py [script args...]

Used to profile the megatron-core peer (`bench/peer/peer_megatron.py`) the same way
`bench/mptrain_entry.py --bench-profile` profiles mptrain (same categories: `profile_report.py`).
The whole run is profiled (warm-up included; ``PROFILE_ITERS`` = the iterations to divide by for
ms/iteration); its timings are not benchmark numbers.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    out, script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, str(HERE))
    from profile_report import write_profile  # noqa: E402  (bench/ is not a package)

    sys.path.insert(0, str(Path(script).resolve().parent))
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        runpy.run_path(script, run_name="__main__")
    if int(os.environ.get("RANK", "0")) == 0:
        iterations = int(os.environ.get("PROFILE_ITERS", "1"))
        write_profile(out, prof.key_averages(), iterations=iterations, cuda=cuda, what="whole run")


if __name__ == "__main__":
    main()
