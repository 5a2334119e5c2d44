"""The binary trace encoding: the same events as msgpack frames, for traces too large to parse as JSON.

JSON Lines stays the format every tool accepts; this one exists because parsing JSON floats and
long block lists caps a reader near 0.6 M events per CPU-second, and msgpack decodes the same
events twice as fast. Layout: a magic line (so ``head -1`` says what the file is), then frames of
a 4-byte little-endian length and a msgpack payload. Frame 0 is the header; every later frame is
a list of events, one step's worth as a rule, so a killed writer loses at most its last frame.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgspec

from .errors import TraceFormatError
from .events import KINDS, AnyEvent, Event, Header, Unknown, to_dict

__all__ = ["MAGIC", "SUFFIX", "encode_frame", "encode_header", "split_header", "FrameSplitter"]

MAGIC = b"kvdoctor-trace msgpack 1\n"
SUFFIX = ".msgpack"  # run.kvtrace.msgpack
_LEN = struct.Struct("<I")

_encoder = msgspec.msgpack.Encoder()
_events = msgspec.msgpack.Decoder(list[AnyEvent])  # type: ignore[valid-type]
_loose = msgspec.msgpack.Decoder(list[dict[str, Any]])
_header = msgspec.msgpack.Decoder(Header)


def _frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def encode_header(header: Header) -> bytes:
    return MAGIC + _frame(_encoder.encode(header))


def encode_frame(events: list[Event]) -> bytes:
    if any(type(e) is Unknown for e in events):
        return _frame(_encoder.encode([to_dict(e) for e in events]))
    return _frame(_encoder.encode(events))


def split_header(path: Path, data: bytes) -> tuple[bytes, int] | None:
    """The header frame's payload and the bytes it took, or None while ``data`` is too short."""
    start = len(MAGIC) + _LEN.size
    if len(data) < start:
        return None
    (size,) = _LEN.unpack_from(data, len(MAGIC))
    if len(data) < start + size:
        return None
    return data[start : start + size], start + size


def decode_header(payload: bytes) -> Header:
    return _header.decode(payload)


def _decode_frame(path: Path, payload: bytes, number: int) -> list[Event | Unknown]:
    try:
        return _events.decode(payload)  # type: ignore[no-any-return]
    except msgspec.ValidationError:
        pass  # a kind this version does not know: take the frame apart event by event
    except msgspec.DecodeError as exc:
        raise TraceFormatError(str(path), number, f"malformed frame {number}: {exc}") from None
    out: list[Event | Unknown] = []
    for raw in _loose.decode(payload):
        kind = raw.get("kind")
        try:
            if kind in KINDS:
                out.append(msgspec.convert(raw, KINDS[kind]))
                continue
            if not isinstance(kind, str):
                raise msgspec.ValidationError("event without a kind")
            fields = {k: v for k, v in raw.items() if k not in ("kind", "t", "step")}
            out.append(Unknown(kind=kind, t=raw.get("t", 0), step=raw.get("step", 0), fields=fields))
        except msgspec.ValidationError as exc:
            raise TraceFormatError(str(path), number, f"malformed event in frame {number}: {exc}") from None
    return out


class FrameSplitter:
    """Turns byte chunks into decoded events frame by frame; same interface as the JSON line splitter.

    The ``line`` of a format error is the frame number (the header is frame 0).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.next_frame = 1
        self.tail = b""

    def feed(self, data: bytes) -> list[Event | Unknown]:
        buf = self.tail + data if self.tail else data
        out: list[Event | Unknown] = []
        pos = 0
        while len(buf) - pos >= _LEN.size:
            (size,) = _LEN.unpack_from(buf, pos)
            end = pos + _LEN.size + size
            if end > len(buf):
                break
            out += _decode_frame(self.path, buf[pos + _LEN.size : end], self.next_frame)
            self.next_frame += 1
            pos = end
        self.tail = buf[pos:]
        return out

    def finish(self) -> tuple[list[Event | Unknown], bool]:
        """At the end of the data: leftover bytes are a frame cut short by a killed writer."""
        cut, self.tail = bool(self.tail), b""
        return [], cut
