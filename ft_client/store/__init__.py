"""The room of what the ranks and the launchers share through torch's store, and how it is
kept honest (docs/reliability.md, "Who can do what"):

- `jobkey`: the job's key (from the job secret, or the launcher's own), where it lives;
- `signed`: signing and checking the values ft writes into the store (HMAC, bound to their
  key and round);
- `counter`: counters added to on a private clone of the store, so that a spoiled counter
  costs ft's clone and never the caller's connection.

May import only the hall (``ft_client.errors``, ``safefiles``, ``logs``). Used by the
in-process Wrapper and by ft-launcher's store room.
"""
