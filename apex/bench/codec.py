"""`apex bench codec`: encode and decode speed of a batch, against pickling the naive batch."""

from __future__ import annotations

import pickle

from apex import protocol
from apex.bench import batches
from apex.bench.timing import print_table, summarize, time_calls


def run(seconds: float = 1.0) -> dict:
    cartpole, cartpole_naive = batches.cartpole()
    atari, atari_naive, source = batches.atari()
    cases = [
        ("cartpole", batches.CARTPOLE_TRANSITIONS, cartpole, cartpole_naive),
        ("atari", batches.ATARI_TRANSITIONS, atari, atari_naive),
    ]
    rows = []
    for name, n, arrays, naive in cases:
        frames = protocol.encode("batch", batches.BATCH_FIELDS, arrays)
        blob = pickle.dumps(naive, protocol=pickle.HIGHEST_PROTOCOL)
        methods = {
            "apex": (
                lambda: protocol.encode("batch", batches.BATCH_FIELDS, arrays),
                lambda: protocol.decode(frames),
                sum(len(f) for f in frames),
            ),
            "pickle": (
                lambda: pickle.dumps(naive, protocol=pickle.HIGHEST_PROTOCOL),
                lambda: pickle.loads(blob),
                len(blob),
            ),
        }
        figures = {}
        for method, (encode, decode, wire_bytes) in methods.items():
            enc = summarize(time_calls(encode, seconds=seconds))["p50_us"]
            dec = summarize(time_calls(decode, seconds=seconds))["p50_us"]
            figures[method] = {
                "wire_bytes": wire_bytes,
                "encode_p50_us": enc,
                "decode_p50_us": dec,
                "encode_transitions_per_s": round(n * 1e6 / enc),
                "decode_transitions_per_s": round(n * 1e6 / dec),
                "encode_mb_per_s": round(wire_bytes / enc, 1),
                "decode_mb_per_s": round(wire_bytes / dec, 1),
            }
        rows.append(
            {
                "batch": name,
                "transitions": n,
                **{f"{k}": v for k, v in figures["apex"].items()},
                **{f"pickle_{k}": v for k, v in figures["pickle"].items()},
                "decode_speedup_vs_pickle": round(figures["pickle"]["decode_p50_us"] / figures["apex"]["decode_p50_us"], 2),
            }
        )
    print_table(
        f"codec: one batch, apex encode/decode vs pickle of the naive batch (Atari: {source})",
        ["batch", "method", "wire bytes", "encode µs", "decode µs", "decode transitions/s", "decode MB/s"],
        [
            [r["batch"], m, r[p + "wire_bytes"], r[p + "encode_p50_us"], r[p + "decode_p50_us"],
             r[p + "decode_transitions_per_s"], r[p + "decode_mb_per_s"]]
            for r in rows
            for m, p in (("apex", ""), ("pickle", "pickle_"))
        ],
    )
    return {"baseline": "pickle of the naive batch (full frame stacks for obs and next_obs)", "atari_frames": source, "results": rows}
