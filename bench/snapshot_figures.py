"""The figures of bench/snapshot.py, per state size, from what its rank processes report: step
time with and without saves (and the references beside it), restore after kill -9 against
torch.load and dcp.load with the lost steps, and the peer transfer."""

from __future__ import annotations

import statistics
from typing import Any

from bench.harness import Figure


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def step_figures(label: str, r: dict[str, Any], p: dict[str, Any]) -> list[Figure]:
    pre = f"snap.{label}"
    blocks = r["blocks"]  # mode -> [per-rep block mean step time, ms]
    how = (f"{p['reps']} repetition(s) x 3 modes rotated, blocks of {p['block']} steps; a step = "
           f"{r['work'][0]} matmuls of [{r['work'][1]}]^2 float32, 1 torch thread; block time includes a final "
           f"wait(); sample = block mean step time")
    none = blocks["none"]
    noise_d = [abs(a - b) for a, b in zip(none[1:], none[:-1])]
    noise = _med(noise_d)
    copy = _med(r["copy_ms"])
    out = [
        Figure(id=f"{pre}.step.none", what=f"{label}: step, no save", unit="ms", samples=none,
               details={"how": how, "per_step_median_ms": r["per_step_median"]["none"], "state": r["state"]}),
    ]
    for m, k in (("every10", 10), ("every1", 1)):
        diffs = [a - b for a, b in zip(blocks[m], none)]
        added = _med(diffs)
        f_step = Figure(id=f"{pre}.step.{m}", what=f"{label}: step, save every {k} step{'s' if k > 1 else ''}",
                        unit="ms", samples=blocks[m],
                        details={"how": how, "per_step_median_ms": r["per_step_median"][m],
                                 "save_call_ms": summarize_ms(r["save_calls"][m])})
        if m == "every10":
            f_add = Figure(id=f"{pre}.added.{m}", what=f"{label}: added per step, save every 10 steps (x10 = per "
                           f"save: {_num(None if added is None else added * 10)} ms)", unit="ms", samples=diffs,
                           target="within noise",
                           met=None if added is None or noise is None else abs(added) <= noise,
                           details={"how": "per repetition: block mean (every 10) - block mean (no save)",
                                    "per_save_ms": None if added is None else added * 10, "noise_ms": noise})
        else:
            f_add = Figure(id=f"{pre}.added.{m}", what=f"{label}: added per step = per save, save every step",
                           unit="ms", samples=diffs, target=f"<= copy ({_num(copy)} ms)", limit=copy,
                           details={"how": "per repetition: block mean (every step) - block mean (no save)",
                                    "ratio_to_copy": None if added is None or not copy else added / copy})
        out += [f_step, f_add]
    out += [
        Figure(id=f"{pre}.noise", what=f"{label}: noise (|consecutive no-save blocks|)", unit="ms", samples=noise_d),
        Figure(id=f"{pre}.copy", what=f"{label}: copy_ of the same tensors into preallocated tensors", unit="ms",
               samples=r["copy_ms"], details={"how": "median of repeated copies, destination touched beforehand"}),
        Figure(id=f"{pre}.copy_memfd", what=f"{label}: the same copy into a mapped memfd (what save writes to)",
               unit="ms", samples=r["copy_memfd_ms"]),
        Figure(id=f"{pre}.checksum", what=f"{label}: the snapshot's checksum (XXH3-64) of the same bytes (the "
               "background finish's work)", unit="ms", samples=r["checksum_ms"],
               details={"how": "ft_client.snapshot.format.checksum over the memfd of the copy row, 1 thread"}),
        Figure(id=f"{pre}.crc32", what=f"{label}: zlib.crc32 of the same bytes (the old checksum, before dd63034)",
               unit="ms", samples=r["crc_ms"]),
        Figure(id=f"{pre}.save_call", what=f"{label}: save() alone, quiet (tensors copied, finish started)",
               unit="ms", samples=r["save_ms"]),
        Figure(id=f"{pre}.save_wait", what=f"{label}: save() + wait(), quiet (complete in the monitor's memory)",
               unit="ms", samples=r["save_wait_ms"]),
    ]
    files = r.get("files") or {}
    for key, what in (("torch_save_ms", "torch.save of the same state to a local file (no fsync), once"),
                      ("dcp_save_ms", "torch.distributed.checkpoint.save of it (no group), once")):
        if key in files:
            out.append(Figure(id=f"{pre}.{key.removesuffix('_ms')}", what=f"{label}: {what}", unit="ms",
                              samples=[files[key]], details={"how": "for comparison: the file checkpoint's write, "
                                                             "blocking, into the page cache"}))
    return out


def summarize_ms(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": _med(xs), "max": max(xs) if xs else None}


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def incident_figures(label: str, incs: list[dict[str, Any]], p: dict[str, Any]) -> list[Figure]:
    pre = f"snap.{label}"
    col = {m: [x["times_ms"][m] for x in incs] for m in ("restore", "torch_load", "dcp_load")}
    how = (f"{len(incs)} incident(s): a training process SIGKILLed, then a new process times each (order rotated); "
           "files written once by row 1's process, in the page cache (warm)")
    med = {m: _med(v) for m, v in col.items()}
    out = [
        Figure(id=f"{pre}.restore", what=f"{label}: restore() after kill -9, new process", unit="ms",
               samples=col["restore"], details={"how": how, "equal_to_file": [x["equal"] for x in incs],
                                                "complete_buffers": [x["complete_buffers"] for x in incs]}),
        Figure(id=f"{pre}.torch_load", what=f"{label}: torch.load of the same state (file, page cache)", unit="ms",
               samples=col["torch_load"], details={"how": how}),
        Figure(id=f"{pre}.dcp_load", what=f"{label}: torch.distributed.checkpoint.load (in place, no group)",
               unit="ms", samples=col["dcp_load"], details={"how": how}),
    ]
    for m in ("torch_load", "dcp_load"):
        a, b = med[m], med["restore"]
        ratio = a / b if a and b else None
        out.append(Figure(id=f"{pre}.restore_vs_{m}", what=f"{label}: {m} median / restore median", unit="x",
                          value=None if ratio is None else round(ratio, 2)))
    out.append(Figure(id=f"{pre}.restored_equal", what=f"{label}: restored state equal to the file's", unit="",
                      value=f"{sum(x['equal'] for x in incs)}/{len(incs)}", target="all",
                      met=bool(incs) and all(x["equal"] for x in incs)))
    for k in p["ks"]:
        lost = [float(x["lost"]) for x in incs if x["k"] == k]
        out.append(Figure(id=f"{pre}.lost.k{k}", what=f"{label}: lost steps per kill -9, save every {k}",
                          unit="steps", samples=lost, target=f"max <= {k}", limit=k, judge="max",
                          details={"incidents": [{key: x[key] for key in ("killed_after", "restored_step", "lost",
                                                                           "kill_in_step", "kill_fraction")}
                                                 for x in incs if x["k"] == k]}))
    return out


def peer_figures(label: str, ranks: list[dict[str, Any]], p: dict[str, Any]) -> list[Figure]:
    pre = f"snap.{label}"
    local = [max(a, b) for a, b in zip(ranks[0]["local_ms"], ranks[1]["local_ms"])]
    peer = [max(a, b) for a, b in zip(ranks[0]["peer_ms"], ranks[1]["peer_ms"])]
    diffs = [a - b for a, b in zip(peer, local)]
    transfer = _med(diffs)
    nbytes = ranks[0]["snapshot_bytes"]
    rate = nbytes / (transfer / 1000) / 1e9 if transfer else None
    how = (f"2 rank processes, gloo world 2, LOCAL_WORLD_SIZE=1, each its own monitor; {p['peer_reps']} "
           "repetition(s), peer on/off alternated; sample = the slower rank's save()->wait()")
    errors = ranks[0]["errors"] + ranks[1]["errors"]
    return [
        Figure(id=f"{pre}.peer.local", what=f"{label}: save() -> wait(), local only (2 ranks)", unit="ms",
               samples=local, details={"how": how}),
        Figure(id=f"{pre}.peer.with_copy", what=f"{label}: save() -> wait(), with the peer copy", unit="ms",
               samples=peer, details={"how": how, "errors": errors,
                                      "partner_copy_steps": [r["peer_steps"] for r in ranks]}),
        Figure(id=f"{pre}.peer.transfer", what=f"{label}: peer transfer (with copy - local), both ways at once "
               f"over loopback gloo: {'-' if rate is None else f'{rate:.2f}'} GB/s each way", unit="ms",
               samples=diffs, met=None if not errors and all(r["peer_ok"] for r in ranks) else False,
               details={"how": how + "; paired differences", "snapshot_bytes": nbytes, "gb_per_s_each_way": rate}),
    ]

