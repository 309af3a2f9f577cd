"""Write one of the simulator's synthetic workloads (``hot-prefix``, ``tot2``, ``tot4``,
``synthetic``) as a Mooncake JSONL trace, so the live benchmark (`skymesh bench --trace
FILE`) replays exactly the requests the discrete-event mode runs, and a goodput search
scales one fixed day's time (the synthetic stream, run directly, keeps its request count
and stretches its day with the rate).

    .venv/bin/python -m benchmarks.write_workload --trace tot2 --requests 600 --rate 20 --seed 0 \\
        --out bench-out/tot2-seed0.jsonl

Every row names its session (the tree, the hot-prefix user, the conversation), so the
live replay keeps the sessions the simulator uses instead of inferring them from shared
prefixes; a synthetic conversation's row names its region too (the stream drew it and
thinned it by that region's diurnal curve: replay it with ``--diurnal-period-s 0``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.bench import sim_setup  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sim_setup.add_arguments(ap)  # its --out names the file here
    args = ap.parse_args()
    if args.trace not in ("hot-prefix", "tot2", "tot4", "synthetic"):
        raise SystemExit("--trace: one of hot-prefix, tot2, tot4, synthetic")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = list(sim_setup.build_trace(args))
    with out.open("w") as f:
        for r in rows:
            row = {"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": r.input_len,
                   "output_length": r.output_len, "hash_ids": list(r.hash_ids), "session_id": r.session}
            if r.region:
                row["region"] = r.region
            f.write(json.dumps(row) + "\n")
    print(f"wrote {out}: {len(rows)} requests over {rows[-1].arrival_s:.1f} s")


if __name__ == "__main__":
    main()
