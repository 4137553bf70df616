"""`apex bench codec`: encode and decode speed of a batch, against pickling naive forms of it."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from functools import partial
from typing import Any

from apex.bench import batches
from apex.bench.timing import print_table, summarize, time_calls
from apex.wire import protocol


def run(seconds: float = 1.0) -> dict[str, Any]:
    cartpole, cartpole_naive = batches.cartpole()
    atari, atari_naive, source = batches.atari()
    cases = [
        ("cartpole", batches.CARTPOLE_TRANSITIONS, cartpole, cartpole_naive),
        ("atari", batches.ATARI_TRANSITIONS, atari, atari_naive),
    ]
    rows = []
    for name, n, arrays, columns in cases:
        frames = protocol.encode("batch", batches.BATCH_FIELDS, arrays)
        transitions = batches.naive_transitions(columns)
        methods: dict[str, tuple[Callable[[], object], Callable[[], object], int]] = {
            "apex": (
                partial(protocol.encode, "batch", batches.BATCH_FIELDS, arrays),
                partial(protocol.decode, frames),
                sum(len(f) for f in frames),
            )
        }
        for method, naive in (("pickle", transitions), ("pickle_columns", columns)):
            blob = pickle.dumps(naive, protocol=pickle.HIGHEST_PROTOCOL)
            methods[method] = (
                partial(pickle.dumps, naive, protocol=pickle.HIGHEST_PROTOCOL),
                partial(pickle.loads, blob),
                len(blob),
            )
        row: dict[str, Any] = {"batch": name, "transitions": n}
        for method, (encode, decode, wire_bytes) in methods.items():
            enc = summarize(time_calls(encode, seconds=seconds))["p50_us"]
            dec = summarize(time_calls(decode, seconds=seconds))["p50_us"]
            prefix = "" if method == "apex" else method + "_"
            row.update(
                {
                    f"{prefix}wire_bytes": wire_bytes,
                    f"{prefix}encode_p50_us": enc,
                    f"{prefix}decode_p50_us": dec,
                    f"{prefix}encode_transitions_per_s": round(n * 1e6 / enc),
                    f"{prefix}decode_transitions_per_s": round(n * 1e6 / dec),
                    f"{prefix}decode_mb_per_s": round(wire_bytes / dec, 1),
                }
            )
        row["decode_speedup_vs_pickle"] = round(row["pickle_decode_p50_us"] / row["decode_p50_us"], 2)
        row["decode_speedup_vs_pickle_columns"] = round(row["pickle_columns_decode_p50_us"] / row["decode_p50_us"], 2)
        rows.append(row)
    print_table(
        f"codec: one batch, apex vs pickled naive forms (Atari: {source})",
        ["batch", "method", "wire bytes", "encode µs", "decode µs", "decode transitions/s"],
        [
            [
                r["batch"],
                m,
                r[p + "wire_bytes"],
                r[p + "encode_p50_us"],
                r[p + "decode_p50_us"],
                r[p + "decode_transitions_per_s"],
            ]
            for r in rows
            for m, p in (("apex", ""), ("pickle", "pickle_"), ("pickle_columns", "pickle_columns_"))
        ],
    )
    return {
        "baseline": "pickle of the batch as a list of transitions with full frame stacks (pickle_*), "
        "and as a dict of stacked arrays (pickle_columns_*)",
        "atari_frames": source,
        "results": rows,
    }
