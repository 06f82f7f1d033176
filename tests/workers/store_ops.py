"""What anyone who reaches a rendezvous store's port can do to it: a TCPStore client that runs
the operations given as JSON on argv[2] against 127.0.0.1:argv[1], then prints "done".

Operations: ``["add", key, n]``, ``["copy", from_key, to_key]``, ``["set", key, latin-1 text]``,
``["print", key]`` (the value in hex on a line of its own), ``["append", key, latin-1 text]``,
``["exists", key]`` (``True`` or ``False`` on a line of its own), ``["fill", key, n]`` (``n`` bytes
of ``"0,"``, an index grown by someone else). The tests run it as another
user (uid 65534) where they can."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

from torch.distributed import TCPStore


def main() -> None:
    store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    for op, *args in json.loads(sys.argv[2]):
        if op == "add":
            store.add(args[0], int(args[1]))
        elif op == "copy":
            store.set(args[1], store.get(args[0]))
        elif op == "set":
            store.set(args[0], args[1].encode("latin-1"))
        elif op == "append":
            store.append(args[0], args[1].encode("latin-1"))
        elif op == "fill":
            store.set(args[0], (b"0," * (int(args[1]) // 2 + 1))[:int(args[1])])
        elif op == "exists":
            print(store.check([args[0]]), flush=True)
        elif op == "print":
            print(store.get(args[0]).hex(), flush=True)
        else:
            raise SystemExit(f"unknown operation {op}")
    store.num_keys()  # a set has no reply: one round trip after them all, so none is lost when we exit
    print("done", flush=True)


if __name__ == "__main__":
    main()
