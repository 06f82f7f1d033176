"""Coverage-guided fuzzing of the wire decoder with atheris (libFuzzer for Python).

    python tests/fuzz_wire.py -runs=20000 [CORPUS_DIR]

The property: whatever bytes arrive, in whatever chunks, `FrameDecoder.feed` and
`decode_body` either yield messages or raise `wire.ProtocolError`; any other exception
is a crash that libFuzzer reports (non-zero exit, the input saved as crash-*).
Run by tests/test_hostile_input.py when atheris is installed.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from ft_client import wire


def one_input(data: bytes) -> None:
    if not data:
        return
    step = data[0] % 23 + 1  # the first byte picks the chunk size: partial frames, split headers
    body = data[1:]
    try:
        wire.decode_body(body)
    except wire.ProtocolError:
        pass
    decoder = wire.FrameDecoder()
    try:
        for i in range(0, len(body), step):
            for msg in decoder.feed(body[i : i + step]):
                wire.encode(msg)  # what was decoded encodes again (or is too big: ProtocolError)
    except wire.ProtocolError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
